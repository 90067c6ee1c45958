"""Refusals a client can act on, through the shipped envoy/envoy.yaml: the RateLimit headers on
admitted answers (from kvguard's dynamic metadata) and on 429s, Retry-After as a promise that
grows with the backlog and is kept when the client comes back, and the 503s' plain hint."""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvguard.admission.promises import DEFAULT_HOLD_S, JITTER_S, RETRY_TOKEN_HEADER
from kvguard.ledger import PROMISE_BUDGET, Claim, Lease
from kvguard.testing.wait import wait_until
from tests.e2e.test_openai_sdk import with_a_pool_of_unknown_capacity
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello in French."}]
CHAT = {"model": "qwen", "messages": MESSAGES}
PRO_BLOCKS = 400  # the pro tier's max_blocks in tests/conftest.py
# Blocks of the default test pool that may be reserved: 1000 less its 15 % watermark.
POOL_LIMIT = 850
# A pool whose blocks hold a whole context (4096 tokens): every request here needs one block.
ONE_BLOCK_EACH: dict[str, Any] = {"block_size": 4096, "watermark": 0.0}
RATE_RETRY = ("retry-after", "retry-after-ms", "x-should-retry", RETRY_TOKEN_HEADER)


async def hold(gw: Gateway, tenant: str, blocks: int) -> Lease:
    """Reserve `blocks` of pool qwen for `tenant` directly in the ledger, as a request in
    flight would: its lease, to release."""
    claim = Claim(uuid.uuid4().hex, "qwen", tenant, blocks, blocks, blocks, 60)
    lease = (await gw.service.ledger.reserve(claim)).lease
    assert lease is not None
    return lease


async def promises(gw: Gateway) -> tuple[int, int]:
    """Pool qwen's promised retries and the blocks held for them."""
    usage = await gw.service.ledger.usage("qwen")
    return usage.promises, usage.promised


def rate_limit_headers(enabled: bool) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["tenancy"]["rate_limit_headers"] = enabled

    return edit


@pytest.mark.parametrize("enabled", [True, False])
async def test_answers_say_where_the_tenant_stands(tmp_path: Path, enabled: bool) -> None:
    async with gateway(tmp_path, rate_limit_headers(enabled)) as gw:
        gw.service.admission.hold_s = lambda _pool: DEFAULT_HOLD_S
        admitted = await gw.post("/v1/chat/completions", CHAT)

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the admitted request's lease released")
        await hold(gw, "globex", POOL_LIMIT)
        refused = await gw.post("/v1/chat/completions", CHAT)
        _, promised = await promises(gw)
        async with gw.http.get(gw.url + "/v1/models", headers={"x-tenant-id": "acme"}) as r:
            unguarded = r.status, {k.lower(): v for k, v in r.headers.items()}
        stats = await gw.envoy.stats(r"ext_proc\.stream_msgs_sent")
    assert (admitted[0], refused[0], unguarded[0]) == (200, 429, 200)
    (upstream, _) = gw.upstream.requests
    blocks = int(upstream.headers["x-kvguard-blocks"])
    if enabled:
        assert admitted[1]["ratelimit-policy"] == f'"kv";q={PRO_BLOCKS}'
        assert admitted[1]["ratelimit"] == f'"kv";r={PRO_BLOCKS - blocks};t=0'
        # The pool is full: nothing left to reserve, its blocks expected free in at least a
        # second's fraction (t rounds up), and no later than its retry-after (jitter on top).
        assert refused[1]["ratelimit-policy"] == f'"kv";q={PRO_BLOCKS}'
        state = re.fullmatch(r'"kv";r=0;t=([0-9]+)', refused[1]["ratelimit"])
        assert state is not None, refused[1]["ratelimit"]
        assert 1 <= int(state[1]) <= math.ceil(int(refused[1]["retry-after-ms"]) / 1000)
    else:
        for headers in (admitted[1], refused[1]):
            assert "ratelimit" not in headers and "ratelimit-policy" not in headers
    assert "ratelimit" not in unguarded[1] and "ratelimit-policy" not in unguarded[1]
    assert not any(name in admitted[1] for name in RATE_RETRY)
    # The refusal says when to retry, with or without the RateLimit headers.
    # At the slowest, the blocks reserved drain at limit / hold_s a second, in releases the
    # size of this request (or of the one released before): a release or two.
    milliseconds = int(refused[1]["retry-after-ms"])
    slowest_s = DEFAULT_HOLD_S * (promised + blocks) / POOL_LIMIT
    assert 0 < milliseconds <= 1000 * (slowest_s + JITTER_S) + 1
    assert refused[1]["retry-after"] == str(math.ceil(milliseconds / 1000))
    assert refused[1]["x-should-retry"] == "true"
    assert len(refused[1][RETRY_TOKEN_HEADER]) == 32
    # Request headers and body for each guarded request, request headers for the unguarded
    # one: the RateLimit headers cost no response-headers round trip.
    assert stats == {"http.gateway.ext_proc.stream_msgs_sent": 5}


def distinct(k: int) -> dict[str, Any]:
    """A chat request of its own (its retry key differs), one block as all here."""
    return {**CHAT, "messages": [{"role": "user", "content": f"Question {k}: say hello."}]}


