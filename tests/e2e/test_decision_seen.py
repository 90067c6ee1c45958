"""kvguard's decision as the client and the operator see it through the shipped envoy/envoy.yaml:
the x-kvguard-max-tokens response header (opt-in, from dynamic metadata, with no response
message to kvguard) and Envoy's JSON access log, whose decision fields are kvguard's dynamic
metadata, never headers a client sent."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordingUpstream
from tests.gateway import gateway

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


@pytest.mark.parametrize("expose", [True, False])
async def test_the_client_sees_the_applied_limit_when_exposed(tmp_path: Path, expose: bool) -> None:
    async with gateway(tmp_path, expose_limit_header=expose) as gw:
        clamped = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 100000})
        injected = await gw.post("/v1/completions", {"model": "qwen", "prompt": "Once upon"})
        refused = await gw.post("/v1/chat/completions", {**CHAT, "model": "nope"})
        stats = await gw.envoy.stats(r"ext_proc\.stream_msgs_sent")
    assert [r[0] for r in (clamped, injected, refused)] == [200, 200, 404]
    seen = [r.json()["max_tokens"] for r in gw.upstream.requests]
    assert seen == [512, 128]  # pro: the cap, the default
    shown = [r[1].get("x-kvguard-max-tokens") for r in (clamped, injected, refused)]
    assert shown == (["512", "128", None] if expose else [None, None, None])
    # Request headers and body, two messages per request: the header costs no response-headers
    # round trip.
    assert stats == {"http.gateway.ext_proc.stream_msgs_sent": 6}


def access_log(path: Path) -> list[dict[str, Any]]:
    """Envoy's access log lines (JSON objects) among its own log lines."""
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


async def test_the_access_log_carries_kvguards_decision(tmp_path: Path) -> None:
    async with gateway(tmp_path, expose_limit_header=True) as gw:
        admitted = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 100000})
        refused = await gw.post("/v1/chat/completions", {**CHAT, "model": "nope"})
        log_path = gw.envoy.log_path
    assert (admitted[0], refused[0]) == (200, 404)
    (upstream,) = gw.upstream.requests
    first, second = access_log(log_path)  # written by the time Envoy has exited
    assert first["lease"] == upstream.headers["x-kvguard-lease"]
    assert first["blocks"] == upstream.headers["x-kvguard-blocks"]
    assert first["prompt_tokens"] == upstream.headers["x-kvguard-prompt-tokens"]
    assert first["reserved_output"] == upstream.headers["x-kvguard-reserved-output"] == "512"
    assert (first["status"], first["details"], first["reason"]) == (200, "via_upstream", None)
    assert (first["tenant"], first["max_tokens"]) == ("acme", "512")
    assert first["path"] == "/v1/chat/completions" and isinstance(first["duration_ms"], int)
    assert (second["status"], second["reason"]) == (404, "model_not_found")
    assert second["details"] == "kvguard_model_not_found"
    assert second["tenant"] == "acme"  # metadata set with an immediate response is logged too
    assert second["lease"] is None and second["upstream_host"] is None
    assert first["request_id"] and first["request_id"] != second["request_id"]


# What a client may send to pass for another tenant, or to plant a decision in the log.
FORGED = {
    "x-kvguard-lease": "forged",
    "x-kvguard-blocks": "1",
    "x-kvguard-prompt-tokens": "1",
    "x-kvguard-would-refuse": "forged",
    "x-kvguard-reserved-output": "1",
    # The endpoint picker's: a client never chooses the pod, or claims one served it.
    "x-gateway-destination-endpoint": "10.0.0.9:8000",
    "x-gateway-destination-endpoint-served": "10.0.0.9:8000",
    "x-gateway-destination-endpoint-subset": "10.0.0.9:8000",
}
PICKER = [name for name in FORGED if name.startswith("x-gateway-")]
DECISION = (
    "tenant", "lease", "blocks", "prompt_tokens", "reserved_output", "would_refuse", "max_tokens"
)  # fmt: skip
API_KEY = "sk-acme-0123456789"


