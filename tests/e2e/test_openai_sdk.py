"""The openai SDK pointed at the real Envoy and kvguard: each refusal code raises the error class
the SDK raises for OpenAI's own answer of that status, with kvguard's `code` and OpenAI's
`type` on the exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from kvguard.testing.redis import RedisServer
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

MESSAGES = [{"role": "user", "content": "Say hello in French."}]


def chat(tenant: str | None = "acme", **fields: Any) -> Call:
    async def call(gw: Gateway) -> Any:
        async with client(gw, tenant) as sdk:
            return await sdk.chat.completions.create(
                **({"model": "qwen", "messages": MESSAGES} | fields)
            )

    return call


async def embed(gw: Gateway) -> Any:
    """An endpoint the gateway does not serve (nothing meters it)."""
    async with client(gw) as sdk:
        return await sdk.embeddings.create(model="qwen", input="hello")


# code -> (how to provoke it, the SDK's class, status, type)
CASES: dict[str, tuple[Call, type[openai.APIStatusError], int, str]] = {
    "model_not_found": (chat(model="gpt-9"), openai.NotFoundError, 404, "invalid_request_error"),
    "endpoint_not_served": (embed, openai.NotFoundError, 404, "invalid_request_error"),
    "invalid_request": (
        chat(extra_body={"max_tokens": "many"}),
        openai.BadRequestError,
        400,
        "invalid_request_error",
    ),
    "context_length_exceeded": (
        chat(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}]),
        openai.BadRequestError,
        400,
        "invalid_request_error",
    ),
    "request_exceeds_capacity": (
        chat(n=50, max_tokens=200),
        openai.BadRequestError,
        400,
        "invalid_request_error",
    ),
    "unknown_tenant": (chat(tenant=None), openai.AuthenticationError, 401, "invalid_request_error"),
    "request_too_large": (
        chat(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]),
        openai.APIStatusError,  # the SDK has no class of its own for 413
        413,
        "invalid_request_error",
    ),
    "capacity_unknown": (chat(model="ghost"), openai.InternalServerError, 503, "server_error"),
    # pro's quota is 400 blocks; the request needs ceil((9 + 200) / 16) = 14 of them.
    "tenant_block_quota_exceeded": (
        after(lambda gw: hold(gw, "acme", 390), chat(max_tokens=200)),
        openai.RateLimitError,
        429,
        "tokens",
    ),
    # The pool may hold 850 of its 1000 blocks; another tenant holds 840.
    "kv_cache_watermark_exceeded": (
        after(lambda gw: hold(gw, "globex", 840), chat(tenant="initech", max_tokens=200)),
        openai.RateLimitError,
        429,
        "tokens",
    ),
}


async def test_each_code_raises_the_sdks_error_class(tmp_path: Path) -> None:
    async with gateway(
        tmp_path,
        edit=with_a_pool_of_unknown_capacity,
        default_tier=None,
        tenants={"acme": "pro", "globex": "pro", "initech": "pro"},
        max_model_len=MAX_MODEL_LEN,
        max_body_bytes=MAX_BODY_BYTES,
    ) as gw:
        async with client(gw) as sdk:  # the control: admitted
            answer = await sdk.chat.completions.create(model="qwen", messages=MESSAGES)
            assert answer.choices[0].message.content
        raised = {}
        for code, (call, _, _, _) in CASES.items():
            with pytest.raises(openai.APIStatusError) as caught:
                await call(gw)
            raised[code] = caught.value
            for held in await gw.service.ledger.leases("qwen"):  # the next case starts clean
                await gw.service.ledger.release(held.lease)
    for code, (_, error_class, status, error_type) in CASES.items():
        error = raised[code]
        assert type(error) is error_class, code
        assert (error.status_code, error.code, error.type) == (status, code, error_type)
        assert error.response.headers["x-kvguard-reason"] == code
        if status == 429:  # a promised retry: when, in seconds and in ms (the SDK's first)
            headers = error.response.headers
            assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)
            assert headers["x-should-retry"] == "true"


@pytest.mark.redis
async def test_ledger_unavailable_is_an_internal_server_error(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:

        def on_redis(data: dict[str, Any]) -> None:
            data["ledger"]["url"] = redis.url

        async with gateway(tmp_path, edit=on_redis) as gw, client(gw) as sdk:
            redis.stop()
            with pytest.raises(openai.InternalServerError) as caught:
                await sdk.chat.completions.create(model="qwen", messages=MESSAGES)
    error = caught.value
    assert (error.status_code, error.code, error.type) == (
        503,
        "ledger_unavailable",
        "server_error",
    )
