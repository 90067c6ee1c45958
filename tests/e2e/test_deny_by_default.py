"""Deny by default through the real Envoy (envoy/envoy.yaml): a path that is neither guarded nor
read-only is answered 404 `endpoint_not_served` in the OpenAI error schema and never reaches
vLLM, by kvguard (counted in its metrics) and, should kvguard pass it, by Envoy's own last
route; the guarded and read-only paths still reach vLLM. Targets that differ from a served path
by a slash, a dot segment, a case or an escape, sent as written, and other methods, reach
nothing they should not, with kvguard and by Envoy's routes alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.errors import Code
from kvguard.extproc.routes import NOT_SERVED, READ_ONLY_PATHS, not_served
from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    EnvoyProcess,
    loopback_config,
    without_http_filter,
)
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from kvguard.tokens.request import GUARDED_PATHS
from tests.gateway import gateway
from tests.vllm_routes import VLLM_ROUTES

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
REFUSED = ["/v1/chat/completions/batch", "/invocations", "/v1/foo"]
OBSERVE_FILTER = "kvguard.observe"


async def call(
    http: aiohttp.ClientSession, method: str, url: str, payload: Any = None
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(payload).encode() if payload is not None else None
    headers = {"content-type": "application/json", "x-tenant-id": "acme"}
    async with http.request(method, url, data=data, headers=headers) as response:
        return (
            response.status,
            {k.lower(): v for k, v in response.headers.items()},
            await response.read(),
        )


def assert_not_served(answer: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = answer
    assert status == 404, body
    assert headers["content-type"] == "application/json"
    assert headers["x-kvguard-reason"] == "endpoint_not_served"
    assert body == not_served().body()  # the same bytes from kvguard and from Envoy's route
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


async def test_generating_side_doors_get_404_and_reach_nothing(tmp_path: Path) -> None:
    async with gateway(tmp_path, metrics_listen="127.0.0.1:0") as gw:
        answers = [await call(gw.http, "POST", gw.url + path, CHAT) for path in REFUSED]
        models = await call(gw.http, "GET", gw.url + "/v1/models")
        port = gw.service.providers.metrics_port

        async def refusals() -> str:
            async with gw.http.get(f"http://127.0.0.1:{port}/metrics") as response:
                return await response.text()

        counted = (
            'kvguard_admissions_total{outcome="refused",pool="",'
            f'reason="{Code.ENDPOINT_NOT_SERVED.value}",tier=""}} 3.0'
        )

        async def all_counted() -> bool:
            return counted in await refusals()

        await wait_until(all_counted, "kvguard to count the three refusals")
        seen = [(r.method, r.path) for r in gw.upstream.requests]
    for answer in answers:
        assert_not_served(answer)
    assert models[0] == 200
    assert seen == [("GET", "/v1/models")]  # the refused requests reached nothing


async def test_envoys_routes_alone_deny_by_default(
    tmp_path: Path, upstream: RecordingUpstream, refusing_port: int
) -> None:
    """Without kvguard's filter, Envoy's allow-list forwards exactly what kvguard serves (each
    of vLLM 0.32's routes) and answers every other request with kvguard's own 404."""
    config = loopback_config(refusing_port, upstream.port)
    config = without_http_filter(without_http_filter(config, EXT_PROC_FILTER), OBSERVE_FILTER)
    answers = {}
    async with EnvoyProcess(config, tmp_path) as envoy, aiohttp.ClientSession() as http:
        for method, path in VLLM_ROUTES:
            payload = CHAT if method == "POST" else None
            answers[method, path] = await call(http, method, envoy.url + path, payload)
        for path in REFUSED:
            query = path + "?x=1"
            answers["POST", query] = await call(http, "POST", envoy.url + query, CHAT)
    forwarded = {(r.method, r.path) for r in upstream.requests}
    for (method, path), answer in answers.items():
        if VLLM_ROUTES.get((method, path), NOT_SERVED) == NOT_SERVED:
            assert_not_served(answer)
            assert (method, path.partition("?")[0]) not in forwarded
        else:
            assert answer[0] == 200, (method, path)
            assert (method, path) in forwarded


# Targets that differ from a served path by a slash, a dot segment, a case, an escape or a
# parameter. vLLM's server decodes escapes (`%2F` too) before it routes, so some of these reach
# a generating route there; through the gateway each must be refused.
ODD_TARGETS = [
    "//v1/chat/completions",
    "/v1//chat/completions",
    "/v1/chat/completions/",
    "/V1/chat/completions",
    "/v1/Chat/Completions",
    "/v1/chat%2Fcompletions",
    "/v1/chat%2fcompletions",
    "/v1/chat/%63ompletions",
    "/%761/chat/completions",
    "/v1/./chat/completions",
    "/v1/models/../chat/completions",
    "/tokenize/../v1/chat/completions/batch",
    "/v1/chat/completions;x=1",
    "/v1/chat/completions%3Fx=1",
    "/v1/chat/completions%20",
    "/v1/chat/completions/batch?next=/v1/chat/completions",
    "/invocations?/v1/chat/completions",
]
# Methods other than the one a path is meant for: a guarded path is guarded whatever its method
# (without a body it is invalid), a read-only one passes with its own methods only.
GUARDED_WITHOUT_BODY = [
    ("HEAD", "/v1/chat/completions"),
    ("OPTIONS", "/v1/chat/completions"),
    ("GET", "/v1/completions"),
]
METERED = [("PUT", "/v1/chat/completions"), ("POST", "/v1/chat/completions?api-version=1")]
READ_ONLY_OTHER_METHODS = [
    ("OPTIONS", "/v1/models"),
    ("POST", "/v1/models"),
    ("PUT", "/tokenize"),
    ("GET", "/tokenize"),
]
READ_ONLY_HEAD = [("HEAD", "/v1/models"), ("HEAD", "/metrics")]


async def raw_request(
    port: int, method: str, target: str, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request with its request target exactly as written (a client library would
    normalise dot segments and escapes); the connection closes after the answer."""
    head = (
        f"{method} {target} HTTP/1.1\r\nhost: gateway\r\nx-tenant-id: acme\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            answer = await reader.read()  # to the end: Envoy closes the connection
        finally:
            writer.close()
            await writer.wait_closed()
    response_head, _, content = answer.partition(b"\r\n\r\n")
    status_line, *lines = response_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, content


def allowed(method: str, path: str) -> bool:
    return path in GUARDED_PATHS or method in READ_ONLY_PATHS.get(path, ())


@pytest.mark.parametrize("with_kvguard", [True, False], ids=["envoy+kvguard", "envoy-alone"])
async def test_odd_targets_and_methods_never_reach_a_path_not_served(
    tmp_path: Path, upstream: RecordingUpstream, refusing_port: int, with_kvguard: bool
) -> None:
    """What vLLM receives (the upstream records the path decoded, as vLLM's server routes on
    it) is only ever a served path with a method it is served for, and with kvguard every
    request on a guarded path carries its reservation; each odd target is kvguard's 404."""
    answers: dict[tuple[str, str], tuple[int, dict[str, str], bytes]] = {}
    chat = json.dumps(CHAT).encode()
    requests = [("POST", target, chat) for target in ODD_TARGETS]
    requests += [(method, target, chat) for method, target in METERED]
    requests += [(method, target, b"") for method, target in GUARDED_WITHOUT_BODY]
    requests += [(method, target, b"") for method, target in READ_ONLY_OTHER_METHODS]
    requests += [(method, target, b"") for method, target in READ_ONLY_HEAD]
    if with_kvguard:
        async with gateway(tmp_path) as gw:
            for method, target, body in requests:
                answers[method, target] = await raw_request(
                    gw.envoy.listener_port, method, target, body
                )
            forwarded = list(gw.upstream.requests)
    else:
        config = loopback_config(refusing_port, upstream.port)
        config = without_http_filter(without_http_filter(config, EXT_PROC_FILTER), OBSERVE_FILTER)
        async with EnvoyProcess(config, tmp_path) as envoy:
            for method, target, body in requests:
                answers[method, target] = await raw_request(
                    envoy.listener_port, method, target, body
                )
        forwarded = list(upstream.requests)
    for target in ODD_TARGETS:
        assert_not_served(answers["POST", target])
    for request in forwarded:
        assert allowed(request.method, request.path), (request.method, request.path)
        if with_kvguard and request.path in GUARDED_PATHS:
            assert "x-kvguard-blocks" in request.headers, (request.method, request.path)
    assert set(READ_ONLY_HEAD) <= {(r.method, r.path) for r in forwarded}
    for method, target in READ_ONLY_OTHER_METHODS:
        assert_not_served(answers[method, target])
    if with_kvguard:
        for method, target in GUARDED_WITHOUT_BODY:
            status, headers, _ = answers[method, target]
            assert (status, headers["x-kvguard-reason"]) == (400, "invalid_request")
        metered = {(r.method, r.path) for r in forwarded if r.path in GUARDED_PATHS}
        assert metered == {("PUT", "/v1/chat/completions"), ("POST", "/v1/chat/completions")}
