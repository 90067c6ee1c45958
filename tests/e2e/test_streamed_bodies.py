"""FULL_DUPLEX_STREAMED bodies, as the Gateway API Inference Extension's gateways send them to
an endpoint picker, through the real Envoy: the request decided on its whole body, the headers'
answer held until then, every body (request and response) sent back in chunks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from kvguard.testing.envoy import EnvoyProcess, loopback_config, streamed_bodies
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.extproc.harness import reserved, running

TIERS = {
    "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 40},
    "pro": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 10_000},
}
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


def streamed_config(kvguard_port: int, upstream_port: int) -> dict[str, Any]:
    """The shipped configuration with both bodies FULL_DUPLEX_STREAMED, as GIE gateways
    configure ext_proc."""
    return streamed_bodies(loopback_config(kvguard_port, upstream_port))


async def test_streamed_bodies_are_decided_whole_and_pass_whole(tmp_path: Path) -> None:
    upstream = RecordingUpstream()
    await upstream.start()
    # Larger than one chunk back (62,000 bytes) and than the chunks Envoy sends.
    long_prompt = "bonjour " * 10_000
    big = {"model": "qwen", "messages": [{"role": "user", "content": long_prompt}]}
    try:
        async with (
            running(tmp_path, max_model_len=1 << 16, blocks=20_000, tiers=TIERS) as (service, _),
            EnvoyProcess(streamed_config(service.grpc.port, upstream.port), tmp_path) as envoy,
            aiohttp.ClientSession() as http,
        ):
            await envoy.wait_cluster_healthy("kvguard")
            url = f"{envoy.url}/v1/chat/completions"
            headers = {"x-tenant-id": "acme", "x-gateway-destination-endpoint": "10.9.9.9:80"}
            answers = []
            for body in (CHAT, big, {**CHAT, "model": "other"}):
                async with http.post(url, json=body, headers=headers) as answer:
                    answers.append((answer.status, await answer.read()))
            tokenize = await http.post(f"{envoy.url}/tokenize", json=CHAT, headers=headers)
            tokenized = (tokenize.status, await tokenize.read())

            async def released() -> bool:
                return await reserved(service) == 0

            await wait_until(released, "the leases to end")
    finally:
        await upstream.stop()
    (small_status, small_body), (big_status, big_body), (refused_status, refused_body) = answers
    assert (small_status, big_status) == (200, 200), (small_body, big_body)
    small, large, read_only = upstream.requests
    # kvguard's rewrite reached vLLM whole: the tier's default limit injected, the prompt intact.
    assert small.json() == {**CHAT, "max_tokens": 128}
    assert large.json()["messages"][0]["content"] == long_prompt
    assert len(large.body) > 62_000  # sent back in more than one chunk, arrived as one body
    for received in (small, large):
        assert received.headers["x-kvguard-lease"]
        assert "x-gateway-destination-endpoint" not in received.headers
    # The responses came back through kvguard's chunks as the upstream wrote them.
    assert json.loads(small_body)["choices"][0]["message"]["role"] == "assistant"
    assert json.loads(big_body)["object"] == "chat.completion"
    assert refused_status == 404
    assert json.loads(refused_body)["error"]["code"] == "model_not_found"
    # A read-only path's body goes on as sent, its response too.
    assert read_only.json() == CHAT and tokenized == (200, b"ok")