def by_api_key(data: dict[str, Any]) -> None:
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    data["tenancy"].update(identity="api_key", api_keys={digest: "acme"})


def by_org_header(data: dict[str, Any]) -> None:
    data["tenancy"]["header"] = "x-org"


@pytest.mark.parametrize(
    ("edit", "identity"),
    [(by_api_key, {"authorization": f"Bearer {API_KEY}"}), (by_org_header, {"x-org": "acme"})],
    ids=["api_key", "tenancy.header"],
)
async def test_the_access_log_shows_the_tenant_kvguard_metered(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], identity: dict[str, str]
) -> None:
    """acme's identity with x-tenant-id: victim is metered and logged as acme, with kvguard's
    lease, blocks and prompt tokens rather than the client's copies."""
    async with gateway(tmp_path, edit) as gw:
        status, _, _ = await gw.post("/v1/chat/completions", CHAT, "victim", **identity, **FORGED)
        log_path = gw.envoy.log_path
    assert status == 200
    (upstream,) = gw.upstream.requests
    (line,) = access_log(log_path)
    assert {key: line[key] for key in DECISION} == {
        "tenant": "acme",
        "lease": upstream.headers["x-kvguard-lease"],
        "blocks": upstream.headers["x-kvguard-blocks"],
        "prompt_tokens": upstream.headers["x-kvguard-prompt-tokens"],
        "reserved_output": upstream.headers["x-kvguard-reserved-output"],
        "would_refuse": None,
        "max_tokens": str(upstream.json()["max_tokens"]),
    }
    assert upstream.headers["x-kvguard-lease"] != "forged"
    assert [name for name in PICKER if name in upstream.headers] == []


async def test_refused_requests_log_no_decision_header_their_client_sent(tmp_path: Path) -> None:
    """Refused at the headers (401, before kvguard removes the client's x-kvguard-* headers)
    or at the body: only what kvguard said is logged."""
    async with gateway(tmp_path, default_tier=None) as gw:
        unknown = await gw.post("/v1/chat/completions", CHAT, "victim", **FORGED)
        too_big = await gw.post("/v1/chat/completions", {**CHAT, "n": 1000}, **FORGED)
        log_path = gw.envoy.log_path
    assert (unknown[0], too_big[0]) == (401, 400)
    first, second = access_log(log_path)
    assert first["reason"] == "unknown_tenant"
    assert {key: first[key] for key in DECISION} == dict.fromkeys(DECISION)
    assert second["reason"] == "request_exceeds_capacity"
    assert {key: second[key] for key in DECISION} == {**dict.fromkeys(DECISION), "tenant": "acme"}
    assert gw.upstream.requests == []


async def test_the_access_log_shows_what_shadow_mode_would_refuse(tmp_path: Path) -> None:
    async with gateway(tmp_path, shadow=True, blocks=20) as gw:  # 512 tokens need 33 blocks
        status, _, _ = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 512})
        log_path = gw.envoy.log_path
    assert status == 200
    (line,) = access_log(log_path)
    assert {key: line[key] for key in DECISION} == {
        **dict.fromkeys(DECISION),
        "tenant": "acme",
        "would_refuse": "request_exceeds_capacity",
    }
    assert gw.upstream.requests[0].headers["x-kvguard-would-refuse"] == "request_exceeds_capacity"


async def test_kvguard_unreachable_logs_no_decision_header_the_client_sent(
    tmp_path: Path,
) -> None:
    upstream = RecordingUpstream()
    await upstream.start()
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        config = loopback_config(closed.getsockname()[1], upstream.port)
        async with EnvoyProcess(config, tmp_path) as envoy, aiohttp.ClientSession() as http:
            headers = {"x-tenant-id": "acme", **FORGED}
            url = f"{envoy.url}/v1/chat/completions"
            async with http.post(url, json=CHAT, headers=headers) as response:
                assert response.status == 503
    await upstream.stop()
    (line,) = access_log(envoy.log_path)
    assert line["reason"] == "kvguard_unavailable"
    assert {key: line[key] for key in DECISION} == dict.fromkeys(DECISION)
