"""No door left open on the real vLLM: its own route table (`/openapi.json`) is read, and every
route is either guarded by kvguard, refused by it (sent through Envoy + kvguard: 404
`endpoint_not_served`, and vLLM receives nothing), or read-only, which is proven on this very
server (calling it moves none of vLLM's request or token counters). The next vLLM release's new
endpoints are checked the same way before it can open a door unnoticed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.extproc.routes import NOT_SERVED, READ_ONLY, classify, not_served
from kvguard.testing.vllm import VllmProcess
from kvguard.tokens.request import GUARDED_PATHS
from tests.live.harness import gateway

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

TENANCY = {
    "header": "x-tenant-id",
    "default_tier": "pro",
    "tiers": {"pro": {"max_tokens_cap": 16, "default_max_tokens": 4, "max_blocks": 60}},
}
# OpenAPI's operations; HEAD and OPTIONS are answered by the framework, never listed.
METHODS = ("get", "put", "post", "delete", "patch")
# A request a read-only endpoint accepts, as vLLM's request models read it.
READ_ONLY_BODIES: dict[str, dict[str, Any]] = {
    "/tokenize": {"model": "qwen", "prompt": "how many tokens is this?"},
    "/detokenize": {"model": "qwen", "tokens": [9707, 11, 1879]},
    "/v1/messages/count_tokens": {
        "model": "qwen",
        "messages": [{"role": "user", "content": "how many tokens is this?"}],
    },
}
# What vLLM counts for every request it runs and every token it computes or generates.
ENGINE_COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


async def route_table(vllm: VllmProcess, http: aiohttp.ClientSession) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation in vLLM's OpenAPI document; a path parameter is
    filled with a value (`/v1/responses/{response_id}` -> `/v1/responses/x`)."""
    async with http.get(vllm.url + "/openapi.json") as response:
        assert response.status == 200
        document = await response.json()
    return [
        (method.upper(), re.sub(r"\{[^}/]+\}", "x", path))
        for path, operations in document["paths"].items()
        for method in METHODS
        if method in operations
    ]


async def send(
    http: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"x-tenant-id": "acme"}
    async with http.request(method, url, json=body, headers=headers) as response:
        answer = {k.lower(): v for k, v in response.headers.items()}
        return response.status, answer, await response.read()


async def test_every_route_of_vllm_is_guarded_refused_or_read_only(
    vllm: VllmProcess, tmp_path: Path
) -> None:
    async with aiohttp.ClientSession() as http:
        table = await route_table(vllm, http)
        classes = {route: classify(*route) for route in table}
        # kvguard guards endpoints that exist: a renamed one would leave the new name refused
        # and the old one guarded for nothing.
        for path in GUARDED_PATHS:
            assert ("POST", path) in table, f"vLLM does not serve POST {path}"

        # Read-only: each answers on this vLLM and moves none of its engine's counters.
        read_only = sorted(r for r, c in classes.items() if c == READ_ONLY)
        assert {"GET /v1/models", "POST /tokenize"} <= {f"{m} {p}" for m, p in read_only}
        before = await vllm.metrics()
        for method, path in read_only:
            status, _, body = await send(http, method, vllm.url + path, READ_ONLY_BODIES.get(path))
            assert status == 200, (method, path, body[:300])
        after = await vllm.metrics()
        moved = {k: (before.get(k), after.get(k)) for k in ENGINE_COUNTERS}
        moved = {k: v for k, v in moved.items() if v[0] != v[1]}
        assert moved == {}, f"a read-only endpoint ran the engine: {moved}"

        # Refused: every other route, through Envoy + kvguard, is kvguard's 404 and reaches
        # nothing (the recording proxy in front of vLLM sees no request).
        refused = sorted(r for r, c in classes.items() if c == NOT_SERVED)
        assert ("POST", "/v1/chat/completions/batch") in refused
        assert ("POST", "/invocations") in refused
        async with gateway(tmp_path / "stack", vllm, TENANCY) as stack:
            answers = {}
            for method, path in refused:
                payload = None if method == "GET" else {"model": "qwen"}
                answers[method, path] = await send(http, method, stack.url + path, payload)
            for method, path in read_only:
                payload = READ_ONLY_BODIES.get(path)
                status, _, _ = await send(http, method, stack.url + path, payload)
                assert status == 200, (method, path)
            reached = [(r.method, r.path) for r in stack.proxy.requests]
    expected = json.loads(not_served().body())
    for route, (status, headers, body) in answers.items():
        assert status == 404, (route, body[:300])
        assert headers["x-kvguard-reason"] == "endpoint_not_served", route
        assert json.loads(body) == expected, route
    assert reached == read_only  # the read-only requests, and nothing refused
