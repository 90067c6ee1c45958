"""Refusals a client can act on, through the shipped envoy/envoy.yaml: the RateLimit headers on
admitted answers (from kvguard's dynamic metadata) and on 429s, Retry-After told from when the
leases are expected to end, growing with the tenant's backlog and kept when the client comes
back, another tenant never kept waiting for it, and the 503s' plain hint."""

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

from kvguard.admission.promises import JITTER_S, RETRY_TOKEN_HEADER
from kvguard.ledger import PROMISE_BUDGET, Claim, Lease
from kvguard.testing.wait import wait_until
from tests.e2e.sdk import with_a_pool_of_unknown_capacity
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
HELD_S = 10.0  # when the lease that fills the pool is expected to end


async def hold(gw: Gateway, tenant: str, blocks: int, ends_in_s: float = 10.0) -> Lease:
    """Reserve `blocks` of pool qwen for `tenant` directly in the ledger, as a request in
    flight would, expected to end `ends_in_s` from now: its lease, to release."""
    claim = Claim(uuid.uuid4().hex, "qwen", tenant, blocks, 10**6, 10**6, 60, ends_in_s=ends_in_s)
    lease = (await gw.service.ledger.reserve(claim)).lease
    assert lease is not None
    return lease


async def promises(gw: Gateway) -> tuple[int, int]:
    """Pool qwen's promised retries and the blocks promised to them."""
    usage = await gw.service.ledger.usage("qwen")
    return usage.promises, usage.promised


def rate_limit_headers(enabled: bool) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["tenancy"]["rate_limit_headers"] = enabled

    return edit


@pytest.mark.parametrize("enabled", [True, False])
async def test_answers_say_where_the_tenant_stands(tmp_path: Path, enabled: bool) -> None:
    async with gateway(tmp_path, rate_limit_headers(enabled)) as gw:
        admitted = await gw.post("/v1/chat/completions", CHAT)

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the admitted request's lease released")
        await hold(gw, "globex", POOL_LIMIT, ends_in_s=HELD_S)
        refused = await gw.post("/v1/chat/completions", CHAT)
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
    # The refusal says when to retry, with or without the RateLimit headers: when the lease
    # holding the pool is expected to end.
    milliseconds = int(refused[1]["retry-after-ms"])
    assert 1000 * (HELD_S - 5) < milliseconds <= 1000 * (HELD_S + JITTER_S) + 1
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
    """A full pool of 100 one-block leases expected to end one a second: the k-th request of a
    tenant refused in a row (one block each) is told the k-th second, plus jitter. The first
    PROMISE_BUDGET are promised; the tenant's clients have not yet come back, so the next is
    told its time with nothing promised."""
    async with gateway(tmp_path, blocks=100, **ONE_BLOCK_EACH) as gw:
        started = time.monotonic()
        for second in range(1, 101):
            await hold(gw, "globex", 1, ends_in_s=float(second))
        answers = [await gw.post("/v1/chat/completions", distinct(k)) for k in range(1, 6)]
        elapsed_ms = 1000 * (time.monotonic() - started)
        held = await promises(gw)
    assert [status for status, _, _ in answers] == [429] * 5
    assert held == (PROMISE_BUDGET, PROMISE_BUDGET)
    milliseconds = [int(headers["retry-after-ms"]) for _, headers, _ in answers]
    for k, (ms, (_, headers, _)) in enumerate(zip(milliseconds, answers, strict=True), 1):
        assert 1000 * k - elapsed_ms <= ms <= 1000 * (k + JITTER_S) + 1, (k, ms)
        assert headers["ratelimit"] in {f'"kv";r=0;t={k}', f'"kv";r=0;t={k - 1}'}
        assert headers["x-should-retry"] == "true"
    assert milliseconds == sorted(set(milliseconds))  # strictly increasing
    assert milliseconds[4] - milliseconds[0] >= 1000 * (4 - JITTER_S) - elapsed_ms
    tokens = [headers.get(RETRY_TOKEN_HEADER) for _, headers, _ in answers]
    assert len(set(tokens[:PROMISE_BUDGET])) == PROMISE_BUDGET and tokens[4] is None
    assert gw.upstream.requests == []


def promises_within_a_second(data: dict[str, Any]) -> None:
    data["pools"][0]["retry_after_max_seconds"] = 1


async def test_no_retry_is_promised_past_the_pools_longest_wait(tmp_path: Path) -> None:
    async with gateway(tmp_path, promises_within_a_second, blocks=1, **ONE_BLOCK_EACH) as gw:
        late = await hold(gw, "globex", 1, ends_in_s=1.9)
        too_late = await gw.post("/v1/chat/completions", distinct(1))
        unpromised = await promises(gw)
        await gw.service.ledger.release(late)
        await hold(gw, "globex", 1, ends_in_s=0.5)
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
    assert 0 < int(in_time[1]["retry-after-ms"]) <= 1000 * (0.5 + JITTER_S)
    assert promised == (1, 1)


# Seconds until the block of a one-block pool is expected free: the wait the SDK is promised.
PROMISED_WAIT_S = 2.0


async def test_the_sdks_retry_is_admitted_and_no_other_tenant_waits_for_it(
    tmp_path: Path,
) -> None:
    """The openai SDK, retrying once as it does by default on a 429, is refused while the
    pool's one block is held and told when that lease is expected to end. The block freed
    before then, another tenant's fresh request is admitted at once: nothing is held for a
    client that is not back. The SDK's retry at retry-after-ms is admitted once that request
    has ended (it waits on its stream for the block, within its grace, if it must)."""
    tenants = {"acme": "pro", "globex": "pro", "initech": "pro"}
    async with gateway(tmp_path, blocks=1, tenants=tenants, **ONE_BLOCK_EACH) as gw:
        held = await hold(gw, "globex", 1, ends_in_s=PROMISED_WAIT_S)
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
    assert fresh[0] == 200
    # Answered before the SDK came back: acme's promise not yet taken, and nothing held for it.
    assert (between.promises, between.holding) == (1, 0)
    assert answer.choices[0].message.content
    assert elapsed >= PROMISED_WAIT_S - 0.1
    assert [r.headers["x-tenant-id"] for r in gw.upstream.requests] == ["initech", "acme"]
    upstream = gw.upstream.requests[1]
    assert upstream.headers["x-stainless-retry-count"] == "1"  # the SDK's retry, not its first


async def test_unknown_capacity_asks_for_a_retry_in_a_second(tmp_path: Path) -> None:
    async with gateway(tmp_path, with_a_pool_of_unknown_capacity) as gw:
        status, headers, body = await gw.post("/v1/chat/completions", {**CHAT, "model": "ghost"})
    assert (status, body["error"]["code"]) == (503, "capacity_unknown")
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "1000")
    assert headers["x-should-retry"] == "true"
    assert RETRY_TOKEN_HEADER not in headers and "ratelimit" not in headers
    assert gw.upstream.requests == []
