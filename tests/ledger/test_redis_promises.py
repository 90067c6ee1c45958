"""Promises as only the Redis ledger keeps them, on a real redis-server and a real Redis Cluster:
keys in the pool's slot, one round trip per refusal, terms and expected ends the script checks,
tenants with ':', walks longer than one batch (a tenant's line of promises, the pool's and a
tenant's leases in order of their ends), more promises ending at once than one reclaim batch
moves, and two replicas sharing the ledger."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis.exceptions as rexc

from kvguard.ledger import MAX_PROMISE_BUDGET, PROMISE_BUDGET, Claim, Lease, Outcome, Terms
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.scripts import all_keys, load_script
from kvguard.testing.redis import RedisCluster
from tests.ledger.conftest import MARGIN_S, PATIENT_S, RedisClock, claim
from tests.ledger.promise_cases import TERMS, Y_ENDS_S, about, ending, fill, promised
from tests.ledger.redis_stats import commandstats, reset_stats


def test_promise_and_end_keys_follow_the_pool_keys_in_its_slot() -> None:
    keys = all_keys("qwen-7b")
    assert len(set(keys)) == 20  # and the pod keys after them
    lib = load_script("lib").source
    assert [f"KEYS[{i}]" in lib for i in range(1, 22)] == [True] * 20 + [False]
    assert all(key.split("{", 1)[1].split("}", 1)[0] == "qwen-7b" for key in keys)


def test_the_scripts_use_the_ledgers_promise_budgets() -> None:
    source = load_script("lib").source
    assert f"local PROMISE_BUDGET = {PROMISE_BUDGET}\n" in source
    assert f"local MAX_PROMISE_BUDGET = {MAX_PROMISE_BUDGET}\n" in source


async def test_a_promised_refusal_is_one_round_trip(redis_ledger: tuple[Any, RedisLedger]) -> None:
    redis, ledger = redis_ledger
    clock = RedisClock(ledger)
    t0 = await clock.now()
    await fill(ledger)
    reset_stats(redis)
    refused = await ledger.reserve(promised("1", 20, "k1"))
    await about(clock, t0, refused.retry_after_s, Y_ENDS_S + 0.5)
    stats = commandstats(redis)
    assert stats.get("evalsha") == 1, stats


@pytest.mark.parametrize(
    ("terms", "message"),
    [
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


async def test_expected_ends_are_sent_as_whole_ms_from_now(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    t0 = await clock.now()
    # Past ones end now; endless ones as late as the script's indexes keep.
    for lease_id, ends_s in (("past", -5.0), ("endless", float("inf"))):
        lease = ending(lease_id, 50, ends_s, tenant=lease_id, quota=100)
        assert (await ledger.reserve(lease)).outcome is Outcome.ADMITTED
    now = await ledger.reserve(promised("1", 50, "k1"))
    assert (now.wait_s, now.promised) == (0.0, True)
    never = await ledger.reserve(promised("2", 60, "k2", tenant="b", quota=100))
    await about(clock, t0, never.wait_s, 1e9)
    assert (never.retry_after_s, never.promised) == (None, False)


async def test_a_tenant_with_colons_keeps_and_takes_its_promise(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    fast = replace(TERMS, jitter_s=0.0, grace_s=10.0)
    await fill(ledger, y_ends_s=0.2)
    tenant = "org:team:1"
    first = await ledger.reserve(promised("1", 20, "k1", tenant=tenant, terms=fast))
    assert first.promised and first.retry_after_s is not None
    assert (await ledger.reserve(promised("2", 10, "k2", tenant=tenant, terms=fast))).promised
    t1 = await clock.now()
    await clock.reach(t1 + first.retry_after_s + 0.002)
    for key, blocks in (("k1", 20), ("k2", 10)):  # both back at their time: held for them
        back = await ledger.reserve(promised(f"{key}b", blocks, key, tenant=tenant, terms=fast))
        assert back.waiting_s > 0
    await ledger.release(ending("y", 50, None, tenant="y").lease())
    # Its second promise counts only the first (20) before it: 50 + 20 + 10 fit.
    second = await ledger.reserve(promised("2b", 10, "k2", tenant=tenant, terms=fast))
    assert (second.outcome, second.holding) == (Outcome.ADMITTED, 20)
    # A tenant whose name starts as this one's counts none of its held blocks.
    prefix = await ledger.reserve(ending("3", 40, 1.0, tenant="org:team"))
    assert (prefix.outcome, prefix.holding) == (Outcome.ADMITTED, 0)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promised, usage.promises, usage.holding) == (100, 20, 1, 20)
    assert usage.tenants == {"x": 50, tenant: 10, "org:team": 40}


async def test_a_tenant_with_colons_runs_out_of_promises_by_its_whole_name(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.2, max_wait_s=2.0)
    await fill(ledger, y_ends_s=0.2)
    tenant = "org:team:1"
    t0 = await clock.now()
    for i in range(PROMISE_BUDGET):  # all unclaimed: its budget falls to 0
        assert (
            await ledger.reserve(promised(str(i), 5, f"k{i}", tenant=tenant, terms=fast))
        ).promised
    await clock.reach(t0 + 0.2 + 0.2 + MARGIN_S)
    told = await ledger.reserve(promised("4", 5, "k4", tenant=tenant, terms=fast))
    prefix = await ledger.reserve(promised("5", 5, "k5", tenant="org:team", terms=fast))
    assert (told.promised, told.retry_after_s is not None, prefix.promised) == (False, True, True)


def one_each(i: int, limit: int, terms: Terms) -> Claim:
    """A 1-block claim of tenant t<i> (each within its promise budget) with retry key k<i>."""
    base = claim(str(i), 1, tenant=f"t{i}", limit=limit, quota=limit)
    return replace(base, retry_key=f"k{i}", terms=terms)


async def test_a_tenants_line_longer_than_one_walk_step_is_counted_whole(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    clock = RedisClock(ledger)
    n = 1005  # more promises than lib.lua's WALK_BATCH (1000), all of tenant a
    raw = connect(redis.url, cluster=isinstance(redis, RedisCluster), timeout_s=PATIENT_S)
    try:
        await raw.hset(all_keys("p")[14], "a", n + 1)  # its budget, as if its clients came back
    finally:
        await raw.aclose()
    fast = replace(TERMS, max_wait_s=60.0)
    t0 = await clock.now()
    # The pool full: 1 004 blocks expected free in 1 s, the other 996 in 20 s.
    early_ends, late_ends = Lease("x1", "p", "x", 1004), Lease("x2", "p", "x", 996)
    await ledger.reassert(
        [replace(early_ends, ends_in_s=1.0), replace(late_ends, ends_in_s=20.0)], 60.0
    )

    def one(lease_id: str, i: int) -> Claim:
        return replace(claim(lease_id, 1, limit=2000, quota=2000), retry_key=f"k{i}", terms=fast)

    for i in range(n):
        assert (await ledger.reserve(one(str(i), i))).promised
    # Back early, the last counts the n - 1 promises before it: the 1 005th block frees at 20 s.
    early = await ledger.reserve(one("again", n - 1))
    assert (early.promised, early.waiting_s) == (True, 0.0)
    await about(clock, t0, early.wait_s, 20.0)


async def test_the_walks_over_leases_go_past_one_batch(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    t0 = await clock.now()
    # 1 500 one-block leases of tenant a, and as many of b, ending in turn every 10 ms.
    leases = [
        replace(Lease(f"{tenant}{i}", "p", tenant, 1), ends_in_s=0.01 * (2 * i + j + 1))
        for i in range(1500)
        for j, tenant in enumerate("ab")
    ]
    await ledger.reassert(leases, 60.0)
    terms = replace(TERMS, max_wait_s=60.0)
    # The pool's limit: 1 200 over, the 1 200th lease to end; a's quota: 1 200 of a's own.
    by_pool = await ledger.reserve(
        replace(claim("1", 1200, tenant="c", limit=3000, quota=3000), terms=terms)
    )
    by_quota = await ledger.reserve(
        replace(claim("2", 1200, limit=1_000_000, quota=1500), terms=terms)
    )
    await about(clock, t0, by_pool.wait_s, 0.01 * 1200)
    await about(clock, t0, by_quota.wait_s, 0.01 * (2 * 1199 + 1))


async def test_promises_ending_beyond_one_reclaim_batch_end_over_calls(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    clock = RedisClock(ledger)
    n, limit = 1005, 2000  # more promises than lib.lua's RECLAIM_BATCH (1000)
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.5)
    await ledger.reassert([replace(Lease("x", "p", "x", limit), ends_in_s=0.5)], 30.0)
    for i in range(n):
        assert (await ledger.reserve(one_each(i, limit, fast))).promised
    last_at = await clock.now()
    assert (await ledger.usage("p")).promises == n
    await clock.reach(last_at + 1.0 + MARGIN_S)
    assert (await ledger.usage("p")).promises == n - 1000
    assert (await ledger.usage("p")).promises == 0


async def test_two_replicas_race_and_a_third_tenant_finds_the_idle_pool_open(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    """The Redis case of issue 31: two replicas share the ledger; tenants a and b race for a
    full pool through both and are refused and promised; their clients come back at their time
    and wait, holding their blocks; then every lease ends. Tenant c, through either replica,
    gets the whole pool: nothing held for a and b counts against it."""
    redis, first = redis_ledger
    clock = RedisClock(first)
    second = RedisLedger.from_url(
        redis.url, cluster=isinstance(redis, RedisCluster), timeout_s=PATIENT_S
    )
    fast = replace(TERMS, jitter_s=0.0, grace_s=30.0)
    try:
        await fill(first, x_ends_s=0.2, y_ends_s=0.2)
        answers = []
        for i, (replica, tenant) in enumerate([(first, "a"), (second, "b")] * 2):
            asked = promised(f"{tenant}{i}", 30, f"{tenant}{i}", tenant=tenant, terms=fast)
            answers.append(await replica.reserve(asked))
        assert all(a.outcome is Outcome.POOL_WATERMARK and a.promised for a in answers)
        t1 = await clock.now()
        await clock.reach(t1 + max(a.retry_after_s or 0.0 for a in answers) + 0.002)
        for i, (replica, tenant) in enumerate([(second, "a"), (first, "b")] * 2):
            retry = promised(f"{tenant}{i}b", 30, f"{tenant}{i}", tenant=tenant, terms=fast)
            assert (await replica.reserve(retry)).waiting_s > 0
        assert (await second.usage("p")).holding == 120
        for tenant in "xy":
            await first.release(ending(tenant, 50, None, tenant=tenant).lease())
        whole = await second.reserve(ending("c", 100, 1.0, tenant="c", quota=100))
        assert (whole.outcome, whole.holding) == (Outcome.ADMITTED, 0)
        await second.release(ending("c", 100, None, tenant="c").lease())
        again = await first.reserve(ending("c2", 100, 1.0, tenant="c", quota=100))
        assert again.outcome is Outcome.ADMITTED
        # a and b, each behind its own held retries: 60 held for a, so 41 more of a's do not fit.
        assert (await first.reserve(ending("a-fresh", 41, 1.0))).outcome is Outcome.TENANT_QUOTA
    finally:
        await second.close()
