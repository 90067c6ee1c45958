"""The ledger's promises (kvguard.ledger, "Terms"), on every backend: a refused claim with terms
and a retry key is promised the time when enough leases are expected to end for it to fit
beside its own tenant's promises before it; nothing is held for it until its client comes back,
and what is then held counts against its own tenant's later claims only. Another tenant's
claims never count a promise. A tenant whose client never came back is told the time, with
nothing held.

Pool p: limit 100 blocks, tenant quota 60 (the cases are in promise_cases.py). `fill` has
tenants x and y hold 50 blocks each, y's lease expected to end first. Times on Redis run on its
own clock: a time is checked between what it would be at the moment of the call and at the
moment the leases were reserved (`about`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvguard.ledger import PROMISE_BUDGET, Ledger, Outcome
from tests.ledger.conftest import MARGIN_S, LedgerClock, claim
from tests.ledger.promise_cases import (
    EXACT,
    TERMS,
    X_ENDS_S,
    Y_ENDS_S,
    about,
    ending,
    fill,
    promised,
)


async def test_the_time_is_when_enough_leases_are_expected_to_end(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    await fill(ledger)
    small = await ledger.reserve(promised("1", 20, "k1"))
    large = await ledger.reserve(promised("2", 60, "k2", tenant="b", quota=100))
    assert (small.outcome, large.outcome) == (Outcome.POOL_WATERMARK, Outcome.POOL_WATERMARK)
    # 20 blocks over the limit: y's lease frees them; 60: y's and x's.
    await about(clock, t0, small.wait_s, Y_ENDS_S)
    await about(clock, t0, small.retry_after_s, Y_ENDS_S + 0.5)
    await about(clock, t0, large.wait_s, X_ENDS_S)
    assert (small.promised, large.promised) == (True, True)
    usage = await ledger.usage("p")
    # Nothing is held until a client comes back.
    assert (usage.reserved, usage.promised, usage.promises, usage.holding) == (100, 80, 2, 0)


async def test_a_tenants_refusals_get_successive_slots_and_others_their_own(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    await fill(ledger)
    first = await ledger.reserve(promised("1", 20, "k1"))
    second = await ledger.reserve(promised("2", 20, "k2"))
    third = await ledger.reserve(promised("3", 20, "k3"))
    other = await ledger.reserve(promised("4", 20, "k4", tenant="b"))
    assert [r.promised for r in (first, second, third, other)] == [True] * 4
    # 20, then 40 over counting a's first promise: y's 50 free them; then 60: x's too.
    await about(clock, t0, first.wait_s, Y_ENDS_S)
    await about(clock, t0, second.wait_s, Y_ENDS_S)
    await about(clock, t0, third.wait_s, X_ENDS_S)
    # Another tenant is told its own time: a's promises are not its.
    await about(clock, t0, other.wait_s, Y_ENDS_S)


async def test_the_quota_waits_for_its_tenants_own_leases(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    assert (await ledger.reserve(ending("o", 30, 1.0, tenant="other"))).outcome is (
        Outcome.ADMITTED
    )
    for lease_id, ends_s in (("a1", 6.0), ("a2", 2.0)):
        assert (await ledger.reserve(ending(lease_id, 30, ends_s))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(promised("3", 30, "k3"))
    assert refused.outcome is Outcome.TENANT_QUOTA
    # The other tenant's lease ends first, but frees none of a's quota: a's own does.
    await about(clock, t0, refused.wait_s, 2.0)
    behind = await ledger.reserve(promised("4", 30, "k4"))
    await about(clock, t0, behind.wait_s, 6.0)  # 30 of its own promised before it: 60 over


async def test_a_lease_without_an_expected_end_ends_at_its_expiry(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    lease = claim("x", 100, tenant="x", quota=100, lease_s=20.0)
    assert (await ledger.reserve(lease)).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(promised("1", 10, "k1"))
    await about(clock, t0, refused.wait_s, 20.0)


async def test_a_reassert_moves_a_leases_expected_end(ledger: Ledger, clock: LedgerClock) -> None:
    t0 = await clock.now()
    await fill(ledger)
    t1 = await clock.now()
    await ledger.reassert([replace(ending("y", 50, None, tenant="y").lease(), ends_in_s=12.0)], 30)
    refused = await ledger.reserve(promised("1", 20, "k1"))
    await about(clock, t0, refused.wait_s, X_ENDS_S)  # x's lease is now the first to end
    await ledger.reassert([replace(ending("x", 50, None, tenant="x").lease(), ends_in_s=20.0)], 30)
    again = await ledger.reserve(promised("2", 20, "k2", tenant="b"))
    await about(clock, t1, again.wait_s, 12.0)
    # A re-assert without an end keeps the one the ledger has.
    await ledger.reassert([ending("y", 50, None, tenant="y").lease()], 30)
    kept = await ledger.reserve(promised("3", 20, "k3", tenant="c"))
    await about(clock, t1, kept.wait_s, 12.0)


async def test_a_lease_past_its_expected_end_is_taken_to_end_now(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger, y_ends_s=0.2)
    t0 = await clock.now()
    await clock.reach(t0 + 0.2 + MARGIN_S)
    refused = await ledger.reserve(promised("1", 20, "k1", terms=replace(TERMS, jitter_s=0.0)))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (refused.wait_s, refused.retry_after_s, refused.promised) == (0.0, 0.0, True)


async def test_another_tenants_claim_that_fits_is_admitted_beside_held_promises(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=10.0)
    await fill(ledger, y_ends_s=0.2)
    first = await ledger.reserve(promised("1", 20, "k1", terms=fast))
    assert first.promised and first.retry_after_s is not None
    t1 = await clock.now()
    await clock.reach(t1 + first.retry_after_s + EXACT)
    back = await ledger.reserve(promised("1b", 20, "k1", terms=fast))  # y still running
    assert (back.outcome, back.promised) == (Outcome.POOL_WATERMARK, True)
    assert back.waiting_s > 0
    assert (await ledger.usage("p")).holding == 20
    await ledger.release(ending("y", 50, None, tenant="y").lease())
    # 50 reserved, 20 held for a's retry: b fills the pool all the same.
    other = await ledger.reserve(ending("2", 50, 1.0, tenant="b"))
    assert (other.outcome, other.holding) == (Outcome.ADMITTED, 0)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.holding) == (100, 20)


async def test_a_promise_whose_client_never_returns_holds_nothing(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.3)
    await fill(ledger, y_ends_s=0.2)
    t0 = await clock.now()
    for tenant in "ab":
        reserved = await ledger.reserve(
            promised(tenant, 20, f"k{tenant}", tenant=tenant, terms=fast)
        )
        assert reserved.promised
    await ledger.release(ending("y", 50, None, tenant="y").lease())
    # Before their time, at it and after it: nobody came back, so nothing counts held, for
    # another tenant nor for their own.
    assert (await ledger.reserve(ending("c1", 10, 1.0, tenant="c"))).outcome is Outcome.ADMITTED
    await clock.reach(t0 + 0.2 + MARGIN_S)
    own = await ledger.reserve(ending("a2", 20, 1.0))
    assert (own.outcome, own.holding) == (Outcome.ADMITTED, 0)
    assert (await ledger.reserve(ending("c2", 20, 1.0, tenant="c"))).outcome is Outcome.ADMITTED
    await clock.reach(t0 + 0.2 + 0.3 + MARGIN_S)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promises, usage.holding) == (100, 0, 0)


async def test_the_promised_tenants_own_later_claims_wait_behind_its_retry(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=10.0)
    await fill(ledger, y_ends_s=0.2)
    first = await ledger.reserve(promised("1", 20, "k1", terms=fast))
    assert first.retry_after_s is not None
    t1 = await clock.now()
    await clock.reach(t1 + first.retry_after_s + EXACT)
    assert (await ledger.reserve(promised("1b", 20, "k1", terms=fast))).waiting_s > 0
    await ledger.release(ending("y", 50, None, tenant="y").lease())
    # a's fresh claims count its retry's 20 held blocks, in the pool (50 + 20 + 40 > 100) and
    # in its quota (20 + 41 > 60).
    fresh = await ledger.reserve(ending("2", 40, 1.0))
    assert (fresh.outcome, fresh.holding) == (Outcome.POOL_WATERMARK, 20)
    assert (await ledger.reserve(ending("3", 41, 1.0))).outcome is Outcome.TENANT_QUOTA
    # The retry counts no promise before it and takes its blocks; then a's claims fit again.
    retry = await ledger.reserve(promised("1c", 20, "k1", terms=fast))
    assert (retry.outcome, retry.holding) == (Outcome.ADMITTED, 0)
    assert (await ledger.reserve(ending("4", 30, 1.0))).outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promises, usage.holding) == (100, 0, 0)
    assert usage.tenants == {"x": 50, "a": 50}


async def test_a_tenant_at_its_quota_waits_behind_its_retry_and_no_other_tenant_does(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=10.0)
    assert (await ledger.reserve(ending("a1", 60, 0.2))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(promised("2", 30, "k2", terms=fast))
    assert (refused.outcome, refused.promised) == (Outcome.TENANT_QUOTA, True)
    assert refused.retry_after_s is not None
    t1 = await clock.now()
    await clock.reach(t1 + refused.retry_after_s + EXACT)
    back = await ledger.reserve(promised("2b", 30, "k2", terms=fast))
    assert (back.outcome, back.waiting_s > 0) == (Outcome.TENANT_QUOTA, True)
    await ledger.release(ending("a1", 60, None).lease())
    # a's quota: 30 held for its retry, so 31 more do not fit; b fills the pool.
    assert (await ledger.reserve(ending("3", 31, 1.0))).outcome is Outcome.TENANT_QUOTA
    assert (await ledger.reserve(ending("4", 70, 1.0, tenant="b", quota=100))).outcome is (
        Outcome.ADMITTED
    )
    assert (await ledger.reserve(promised("2c", 30, "k2", terms=fast))).outcome is (
        Outcome.ADMITTED
    )


async def test_a_retry_that_came_back_holds_its_blocks_until_its_grace_ends(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.5)
    await fill(ledger, y_ends_s=0.2)
    t0 = await clock.now()
    await ledger.reserve(promised("1", 20, "k1", terms=fast))
    await ledger.reserve(promised("2", 20, "k2", tenant="b", terms=fast))
    await clock.reach(t0 + 0.2 + EXACT)
    back = await ledger.reserve(promised("1b", 20, "k1", terms=fast))
    assert (back.outcome, back.promised) == (Outcome.POOL_WATERMARK, True)
    # Its blocks stay held for it until its grace ends: the caller may wait that long.
    elapsed = await clock.now() - t0
    assert 0.2 + 0.5 - elapsed - MARGIN_S <= back.waiting_s <= 0.2 + 0.5 - elapsed + EXACT
    usage = await ledger.usage("p")
    assert (usage.promised, usage.promises, usage.holding) == (40, 2, 20)
    await clock.reach(t0 + 0.2 + 0.5 + MARGIN_S)
    usage = await ledger.usage("p")
    assert (usage.promised, usage.promises, usage.holding) == (0, 0, 0)


async def test_the_retry_takes_its_promise(ledger: Ledger) -> None:
    await fill(ledger)
    await ledger.reserve(promised("1", 20, "k1"))
    await ledger.release(ending("y", 50, None, tenant="y").lease())
    retry = await ledger.reserve(promised("1-again", 20, "k1"))
    assert retry.outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.promised, usage.promises) == (70, 0, 0)


async def test_a_key_holds_its_promise_only_for_its_tenant(
    ledger: Ledger, clock: LedgerClock
) -> None:
    await fill(ledger)
    t0 = await clock.now()
    first = await ledger.reserve(promised("1", 20, "k1"))
    intruder = await ledger.reserve(promised("2", 10, "k1", tenant="intruder"))
    assert (intruder.outcome, intruder.promised) == (Outcome.POOL_WATERMARK, False)
    usage = await ledger.usage("p")
    assert (usage.promised, usage.promises) == (20, 1)
    again = await ledger.reserve(promised("1b", 20, "k1"))
    assert again.retry_after_s is not None and first.retry_after_s is not None
    await about(clock, t0, again.retry_after_s, first.retry_after_s)  # its own time


async def test_no_promise_past_max_wait(ledger: Ledger, clock: LedgerClock) -> None:
    t0 = await clock.now()
    await fill(ledger)
    short = replace(TERMS, max_wait_s=2.5)
    refused = await ledger.reserve(promised("1", 20, "k1", terms=short))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (refused.retry_after_s, refused.promised) == (None, False)
    await about(clock, t0, refused.wait_s, Y_ENDS_S)
    assert (await ledger.usage("p")).promises == 0


async def test_no_promise_when_the_leases_cannot_free_enough(ledger: Ledger) -> None:
    await fill(ledger)
    for i in range(4):  # 80 promised to a, then 20 more: 120 over, beyond the 100 leased
        await ledger.reserve(promised(str(i), 20, f"k{i}", quota=200))
    refused = await ledger.reserve(promised("5", 30, "k5", quota=200))
    assert (refused.wait_s, refused.retry_after_s, refused.promised) == (math.inf, None, False)


async def test_without_terms_or_key_nothing_is_promised(ledger: Ledger, clock: LedgerClock) -> None:
    t0 = await clock.now()
    await fill(ledger)
    bare = await ledger.reserve(claim("1", 20))
    keyless = await ledger.reserve(promised("2", 20, ""))
    assert (bare.wait_s, bare.retry_after_s, bare.promised) == (0.0, None, False)
    # Without a key the time is told, and nothing promised to a retry that cannot be known.
    await about(clock, t0, keyless.wait_s, Y_ENDS_S)
    assert keyless.retry_after_s == pytest.approx(keyless.wait_s + 0.5, abs=EXACT)
    assert not keyless.promised
    assert (await ledger.usage("p")).promises == 0


async def test_a_retry_back_early_keeps_its_time(ledger: Ledger, clock: LedgerClock) -> None:
    await fill(ledger)
    t0 = await clock.now()
    first = await ledger.reserve(promised("1", 20, "k1"))
    assert first.retry_after_s is not None
    await clock.reach(t0 + 1)
    early = await ledger.reserve(promised("1b", 20, "k1"))
    assert (early.outcome, early.promised, early.waiting_s) == (Outcome.POOL_WATERMARK, True, 0)
    await about(clock, t0, early.retry_after_s, first.retry_after_s)
    assert (await ledger.usage("p")).holding == 0


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


async def test_a_tenant_has_at_most_its_budget_of_promises_open(ledger: Ledger) -> None:
    await fill(ledger)
    first = [await ledger.reserve(promised(str(i), 5, f"k{i}")) for i in range(4)]
    fifth = await ledger.reserve(promised("4", 5, "k4"))
    other = await ledger.reserve(promised("5", 5, "k5", tenant="b"))
    assert [r.promised for r in first] == [True] * PROMISE_BUDGET
    # Told when, with nothing promised: the tenant's clients have not shown they come back.
    assert (fifth.promised, fifth.retry_after_s is not None, other.promised) == (False, True, True)


async def test_a_client_that_comes_back_doubles_its_tenants_budget(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0)
    await fill(ledger, y_ends_s=0.5)
    t0 = await clock.now()
    for i in range(4):
        await ledger.reserve(promised(str(i), 5, f"k{i}", terms=fast))
    # Before its time the same body may be another client's: it does not count.
    early = await ledger.reserve(promised("0a", 5, "k0", terms=fast))
    assert early.promised
    assert not (await ledger.reserve(promised("x", 5, "kx", terms=fast))).promised
    await clock.reach(t0 + 0.5 + EXACT)
    back = await ledger.reserve(promised("0b", 5, "k0", terms=fast))  # at its time
    assert back.waiting_s > 0
    more = [await ledger.reserve(promised(str(i), 5, f"k{i}", terms=fast)) for i in range(4, 9)]
    assert [r.promised for r in more] == [True] * 4 + [False]  # 8 open at most now


async def test_promises_never_claimed_halve_the_budget_down_to_one_try_later(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.2, max_wait_s=2.0)
    await fill(ledger, y_ends_s=0.2)
    t0 = await clock.now()
    for i in range(4):
        assert (await ledger.reserve(promised(str(i), 5, f"k{i}", terms=fast))).promised
    ended = 0.2 + 0.2  # all four due when y ends, unclaimed: 4 -> 2 -> 1 -> 0 -> 0
    await clock.reach(t0 + ended + MARGIN_S)
    told = await ledger.reserve(promised("4", 5, "k4", terms=fast))
    other = await ledger.reserve(promised("5", 5, "k5", tenant="b", terms=fast))
    assert (told.promised, told.retry_after_s is not None, other.promised) == (False, True, True)
    # max_wait_s after the budget fell to nothing, one more promise is tried.
    await clock.reach(t0 + ended + 2.0 + MARGIN_S)
    assert (await ledger.reserve(promised("6", 5, "k6", terms=fast))).promised
    assert not (await ledger.reserve(promised("7", 5, "k7", terms=fast))).promised


async def test_a_client_that_came_back_leaves_no_such_mark(
    ledger: Ledger, clock: LedgerClock
) -> None:
    fast = replace(TERMS, jitter_s=0.0, grace_s=0.3, max_wait_s=5.0)
    await fill(ledger, y_ends_s=0.2)
    t0 = await clock.now()
    for i in range(4):
        await ledger.reserve(promised(str(i), 5, f"k{i}", terms=fast))
    await clock.reach(t0 + 0.2 + EXACT)
    for i in range(4):  # each back at its time, none finding room
        await ledger.reserve(promised(f"{i}b", 5, f"k{i}", terms=fast))
    await clock.reach(t0 + 0.2 + 0.3 + MARGIN_S)
    assert (await ledger.usage("p")).promises == 0
    # Their clients came back: the budget doubled with each (64), it did not halve.
    more = [await ledger.reserve(promised(f"m{i}", 5, f"m{i}", terms=fast)) for i in range(9)]
    assert all(r.promised for r in more)
