"""The ledger's promises (kvguard.ledger, "Terms"), on every backend: a refused claim with terms
and a retry key is promised the time its blocks are expected free, counting the promises before
it; its blocks are held from when the drain has freed what is ahead of it until the grace ends,
against every other claim, and its retry takes them. A tenant whose client never came back is
told the time, with nothing held.

Pool p: limit 100 blocks, tenant quota 60. Before any release is measured, a full pool with
hold_s 10 frees 10 blocks a second, in releases the size of the claim; `fit` is the contract's
time by which that frees a claim's blocks, on average."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvguard.ledger import PROMISE_BUDGET, Claim, Ledger, Outcome, Terms
from tests.ledger.conftest import MARGIN_S, LedgerClock, claim

TERMS = Terms(hold_s=10.0, max_wait_s=30.0, jitter_s=0.5, grace_s=2.0)
EXACT = 0.002  # Redis keeps times in ms


def fit(over: int, rate: float, size: float) -> float:
    """kvguard.ledger.Terms: when releases of `size` blocks at `rate` a second have freed
    `over` blocks, on average."""
    return math.ceil(over / size) * size / rate


def promised(
    lease_id: str,
    blocks: int,
    key: str,
    *,
    tenant: str = "a",
    terms: Terms = TERMS,
    quota: int = 60,
) -> Claim:
    base = claim(lease_id, blocks, tenant=tenant, quota=quota)
    return replace(base, retry_key=key, terms=terms)


async def fill(ledger: Ledger) -> None:
    """Pool p full: tenants x and y hold 50 blocks each."""
    for tenant in "xy":
        reserved = await ledger.reserve(claim(tenant, 50, tenant=tenant))
        assert reserved.outcome is Outcome.ADMITTED


async def test_refusals_are_promised_distinct_slots_in_order(ledger: Ledger) -> None:
    await fill(ledger)
    first = await ledger.reserve(promised("1", 20, "k1"))
    second = await ledger.reserve(promised("2", 10, "k2", tenant="b"))
    assert (first.outcome, second.outcome) == (Outcome.POOL_WATERMARK, Outcome.POOL_WATERMARK)
    # 20 blocks over the limit; then 30, counting the first promise.
    assert first.wait_s == pytest.approx(fit(20, 10, 20), abs=EXACT)
    assert first.retry_after_s == pytest.approx(fit(20, 10, 20) + 0.5, abs=EXACT)
    assert second.wait_s == pytest.approx(fit(30, 10, 10), abs=EXACT)
    assert second.retry_after_s == pytest.approx(fit(30, 10, 10) + 0.5, abs=EXACT)
    assert (first.promised, second.promised) == (True, True)
    usage = await ledger.usage("p")
    # The first holds its blocks at once; the second from as long before its time as its own
    # 10 blocks take to free.
    assert (usage.reserved, usage.promised, usage.promises, usage.holding) == (100, 30, 2, 20)


async def test_promised_blocks_are_held_against_fresh_claims(ledger: Ledger) -> None:
    await fill(ledger)
    await ledger.reserve(promised("1", 20, "k1"))
    await ledger.release(claim("y", 50, tenant="y").lease())
    # 50 reserved + 20 held: 30 left for anyone else; each answer says what it counted held.
    refused = await ledger.reserve(claim("2", 31, tenant="b"))
    admitted = await ledger.reserve(claim("3", 30, tenant="b"))
    assert (refused.outcome, refused.pool_holding, refused.tenant_holding) == (
        Outcome.POOL_WATERMARK,
        20,
        0,
    )
    assert (admitted.outcome, admitted.pool_holding) == (Outcome.ADMITTED, 20)


async def test_the_retry_takes_its_promised_blocks(ledger: Ledger) -> None:
    await fill(ledger)
    await ledger.reserve(promised("1", 20, "k1"))
    await ledger.release(claim("y", 50, tenant="y").lease())
    await ledger.reserve(claim("2", 30, tenant="b"))  # all that is not held
    retry = await ledger.reserve(promised("1-again", 20, "k1"))
    assert retry.outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promised, usage.promises) == (100, 0, 0)


async def test_a_retry_counts_only_the_promises_made_before_it(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    fast = replace(TERMS, hold_s=0.5)  # 200 blocks a second
    t0 = await clock.now()
    await ledger.reserve(promised("1", 20, "k1", terms=fast))  # held at once
    await ledger.reserve(promised("2", 20, "k2", tenant="b", terms=fast))
    held_from = fit(40, 200, 20) - fit(20, 200, 20)
    await ledger.release(claim("y", 50, tenant="y").lease())  # 50 reserved, 40 promised
    assert (await ledger.usage("p")).holding == 20
    await clock.reach(t0 + held_from + MARGIN_S)
    assert (await ledger.usage("p")).holding == 40
    # The second promise fits beside the first; a fresh claim of the same size does not.
    assert (await ledger.reserve(claim("3", 20, tenant="c"))).outcome is Outcome.POOL_WATERMARK
    retry = await ledger.reserve(promised("2b", 20, "k2", tenant="b", terms=fast))
    assert retry.outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promised) == (70, 20)


async def test_blocks_not_yet_held_serve_fresh_claims(ledger: Ledger) -> None:
    await fill(ledger)
    await ledger.reserve(promised("1", 20, "k1"))  # held at once
    later = await ledger.reserve(promised("2", 30, "k2", tenant="b"))  # held seconds later
    assert later.promised
    await ledger.release(claim("y", 50, tenant="y").lease())
    # 50 reserved, 20 held: the 30 blocks promised for later serve a fresh claim now.
    assert (await ledger.reserve(claim("3", 30, tenant="c"))).outcome is Outcome.ADMITTED


async def test_a_key_holds_its_promise_only_for_its_tenant(ledger: Ledger) -> None:
    await fill(ledger)
    await ledger.reserve(promised("1", 20, "k1"))
    await ledger.release(claim("y", 50, tenant="y").lease())
    await ledger.reserve(claim("2", 30, tenant="b"))
    other = await ledger.reserve(promised("3", 20, "k1", tenant="intruder"))
    assert (other.outcome, other.promised) == (Outcome.POOL_WATERMARK, False)
    assert (await ledger.usage("p")).promised == 20


async def test_no_promise_past_max_wait(ledger: Ledger) -> None:
    await fill(ledger)
    short = replace(TERMS, max_wait_s=1.5)
    refused = await ledger.reserve(promised("1", 20, "k1", terms=short))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (refused.retry_after_s, refused.promised) == (None, False)
    assert refused.wait_s == pytest.approx(fit(20, 10, 20), abs=EXACT)
    assert (await ledger.usage("p")).promises == 0


async def test_without_terms_or_key_nothing_is_promised(ledger: Ledger) -> None:
    await fill(ledger)
    bare = await ledger.reserve(claim("1", 20))
    keyless = await ledger.reserve(promised("2", 20, ""))
    assert (bare.wait_s, bare.retry_after_s, bare.promised) == (0.0, None, False)
    # Without a key the time is told, and nothing held for a retry that cannot be known.
    assert keyless.wait_s == pytest.approx(fit(20, 10, 20), abs=EXACT)
    assert keyless.retry_after_s == pytest.approx(keyless.wait_s + 0.5, abs=EXACT)
    assert not keyless.promised
    assert (await ledger.usage("p")).promises == 0


async def test_the_quota_drains_at_the_tenants_rate(ledger: Ledger) -> None:
    assert (await ledger.reserve(claim("1", 60))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(promised("2", 30, "k2"))
    assert refused.outcome is Outcome.TENANT_QUOTA
    # The tenant's 60 blocks free 6 a second (held 10 s each), not the pool's.
    assert refused.wait_s == pytest.approx(fit(30, 6, 30), abs=EXACT)
    # Its promise holds its tenant's quota, and none of the pool: other tenants may fill it.
    await ledger.release(claim("1", 60).lease())
    assert (await ledger.reserve(claim("3", 31))).outcome is Outcome.TENANT_QUOTA
    assert (await ledger.reserve(claim("4", 100, tenant="b", quota=100))).outcome is (
        Outcome.ADMITTED
    )


async def test_a_retry_back_early_keeps_its_time(ledger: Ledger, clock: LedgerClock) -> None:
    await fill(ledger)
    t0 = await clock.now()
    slow = replace(TERMS, hold_s=20.0)
    first = await ledger.reserve(promised("1", 20, "k1", terms=slow))
    told = fit(20, 5, 20) + 0.5
    assert first.retry_after_s == pytest.approx(told, abs=EXACT)
    await clock.reach(t0 + 1)
    early = await ledger.reserve(promised("1b", 20, "k1", terms=slow))
    assert (early.outcome, early.promised) == (Outcome.POOL_WATERMARK, True)
    assert early.retry_after_s is not None
    assert told - 1 - MARGIN_S <= early.retry_after_s <= told - 1 + EXACT


async def test_a_retry_back_at_its_time_without_room_is_told_how_long_it_is_held(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    fast = replace(TERMS, hold_s=1.0, jitter_s=0.0, grace_s=5.0)  # 100 blocks a second
    t0 = await clock.now()
    await ledger.reserve(promised("1", 20, "k1", terms=fast))
    await ledger.reserve(promised("2", 20, "k2", tenant="b", terms=fast))
    due = fit(20, 100, 20)
    await clock.reach(t0 + due + EXACT)
    back = await ledger.reserve(promised("1b", 20, "k1", terms=fast))
    assert (back.outcome, back.promised) == (Outcome.POOL_WATERMARK, True)
    # Its blocks stay held for it until its grace ends: the caller may wait that long.
    elapsed = await clock.now() - t0
    assert due + 5.0 - elapsed - MARGIN_S <= back.waiting_s <= due + 5.0 - elapsed + EXACT
    usage = await ledger.usage("p")
    assert (usage.promised, usage.promises) == (40, 2)
    await ledger.release(claim("y", 50, tenant="y").lease())
    assert (await ledger.reserve(promised("1c", 20, "k1", terms=fast))).outcome is (
        Outcome.ADMITTED
    )


async def test_an_unclaimed_promise_ends_with_its_grace(ledger: Ledger, clock: LedgerClock) -> None:
    await fill(ledger)
    fast = replace(TERMS, hold_s=1.0, jitter_s=0.1, grace_s=0.3)
    t0 = await clock.now()
    await ledger.reserve(promised("1", 20, "k1", terms=fast))
    ends = fit(20, 100, 20) + 0.1 + 0.3
    await ledger.release(claim("y", 50, tenant="y").lease())
    assert (await ledger.reserve(claim("2", 40, tenant="b"))).outcome is Outcome.POOL_WATERMARK
    await clock.reach(t0 + ends + MARGIN_S)
    assert (await ledger.usage("p")).promises == 0
    assert (await ledger.reserve(claim("2", 40, tenant="b"))).outcome is Outcome.ADMITTED


async def test_an_impossible_claim_is_never_promised(ledger: Ledger) -> None:
    over_quota = await ledger.reserve(promised("1", 61, "k1"))
    over_limit = await ledger.reserve(promised("2", 101, "k2", quota=200))
    bare = await ledger.reserve(claim("3", 61))
    assert (over_quota.outcome, over_limit.outcome) == (
        Outcome.TENANT_QUOTA,
        Outcome.POOL_WATERMARK,
    )
    assert (over_quota.wait_s, over_quota.retry_after_s) == (math.inf, None)
    assert (over_limit.wait_s, over_limit.retry_after_s) == (math.inf, None)
    assert (bare.wait_s, bare.retry_after_s) == (0.0, None)
    assert (await ledger.usage("p")).promises == 0


async def test_another_tenants_claim_leaves_a_promise_as_it_was(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    t0 = await clock.now()
    slow = replace(TERMS, hold_s=20.0)
    first = await ledger.reserve(promised("1", 20, "k1", terms=slow))
    told = fit(20, 5, 20) + 0.5
    assert first.retry_after_s == pytest.approx(told, abs=EXACT)
    intruder = await ledger.reserve(promised("2", 10, "k1", tenant="b"))
    assert (intruder.outcome, intruder.promised) == (Outcome.POOL_WATERMARK, False)
    usage = await ledger.usage("p")
    assert (usage.promised, usage.promises) == (20, 1)
    again = await ledger.reserve(promised("1b", 20, "k1", terms=slow))
    assert again.retry_after_s is not None  # its own time, not the intruder's
    elapsed = await clock.now() - t0
    assert told - elapsed - MARGIN_S <= again.retry_after_s <= told - elapsed + EXACT
    # The owner's quota still counts its 20 promised blocks, and no more.
    await ledger.release(claim("x", 50, tenant="x").lease())
    await ledger.release(claim("y", 50, tenant="y").lease())
    assert (await ledger.reserve(claim("3", 41))).outcome is Outcome.TENANT_QUOTA
    assert (await ledger.reserve(claim("4", 40))).outcome is Outcome.ADMITTED


async def test_a_tenant_has_at_most_its_budget_of_promises_open(ledger: Ledger) -> None:
    await fill(ledger)
    slow = replace(TERMS, hold_s=1.0, max_wait_s=300.0)  # room for many slots
    first = [await ledger.reserve(promised(str(i), 5, f"k{i}", terms=slow)) for i in range(4)]
    fifth = await ledger.reserve(promised("4", 5, "k4", terms=slow))
    other = await ledger.reserve(promised("5", 5, "k5", tenant="b", terms=slow))
    assert [r.promised for r in first] == [True] * PROMISE_BUDGET
    # Told when, with nothing held: the tenant's clients have not shown they come back.
    assert (fifth.promised, fifth.retry_after_s is not None, other.promised) == (False, True, True)


async def test_a_client_that_comes_back_doubles_its_tenants_budget(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    slow = replace(TERMS, hold_s=1.0, jitter_s=0.0, max_wait_s=300.0)
    t0 = await clock.now()
    for i in range(4):
        await ledger.reserve(promised(str(i), 5, f"k{i}", terms=slow))
    # Before its time the same body may be another client's: it does not count.
    early = await ledger.reserve(promised("0a", 5, "k0", terms=slow))
    assert early.promised
    assert not (await ledger.reserve(promised("x", 5, "kx", terms=slow))).promised
    await clock.reach(t0 + fit(5, 100, 5) + EXACT)
    back = await ledger.reserve(promised("0b", 5, "k0", terms=slow))  # at its time
    assert back.waiting_s > 0
    more = [await ledger.reserve(promised(str(i), 5, f"k{i}", terms=slow)) for i in range(4, 9)]
    assert [r.promised for r in more] == [True] * 4 + [False]  # 8 open at most now


async def test_promises_never_claimed_halve_the_budget_down_to_one_try_later(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    fast = replace(TERMS, hold_s=0.5, jitter_s=0.0, grace_s=0.2, max_wait_s=2.0)
    t0 = await clock.now()
    for i in range(4):
        assert (await ledger.reserve(promised(str(i), 20, f"k{i}", terms=fast))).promised
    ended = fit(80, 200, 20) + 0.2  # the last of the four, unclaimed: 4 -> 2 -> 1 -> 0 -> 0
    await clock.reach(t0 + ended + MARGIN_S)
    told = await ledger.reserve(promised("4", 20, "k4", terms=fast))
    other = await ledger.reserve(promised("5", 20, "k5", tenant="b", terms=fast))
    assert (told.promised, told.retry_after_s is not None, other.promised) == (False, True, True)
    # max_wait_s after the budget fell to nothing, one more promise is tried.
    await clock.reach(t0 + ended + 2.0 + MARGIN_S)
    assert (await ledger.reserve(promised("6", 20, "k6", terms=fast))).promised
    assert not (await ledger.reserve(promised("7", 20, "k7", terms=fast))).promised


async def test_a_client_that_came_back_leaves_no_such_mark(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    fast = replace(TERMS, hold_s=1.0, jitter_s=0.0, grace_s=0.3, max_wait_s=5.0)
    t0 = await clock.now()
    for i in range(4):
        await ledger.reserve(promised(str(i), 5, f"k{i}", terms=fast))
    ends = fit(20, 100, 5) + 0.3  # the last of the four
    await clock.reach(t0 + fit(20, 100, 5) + EXACT)
    for i in range(4):  # each back at its time, none finding room
        await ledger.reserve(promised(f"{i}b", 5, f"k{i}", terms=fast))
    await clock.reach(t0 + ends + MARGIN_S)
    assert (await ledger.usage("p")).promises == 0
    # Their clients came back: the budget doubled with each (64), it did not halve.
    more = [await ledger.reserve(promised(f"m{i}", 5, f"m{i}", terms=fast)) for i in range(9)]
    assert all(r.promised for r in more)
