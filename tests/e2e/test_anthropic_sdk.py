"""The SDKs of the other guarded APIs pointed at the real Envoy and kvguard: on /v1/messages each
refusal raises the class the `anthropic` SDK raises for Anthropic's own answer of that status,
with Anthropic's error type; on /v1/responses the `openai` SDK's, with kvguard's code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.sdk import (
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    Call,
    after,
    client,
    hold,
    with_a_pool_of_unknown_capacity,
)
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Say hello in French."}]


def messages(tenant: str | None = "acme", **fields: Any) -> Call:
    async def call(gw: Gateway) -> Any:
        headers = {"x-tenant-id": tenant} if tenant else {}
        async with anthropic.AsyncAnthropic(
            base_url=gw.url, api_key="unused", max_retries=0, default_headers=headers
        ) as sdk:
            return await sdk.messages.create(
                **({"model": "qwen", "max_tokens": 16, "messages": ASK} | fields)
            )

    return call


# code -> (how to provoke it, the SDK's class, status, Anthropic's type)
CASES: dict[str, tuple[Call, type[anthropic.APIStatusError], int, str]] = {
    "model_not_found": (
        messages(model="claude-9"),
        anthropic.NotFoundError,
        404,
        "not_found_error",
    ),
    "invalid_request": (
        messages(max_tokens=0),
        anthropic.BadRequestError,
        400,
        "invalid_request_error",
    ),
    "context_length_exceeded": (
        messages(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}]),
        anthropic.BadRequestError,
        400,
        "invalid_request_error",
    ),
    "unknown_tenant": (
        messages(tenant=None),
        anthropic.AuthenticationError,
        401,
        "authentication_error",
    ),
    "request_too_large": (
        messages(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]),
        anthropic.RequestTooLargeError,
        413,
        "request_too_large",
    ),
    "capacity_unknown": (
        messages(model="ghost"),
        anthropic.InternalServerError,
        503,
        "overloaded_error",
    ),
    # pro's quota is 400 blocks; the request needs ceil((9 + 200) / 16) = 14 of them.
    "tenant_block_quota_exceeded": (
        after(lambda gw: hold(gw, "acme", 390), messages(max_tokens=200)),
        anthropic.RateLimitError,
        429,
        "rate_limit_error",
    ),
    "kv_cache_watermark_exceeded": (
        after(lambda gw: hold(gw, "globex", 840), messages(tenant="initech", max_tokens=200)),
        anthropic.RateLimitError,
        429,
        "rate_limit_error",
    ),
}


async def _clean(gw: Gateway) -> None:
    for held in await gw.service.ledger.leases("qwen"):  # the next case starts clean
        await gw.service.ledger.release(held.lease)


async def test_each_refusal_raises_the_anthropic_sdks_class(tmp_path: Path) -> None:
    async with gateway(
        tmp_path,
        edit=with_a_pool_of_unknown_capacity,
        default_tier=None,
        tenants={"acme": "pro", "globex": "pro", "initech": "pro"},
        max_model_len=MAX_MODEL_LEN,
        max_body_bytes=MAX_BODY_BYTES,
    ) as gw:
        answer = await messages()(gw)  # the control: admitted, read by the SDK
        assert answer.usage.input_tokens > 0
        raised = {}
        for code, (call, _, _, _) in CASES.items():
            with pytest.raises(anthropic.APIStatusError) as caught:
                await call(gw)
            raised[code] = caught.value
            await _clean(gw)
    for code, (_, error_class, status, error_type) in CASES.items():
        error = raised[code]
        assert isinstance(error, error_class), (code, type(error))
        assert (error.status_code, error.type) == (status, error_type), code
        assert error.body == {
            "type": "error",
            "error": {"type": error_type, "message": error.api_message},
        }
        assert error.response.headers["x-kvguard-reason"] == code
        if status == 429:  # when to retry, in the headers Anthropic's SDK reads
            headers = error.response.headers
            assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)
            assert headers["x-should-retry"] == "true"


async def test_responses_refusals_raise_the_openai_sdks_class(tmp_path: Path) -> None:
    async with gateway(tmp_path, tenants={"acme": "pro"}) as gw, client(gw) as sdk:
        answer = await sdk.responses.create(model="qwen", input="Say hello.", max_output_tokens=9)
        assert answer.usage is not None and answer.usage.input_tokens > 0
        await hold(gw, "acme", 390)
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.responses.create(model="qwen", input="Say hello.", max_output_tokens=200)
        with pytest.raises(openai.BadRequestError) as stored:
            await sdk.responses.create(model="qwen", input="And?", previous_response_id="resp_1")
        await _clean(gw)
    assert (limited.value.code, limited.value.type) == ("tenant_block_quota_exceeded", "tokens")
    assert (stored.value.code, stored.value.param) == ("invalid_request", "previous_response_id")