async def test_retry_after_grows_with_the_backlog(tmp_path: Path) -> None:
    """A full pool of 100 blocks whose blocks stay 100 s: it frees one block a second, so the
    k-th request refused in a row (one block each) is told the k-th second, plus jitter. The
    first PROMISE_BUDGET are promised; the tenant's clients have not yet come back, so the
    next is told its time with nothing held."""
    async with gateway(tmp_path, blocks=100, **ONE_BLOCK_EACH) as gw:
        gw.service.admission.hold_s = lambda _pool: 100.0
        await hold(gw, "globex", 100)
        answers = [await gw.post("/v1/chat/completions", distinct(k)) for k in range(1, 6)]
        held = await promises(gw)
    assert [status for status, _, _ in answers] == [429] * 5
    assert held == (PROMISE_BUDGET, PROMISE_BUDGET)
    milliseconds = [int(headers["retry-after-ms"]) for _, headers, _ in answers]
    for k, (ms, (_, headers, _)) in enumerate(zip(milliseconds, answers, strict=True), 1):
        assert 1000 * k <= ms <= 1000 * (k + JITTER_S), (k, ms)
        assert headers["ratelimit"] == f'"kv";r=0;t={k}'
        assert headers["x-should-retry"] == "true"
    assert milliseconds == sorted(set(milliseconds))  # strictly increasing
    assert milliseconds[4] - milliseconds[0] >= 1000 * (4 - JITTER_S)
    tokens = [headers.get(RETRY_TOKEN_HEADER) for _, headers, _ in answers]
    assert len(set(tokens[:PROMISE_BUDGET])) == PROMISE_BUDGET and tokens[4] is None
    assert gw.upstream.requests == []


def promises_within_a_second(data: dict[str, Any]) -> None:
    data["pools"][0]["retry_after_max_seconds"] = 1


async def test_no_retry_is_promised_past_the_pools_longest_wait(tmp_path: Path) -> None:
    async with gateway(tmp_path, promises_within_a_second, blocks=100, **ONE_BLOCK_EACH) as gw:
        await hold(gw, "globex", 100)
        gw.service.admission.hold_s = lambda _pool: 150.0  # one block frees in 1.5 s
        too_late = await gw.post("/v1/chat/completions", distinct(1))
        unpromised = await promises(gw)
        gw.service.admission.hold_s = lambda _pool: 50.0  # in 0.5 s
        in_time = await gw.post("/v1/chat/completions", distinct(2))
        promised = await promises(gw)
    assert (too_late[0], in_time[0]) == (429, 429)
    assert too_late[1]["x-should-retry"] == "false"
    assert "retry-after" not in too_late[1] and "retry-after-ms" not in too_late[1]
    assert RETRY_TOKEN_HEADER not in too_late[1]
    assert too_late[1]["ratelimit"] == '"kv";r=0;t=2'
    assert "do not retry soon" in too_late[2]["error"]["message"]
    assert unpromised == (0, 0)
    assert in_time[1]["x-should-retry"] == "true"
    assert 500 <= int(in_time[1]["retry-after-ms"]) <= 1000 * (0.5 + JITTER_S)
    assert promised == (1, 1)


# Seconds until the block of a one-block pool is expected free: the wait the SDK is promised.
PROMISED_WAIT_S = 2.0


async def test_the_sdks_retry_is_admitted_at_its_promised_time(tmp_path: Path) -> None:
    """The openai SDK, retrying once as it does by default on a 429, is refused while the
    pool's one block is held; the block freed, another tenant's fresh request is still refused
    (the block is held for the promised retry), and the SDK's retry at retry-after-ms is
    admitted."""
    tenants = {"acme": "pro", "globex": "pro", "initech": "pro"}
    async with gateway(tmp_path, blocks=1, tenants=tenants, **ONE_BLOCK_EACH) as gw:
        gw.service.admission.hold_s = lambda _pool: PROMISED_WAIT_S
        held = await hold(gw, "globex", 1)
        sdk = openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1",
            api_key="unused",
            max_retries=1,
            default_headers={"x-tenant-id": "acme"},
        )
        async with sdk:
            started = time.monotonic()
            call = asyncio.create_task(sdk.chat.completions.create(model="qwen", messages=MESSAGES))

            async def refused_and_promised() -> bool:
                return await promises(gw) == (1, 1)

            await wait_until(refused_and_promised, "acme's refusal promised a retry")
            await gw.service.ledger.release(held)
            fresh = await gw.post("/v1/chat/completions", distinct(1), "initech")
            between = await gw.service.ledger.usage("qwen")
            answer = await call
            elapsed = time.monotonic() - started
    assert fresh[0] == 429
    assert fresh[1]["x-kvguard-reason"] == "kv_cache_watermark_exceeded"
    # Answered before the SDK came back: acme's promise not yet taken, initech's behind it.
    assert (between.reserved, between.promises) == (0, 2)
    assert answer.choices[0].message.content
    assert elapsed >= PROMISED_WAIT_S
    (upstream,) = gw.upstream.requests
    assert upstream.headers["x-tenant-id"] == "acme"
    assert upstream.headers["x-stainless-retry-count"] == "1"  # the SDK's retry, not its first


async def test_unknown_capacity_asks_for_a_retry_in_a_second(tmp_path: Path) -> None:
    async with gateway(tmp_path, with_a_pool_of_unknown_capacity) as gw:
        status, headers, body = await gw.post("/v1/chat/completions", {**CHAT, "model": "ghost"})
    assert (status, body["error"]["code"]) == (503, "capacity_unknown")
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "1000")
    assert headers["x-should-retry"] == "true"
    assert RETRY_TOKEN_HEADER not in headers and "ratelimit" not in headers
    assert gw.upstream.requests == []
