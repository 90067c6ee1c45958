"""OpenAI's Responses API and Anthropic's Messages API through the real Envoy, guarded as chat is:
the limit clamped or injected in the body the upstream sees, the prompt counted, the lease held
while the answer streams and released after it, what the answer produced learnt from its usage,
and refusals in each API's own error schema (Anthropic's on /v1/messages), never reaching the
upstream."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvguard.testing.wait import wait_until
from kvguard.tokens.counting import count_prompts
from kvguard.tokens.request import Kind, parse
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

ASK = "Say hello in French."
RESPONSES = {"model": "qwen", "instructions": "Be brief.", "input": ASK}
MESSAGES = {"model": "qwen", "max_tokens": 100_000, "messages": [{"role": "user", "content": ASK}]}


async def _zero(gw: Gateway) -> bool:
    return await gw.reserved() == 0


def _counted(qwen: PoolTokenizer, kind: Kind, body: dict[str, Any]) -> int:
    (tokens,) = count_prompts(qwen, parse(kind, json.dumps(body).encode()))
    return tokens


async def test_responses_limits_are_clamped_or_injected_and_leases_released(
    tmp_path: Path, qwen: PoolTokenizer
) -> None:
    async with gateway(tmp_path) as gw:
        status, headers, answer = await gw.post(
            "/v1/responses", {**RESPONSES, "max_output_tokens": 100_000}
        )
        assert status == 200, answer
        status, _, _ = await gw.post("/v1/responses?api-version=1", RESPONSES, tenant="someone")
        assert status == 200
        clamped, injected = gw.upstream.requests
        assert clamped.json()["max_output_tokens"] == 512  # the pro tier's cap
        assert injected.json()["max_output_tokens"] == 32  # the free tier's default
        assert "max_tokens" not in clamped.json() and "max_tokens" not in injected.json()
        for seen in (clamped, injected):
            assert int(seen.headers["content-length"]) == len(seen.body)
            assert int(seen.headers["x-kvguard-blocks"]) > 0
        prompt = _counted(qwen, "responses", RESPONSES)
        assert int(clamped.headers["x-kvguard-prompt-tokens"]) == prompt
        assert answer["usage"]["input_tokens"] == prompt
        assert headers["x-kvguard-max-tokens"] == "512"
        await wait_until(lambda: _zero(gw), "every lease to be released")


async def test_messages_limit_is_clamped_and_a_missing_one_refused(
    tmp_path: Path, qwen: PoolTokenizer
) -> None:
    async with gateway(tmp_path) as gw:
        status, headers, answer = await gw.post("/v1/messages", MESSAGES)
        assert status == 200, answer
        (seen,) = gw.upstream.requests
        assert seen.json()["max_tokens"] == 512
        assert int(seen.headers["content-length"]) == len(seen.body)
        prompt = _counted(qwen, "messages", MESSAGES)
        assert int(seen.headers["x-kvguard-prompt-tokens"]) == answer["usage"]["input_tokens"]
        assert answer["usage"]["input_tokens"] == prompt
        assert headers["x-kvguard-max-tokens"] == "512"
        # Messages requires max_tokens (vLLM answers 400 without it): nothing is injected.
        body = {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
        status, headers, answer = await gw.post("/v1/messages", body)
        assert status == 400
        assert answer == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "'max_tokens' is required"},
        }
        assert headers["x-kvguard-reason"] == "invalid_request"
        assert len(gw.upstream.requests) == 1
        await wait_until(lambda: _zero(gw), "every lease to be released")


@pytest.mark.parametrize(
    ("path", "body", "delta"),
    [
        (
            "/v1/responses",
            {**RESPONSES, "max_output_tokens": 12},
            b"event: response.output_text.delta",
        ),
        ("/v1/messages", {**MESSAGES, "max_tokens": 12}, b"event: content_block_delta"),
    ],
)
async def test_a_stream_holds_its_lease_until_it_ends(
    tmp_path: Path, path: str, body: dict[str, Any], delta: bytes
) -> None:
    async with gateway(tmp_path) as gw:
        url = gw.url + path
        headers = {"x-tenant-id": "acme", "x-test-token-delay": "0.1"}
        async with gw.http.post(url, json={**body, "stream": True}, headers=headers) as response:
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            assert await gw.reserved() > 0  # while the answer streams
            raw = first + await response.read()
        assert raw.count(delta) == 12
        await wait_until(lambda: _zero(gw), "the lease released once the stream ended")


async def test_refusals_speak_each_apis_error_schema(tmp_path: Path) -> None:
    tiers = {"free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 6}}
    async with gateway(tmp_path, tiers=tiers, tenants={}) as gw:
        # 5 blocks of 16 held while the upstream delays its answer: 5 more pass the quota of 6.
        holding = asyncio.create_task(
            gw.post("/v1/messages", {**MESSAGES, "max_tokens": 64}, tenant="t", x_test_delay="30")
        )
        await wait_until(lambda: _positive(gw), "the first request's lease held")
        status, headers, answer = await gw.post("/v1/messages", MESSAGES, tenant="t")
        assert status == 429
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "rate_limit_error"
        assert "quota" in answer["error"]["message"]
        assert set(answer) == {"type", "error"} and set(answer["error"]) == {"type", "message"}
        assert headers["x-kvguard-reason"] == "tenant_block_quota_exceeded"
        assert int(headers["retry-after"]) >= 1 and "retry-after-ms" in headers
        # The same refusal on /v1/responses keeps OpenAI's schema.
        status, headers, answer = await gw.post(
            "/v1/responses", {**RESPONSES, "max_output_tokens": 64}, tenant="t"
        )
        assert status == 429
        assert answer["error"]["code"] == "tenant_block_quota_exceeded"
        assert answer["error"]["type"] == "tokens"
        # Other statuses map to Anthropic's types too.
        status, _, answer = await gw.post("/v1/messages", {**MESSAGES, "model": "nope"}, tenant="t")
        assert (status, answer["error"]["type"]) == (404, "not_found_error")
        status, _, answer = await gw.post("/v1/messages", {**MESSAGES, "messages": 3}, tenant="t")
        assert (status, answer["error"]["type"]) == (400, "invalid_request_error")
        assert len(gw.upstream.requests) == 1  # only the first reached the upstream
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        await wait_until(lambda: _zero(gw), "the abandoned request's lease released")


async def test_unknown_tenants_get_anthropics_authentication_error(tmp_path: Path) -> None:
    async with gateway(tmp_path, default_tier=None) as gw:
        status, headers, answer = await gw.post("/v1/messages", MESSAGES, tenant="stranger")
        assert (status, answer["error"]["type"]) == (401, "authentication_error")
        assert headers["x-kvguard-reason"] == "unknown_tenant"
        assert gw.upstream.requests == []


async def _positive(gw: Gateway) -> bool:
    return await gw.reserved() > 0


def _released(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.__dict__
        for r in caplog.records
        if r.name == "kvguard.release" and r.getMessage() == "released"
    ]


async def test_what_each_answer_produced_is_learnt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every response is read (response_sample 1): non-streamed usage, and the streams' final
    events, on both APIs; a model that stops early says so."""
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with gateway(tmp_path, response_sample=1.0) as gw:
        for stream in (False, True):
            status, _, _ = await gw.post(
                "/v1/responses", {**RESPONSES, "max_output_tokens": 9, "stream": stream}
            )
            assert status == 200
            status, _, _ = await gw.post(
                "/v1/messages", {**MESSAGES, "max_tokens": 9, "stream": stream}, x_test_tokens="4"
            )
            assert status == 200
        await wait_until(lambda: len(_released(caplog)) == 4, "four releases recorded")
    got = sorted(
        (r["completion_tokens"], r["completion_source"], r["finish_reason"])
        for r in _released(caplog)
    )
    assert got == [
        (4, "usage", "end_turn"),
        (4, "usage", "end_turn"),
        (9, "usage", "max_output_tokens"),
        (9, "usage", "max_output_tokens"),
    ]
