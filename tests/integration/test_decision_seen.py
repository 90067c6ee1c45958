"""kvguard's decision as the client and the operator see it through the shipped envoy/envoy.yaml:
the x-kvguard-max-tokens response header (opt-in, from dynamic metadata, with no response
message to kvguard) and Envoy's JSON access log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import gateway

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
    assert (first["status"], first["details"], first["reason"]) == (200, "via_upstream", None)
    assert (first["tenant"], first["max_tokens"]) == ("acme", "512")
    assert first["path"] == "/v1/chat/completions" and isinstance(first["duration_ms"], int)
    assert (second["status"], second["reason"]) == (404, "model_not_found")
    assert second["details"] == "kvguard_model_not_found"
    assert second["lease"] is None and second["upstream_host"] is None
    assert first["request_id"] and first["request_id"] != second["request_id"]
