"""Promises as only the Redis ledger keeps them, on a real redis-server and a real Redis Cluster:
keys in the pool's slot, one round trip per refusal, terms the script checks, tenants with ':',
a line of promises longer than one walk step, more promises starting to hold at once than one
reclaim batch moves, the drain that releases and expiries feed."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import redis.exceptions as rexc

from kvguard.ledger import (
    DRAIN_WINDOW_S,
    MAX_PROMISE_BUDGET,
    PROMISE_BUDGET,
    Claim,
    Lease,
    Outcome,
    Terms,
)
from kvguard.ledger.redis_ledger import RedisLedger, all_keys, load_script
from tests.ledger.conftest import MARGIN_S, RedisClock, claim
from tests.ledger.test_promises import EXACT, TERMS, fill, fit, promised
from tests.ledger.test_redis import _commandstats, _reset_stats


def test_promise_and_drain_keys_follow_the_pool_keys_in_its_slot() -> None:
    keys = all_keys("qwen-7b")
    assert len(set(keys)) == 20
    assert all(key.split("{", 1)[1].split("}", 1)[0] == "qwen-7b" for key in keys)


def test_the_scripts_use_the_ledgers_drain_window_and_promise_budgets() -> None:
    source = load_script("lib").source
    assert f"local DRAIN_WINDOW_MS = {round(DRAIN_WINDOW_S * 1000)}\n" in source
    assert f"local PROMISE_BUDGET = {PROMISE_BUDGET}\n" in source
    assert f"local MAX_PROMISE_BUDGET = {MAX_PROMISE_BUDGET}\n" in source


async def test_a_promised_refusal_is_one_round_trip(redis_ledger: tuple[Any, RedisLedger]) -> None:
    redis, ledger = redis_ledger
    await fill(ledger)
    _reset_stats(redis)
    refused = await ledger.reserve(promised("1", 20, "k1"))
    assert refused.retry_after_s == pytest.approx(fit(20, 10, 20) + 0.5, abs=EXACT)
    stats = _commandstats(redis)
    assert stats.get("evalsha") == 1, stats


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        (replace(TERMS, hold_s=math.nan), "hold time \\(s\\) must be a non-negative number"),
        (replace(TERMS, hold_s=-1.0), "hold time \\(s\\) must be a non-negative number"),
        (replace(TERMS, max_wait_s=-1.0), "max wait \\(ms\\) must be a non-negative integer"),
        (replace(TERMS, jitter_s=-0.5), "jitter \\(ms\\) must be a non-negative integer"),
        (replace(TERMS, grace_s=-2.0), "grace \\(ms\\) must be a non-negative integer"),
    ],
)
async def test_the_script_refuses_bad_terms(
    redis_ledger: tuple[Any, RedisLedger], terms: Terms, message: str
) -> None:
    _, ledger = redis_ledger
    with pytest.raises(rexc.ResponseError, match=message):
        await ledger.reserve(promised("1", 20, "k1", terms=terms))
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promises) == (0, 0)


async def test_released_and_expired_leases_feed_the_drain(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    t0 = await clock.now()
    leases = []
    for i in range(10):  # the pool full: 10 leases of 10 blocks, 2 of them expiring soon
        lease_s = 0.2 if i < 2 else 30.0
        full = await ledger.reserve(claim(f"x{i}", 10, tenant="x", quota=100, lease_s=lease_s))
        assert full.outcome is Outcome.ADMITTED
        leases.append(full.lease)
    for lease in leases[2:5]:
        assert lease is not None
        await ledger.release(lease)
    await clock.reach(t0 + 0.2 + MARGIN_S)
    # 50 blocks reserved: a 60-block claim needs 10 more freed. Held 1000 s a block, 50 blocks
    # free 0.05 a second; the 5 releases of 10 blocks measured free them much faster.
    slow = replace(TERMS, hold_s=1000.0)
    refused = await ledger.reserve(promised("a", 60, "k", terms=slow, quota=100))
    elapsed = await clock.now() - t0
    assert refused.outcome is Outcome.POOL_WATERMARK

    def weight(span_s: float) -> float:  # kvguard.ledger.memory: the window's decayed weight
        return DRAIN_WINDOW_S * -math.expm1(-max(span_s, DRAIN_WINDOW_S / 10) / DRAIN_WINDOW_S)

    decay = math.exp(-elapsed / DRAIN_WINDOW_S)  # the 3 releases are older than the expiries
    fastest = fit(10, 50 / weight(0), 10)
    slowest = fit(10, (20 + 30 * decay) / weight(elapsed), 10)
    assert fastest - EXACT <= refused.wait_s <= slowest + EXACT


async def test_a_tenant_with_colons_keeps_and_takes_its_promise(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    await fill(ledger)
    tenant = "org:team:1"
    assert (await ledger.reserve(promised("1", 20, "k1", tenant=tenant))).promised
    assert (await ledger.reserve(promised("2", 10, "k2", tenant=tenant))).promised
    await ledger.release(claim("y", 50, tenant="y").lease())
    # Its second promise counts only the first (20) before it: 50 + 20 + 10 fit.
    assert (await ledger.reserve(promised("2b", 10, "k2", tenant=tenant))).outcome is (
        Outcome.ADMITTED
    )
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promised, usage.promises) == (60, 20, 1)
    assert usage.tenants == {"x": 50, tenant: 10}


async def test_a_tenant_with_colons_runs_out_of_promises_by_its_whole_name(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    await fill(ledger)
    tenant = "org:team:1"
    fast = replace(TERMS, hold_s=0.5, jitter_s=0.0, grace_s=0.2, max_wait_s=2.0)
    t0 = await clock.now()
    for i in range(PROMISE_BUDGET):  # all unclaimed: its budget falls to 0
        assert (
            await ledger.reserve(promised(str(i), 20, f"k{i}", tenant=tenant, terms=fast))
        ).promised
    await clock.reach(t0 + fit(80, 200, 20) + 0.2 + MARGIN_S)
    told = await ledger.reserve(promised("4", 20, "k4", tenant=tenant, terms=fast))
    prefix = await ledger.reserve(promised("5", 20, "k5", tenant="org:team", terms=fast))
    assert (told.promised, told.retry_after_s is not None, prefix.promised) == (False, True, True)


def one_each(i: int, limit: int, terms: Terms) -> Claim:
    """A 1-block claim of tenant t<i> (each within its promise budget) with retry key k<i>."""
    base = claim(str(i), 1, tenant=f"t{i}", limit=limit, quota=limit)
    return replace(base, retry_key=f"k{i}", terms=terms)


async def test_a_line_longer_than_one_walk_step_is_counted_whole(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    n, limit = 1005, 2000  # more promises than lib.lua's WALK_BATCH (1000)
    terms = replace(TERMS, hold_s=2.0)
    full = await ledger.reserve(claim("x", limit, tenant="x", limit=limit, quota=limit))
    assert full.outcome is Outcome.ADMITTED
    for i in range(n):
        assert (await ledger.reserve(one_each(i, limit, terms))).promised
    refused = await ledger.reserve(replace(one_each(n - 1, limit, terms), lease_id="last"))
    # The promises before it (n - 1 blocks) and its own block, past a full pool that frees
    # 1000 blocks a second.
    assert refused.wait_s == pytest.approx(fit(n, limit / 2.0, 1), abs=EXACT)
    assert (await ledger.usage("p")).promised == n


async def test_promises_due_beyond_one_reclaim_batch_start_holding_over_calls(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    n, limit = 1005, 100_000  # more promises than lib.lua's RECLAIM_BATCH (1000)
    terms = replace(TERMS, hold_s=2.0, grace_s=30.0)
    # A pool a full limit over (as a re-assert may leave it), freeing 100 000 blocks a second:
    # each 1-block promise holds about 1 s from now, once that limit and the promises before it
    # are expected free.
    await ledger.reassert([Lease("x", "p", "x", 2 * limit)], 30.0)
    for i in range(n):
        assert (await ledger.reserve(one_each(i, limit, terms))).promised
    last_at = await clock.now()
    assert (await ledger.usage("p")).holding == 0
    await clock.reach(last_at + fit(limit + n, limit, 1) + EXACT)
    assert (await ledger.usage("p")).holding == 1000
    usage = await ledger.usage("p")
    assert (usage.holding, usage.promised, usage.promises) == (n, n, n)
