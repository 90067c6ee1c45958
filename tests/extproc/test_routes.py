"""Deny by default: the classification of a request's method and path (pure), and what kvguard
answers on the ext_proc stream for each class (guarded, read-only, not served)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvguard.errors import Code
from kvguard.extproc.routes import (
    NOT_SERVED,
    NOT_SERVED_MESSAGE,
    READ_ONLY,
    READ_ONLY_PATHS,
    classify,
)
from kvguard.ops.telemetry import Providers
from kvguard.tokens.request import GUARDED_PATHS
from tests.extproc.harness import exchange, headers, refusal, reserved, running
from tests.vllm_routes import VLLM_ROUTES


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [(m, p, e) for (m, p), e in VLLM_ROUTES.items()],
)
def test_vllms_routes_are_classified(method: str, path: str, expected: str) -> None:
    assert classify(method, path) == expected


def test_guarded_paths_are_guarded_whatever_the_method_and_query() -> None:
    for path, kind in GUARDED_PATHS.items():
        assert classify("POST", path) == kind
        assert classify("POST", path + "?api-version=1&x=/v1/foo") == kind
        assert classify("GET", path) == kind  # then refused for its missing body


def test_read_only_paths_pass_only_with_their_methods() -> None:
    for path, methods in READ_ONLY_PATHS.items():
        for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", ""):
            expected = READ_ONLY if method in methods else NOT_SERVED
            assert classify(method, path) == expected, (method, path)
            assert classify(method, path + "?format=json") == expected, (method, path)
    assert classify("HEAD", "/health") == READ_ONLY


def test_no_served_path_is_one_that_a_server_would_rewrite() -> None:
    """Exact matching is safe only for paths that no server decodes or collapses into another:
    lowercase segments, no escape, no empty or dot segment, no trailing slash."""
    for path in [*GUARDED_PATHS, *READ_ONLY_PATHS]:
        segments = path.split("/")
        assert segments[0] == "" and all(segments[1:]), path
        assert all(s not in (".", "..") for s in segments), path
        assert path == path.lower() and not set(path) & set("%;?#\\ "), path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/",
        "/v1/foo",
        "/v1/chat/completions/",  # vLLM would redirect it: the client sends it again, exactly
        "/v1//chat/completions",
        "//v1/chat/completions",
        "/v1/./chat/completions",
        "/v1/chat/completions%20",
        "/v1/chat/completions;x=1",
        "/V1/chat/completions",
        "/v1/chat%2Fcompletions",  # uvicorn decodes it into the chat route
        "/v1/chat/completions#x",
        "v1/chat/completions",
        "/v1/models/qwen",
        "/health/",
        "/metrics/x",
        "/tokenize/../v1/chat/completions/batch",
    ],
)
def test_only_exact_paths_pass(path: str) -> None:
    assert classify("POST", path) == NOT_SERVED
    assert classify("GET", path) == NOT_SERVED


# --- on the ext_proc stream ------------------------------------------------------------------


def admissions(reader: InMemoryMetricReader) -> dict[tuple[str, ...], int]:
    data = reader.get_metrics_data()
    assert data is not None
    points: list[Any] = [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "kvguard_admissions"
        for point in metric.data.data_points
    ]
    labels = ("pool", "tier", "outcome", "reason")
    return {tuple(str(p.attributes[k]) for k in labels): int(p.value) for p in points}


def request(method: str, path: str, **extra: str) -> Any:
    return headers(path, {":method": method, **extra})


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions/batch"),
        ("POST", "/invocations"),
        ("POST", "/v1/foo?stream=true"),
        ("POST", "/v1/models"),
        ("GET", "/v1/responses/resp_1"),
    ],
)
async def test_an_endpoint_not_served_is_refused_404_and_counted(
    tmp_path: Path, method: str, path: str
) -> None:
    reader = InMemoryMetricReader()
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers) as (service, stub):
        _, (answer,) = await exchange(stub, request(method, path, **{"x-request-id": "r1"}))
        status, sent, error = refusal(answer)
        assert status == 404
        assert sent["content-type"] == "application/json"
        assert sent["x-kvguard-reason"] == "endpoint_not_served"
        assert "retry-after" not in sent
        assert error == {
            "error": {
                "message": NOT_SERVED_MESSAGE,
                "type": "invalid_request_error",
                "param": None,
                "code": "endpoint_not_served",
            }
        }
        assert answer.immediate_response.details == "kvguard_endpoint_not_served"
        assert admissions(reader) == {("", "", "refused", Code.ENDPOINT_NOT_SERVED.value): 1}
        assert await reserved(service) == 0


async def test_shadow_mode_refuses_an_endpoint_not_served_too(tmp_path: Path) -> None:
    """Shadow mode lets capacity refusals pass; an endpoint nothing meters is no such thing."""
    async with running(tmp_path, shadow=True) as (_, stub):
        _, (answer,) = await exchange(stub, request("POST", "/invocations"))
        assert refusal(answer)[0] == 404


async def test_an_endpoint_not_served_is_refused_before_its_tenant(tmp_path: Path) -> None:
    """No tenant is needed to be told a path does not exist (and none is given a 401)."""
    async with running(tmp_path, default_tier=None) as (_, stub):
        _, (answer,) = await exchange(stub, headers("/v1/foo", tenant="stranger"))
        assert refusal(answer)[1]["x-kvguard-reason"] == "endpoint_not_served"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/health"), ("HEAD", "/v1/models"), ("GET", "/metrics?x=1"), ("POST", "/tokenize")],
)
async def test_a_read_only_endpoint_passes_unbuffered(
    tmp_path: Path, method: str, path: str
) -> None:
    async with running(tmp_path) as (service, stub):
        _, (answer,) = await exchange(stub, request(method, path, **{"x-kvguard-lease": "x"}))
        assert answer.WhichOneof("response") == "request_headers"
        assert answer.mode_override.request_body_mode == answer.mode_override.NONE
        removed = answer.request_headers.response.header_mutation.remove_headers
        assert list(removed) == ["x-kvguard-lease"]
        assert await reserved(service) == 0


async def test_a_read_only_endpoint_needs_a_known_identity(tmp_path: Path) -> None:
    """With API-key identity and no default tier, nobody without a known key is served, not
    even a read-only endpoint (the gateway may hand vLLM its own key for it)."""
    key = "sk-acme-0123456789"
    digest = hashlib.sha256(key.encode()).hexdigest()
    async with running(tmp_path, default_tier=None) as (service, stub):
        tenancy = service.config.tenancy.model_copy(
            update={"identity": "api_key", "api_keys": {digest: "acme"}}
        )
        service.publish(dataclasses.replace(service.policy, tenancy=tenancy))
        for method, path in (("GET", "/v1/models"), ("POST", "/tokenize")):
            _, (anonymous,) = await exchange(stub, request(method, path))
            assert refusal(anonymous)[0] == 401
            assert refusal(anonymous)[1]["x-kvguard-reason"] == "unknown_tenant"
            wrong = {"authorization": "Bearer sk-guess"}
            _, (guessed,) = await exchange(stub, request(method, path, **wrong))
            assert refusal(guessed)[0] == 401
            known = {"authorization": f"Bearer {key}"}
            _, (served,) = await exchange(stub, request(method, path, **known))
            assert served.WhichOneof("response") == "request_headers"


async def test_a_guarded_path_with_a_query_string_waits_for_its_body(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, stub):
        _, (answer,) = await exchange(
            stub, request("POST", "/v1/chat/completions?api-version=2024-10-21")
        )
        assert answer.WhichOneof("response") == "request_headers"
        assert not answer.HasField("mode_override")  # its body comes to kvguard, buffered
