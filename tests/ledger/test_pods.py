"""Reservations per pod (kvguard.ledger, `Claim.pods`), on every backend: a claim that names
pods is admitted only on a pod where it fits, beside its quota and the pool's limit, on the pod
left with the most free blocks (the earliest on a tie), in the one atomic step of `reserve`;
release, expiry, growth and reassert count each pod; a refusal is told when the first of its
pods frees enough.

Pool p: limit 100 blocks, tenant quota 60 unless a test says otherwise; pods A and B of 40
blocks each unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from kvguard.ledger import Claim, Lease, Ledger, Outcome, PodLimit
from tests.ledger.conftest import MARGIN_S, LedgerClock, claim
from tests.ledger.promise_cases import TERMS, about

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"
PODS = (PodLimit(A, 40), PodLimit(B, 40))


def on_pods(
    lease_id: str,
    blocks: int,
    pods: tuple[PodLimit, ...] = PODS,
    *,
    tenant: str = "a",
    quota: int = 60,
    **changes: object,
) -> Claim:
    return replace(claim(lease_id, blocks, tenant=tenant, quota=quota), pods=pods, **changes)


async def admitted_on(ledger: Ledger, wanted: Claim) -> str:
    reservation = await ledger.reserve(wanted)
    assert reservation.outcome is Outcome.ADMITTED, reservation
    assert reservation.lease is not None
    return reservation.lease.pod


async def test_the_pod_left_with_the_most_free_blocks_is_picked(ledger: Ledger) -> None:
    assert await admitted_on(ledger, on_pods("1", 10)) == A  # a tie: the first
    assert await admitted_on(ledger, on_pods("2", 5)) == B  # 35 free on B, 25 on A
    assert await admitted_on(ledger, on_pods("3", 20, tenant="b")) == B  # 15 left, against 10
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.pods) == (35, {A: 10, B: 25})
    listed = {i.lease.lease_id: i.lease.pod for i in await ledger.leases("p")}
    assert listed == {"1": A, "2": B, "3": B}


async def test_the_order_given_breaks_ties(ledger: Ledger) -> None:
    assert await admitted_on(ledger, on_pods("1", 10, (PodLimit(B, 40), PodLimit(A, 40)))) == B


async def test_each_pod_has_its_own_limit(ledger: Ledger) -> None:
    pods = (PodLimit(A, 10), PodLimit(B, 30), PodLimit(C, 20))
    assert await admitted_on(ledger, on_pods("1", 15, pods)) == B  # 15 left, C 5, A none
    assert await admitted_on(ledger, on_pods("2", 15, pods)) == C  # B and C 15 left: B is 0 now
    assert (await ledger.usage("p")).pods == {B: 15, C: 15}


async def test_a_claim_that_fits_the_pool_but_no_pod_is_refused(ledger: Ledger) -> None:
    await admitted_on(ledger, on_pods("1", 30))
    await admitted_on(ledger, on_pods("2", 30, tenant="b"))
    # 60 of the pool's 100 are reserved, and 10 are free on each pod: 20 fit nowhere.
    refused = await ledger.reserve(on_pods("3", 20, tenant="c"))
    assert (refused.outcome, refused.lease, refused.pool_reserved) == (
        Outcome.POOL_WATERMARK,
        None,
        60,
    )
    assert await admitted_on(ledger, on_pods("4", 10, tenant="c")) in (A, B)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases) == (70, 3)


async def test_a_claim_larger_than_every_pod_is_impossible(ledger: Ledger) -> None:
    refused = await ledger.reserve(on_pods("1", 41, terms=TERMS, retry_key="k"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (refused.wait_s, refused.retry_after_s, refused.promised) == (math.inf, None, False)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.promises, usage.pods) == (0, 0, 0, {})


async def test_the_quota_and_the_pool_limit_still_bound_a_claim_with_pods(
    ledger: Ledger,
) -> None:
    pods = (PodLimit(A, 80), PodLimit(B, 80))
    await admitted_on(ledger, on_pods("1", 50, pods))
    quota = await ledger.reserve(on_pods("2", 20, pods))  # 70 > the quota of 60
    assert quota.outcome is Outcome.TENANT_QUOTA
    await admitted_on(ledger, on_pods("3", 45, pods, tenant="b"))
    limit = await ledger.reserve(on_pods("4", 10, pods, tenant="c"))  # 105 > the pool's 100
    assert limit.outcome is Outcome.POOL_WATERMARK


async def test_release_and_expiry_give_back_each_pods_blocks(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    released = await ledger.reserve(on_pods("1", 30))
    await admitted_on(ledger, on_pods("2", 30, tenant="b", lease_seconds=1.0))
    assert released.lease is not None
    await ledger.release(released.lease)
    await ledger.release(released.lease)  # idempotent
    assert (await ledger.usage("p")).pods == {B: 30}
    await clock.reach(t0 + 1 + MARGIN_S)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.pods) == (0, {})
    assert await admitted_on(ledger, on_pods("3", 40)) == A  # all free again


async def test_a_retried_reserve_answers_its_pod_and_counts_once(ledger: Ledger) -> None:
    await admitted_on(ledger, on_pods("0", 5, tenant="b"))  # on A
    first = await admitted_on(ledger, on_pods("1", 10))
    again = await admitted_on(ledger, on_pods("1", 10))
    assert (first, again) == (B, B)
    assert (await ledger.usage("p")).pods == {A: 5, B: 10}


async def test_growth_is_counted_on_its_pod_and_released_from_it(ledger: Ledger) -> None:
    lease = (await ledger.reserve(on_pods("1", 10))).lease
    assert lease is not None and lease.pod == A
    grown = replace(lease, blocks=45)  # past the pod's 40: always granted
    assert await ledger.reassert([grown], 30) == 0
    assert (await ledger.usage("p")).pods == {A: 45}
    assert await admitted_on(ledger, on_pods("2", 10, tenant="b")) == B  # A has nothing free
    await ledger.release(lease)  # the copy with fewer blocks: all 45 go back
    assert (await ledger.usage("p")).pods == {B: 10}


async def test_reassert_moves_a_lease_to_the_pod_that_served_it(ledger: Ledger) -> None:
    lease = (await ledger.reserve(on_pods("1", 30))).lease
    assert lease is not None and lease.pod == A
    moved = replace(lease, pod=B)
    assert await ledger.reassert([moved], 30) == 0
    assert await ledger.reassert([moved], 30) == 0  # idempotent
    assert (await ledger.usage("p")).pods == {B: 30}
    assert {i.lease.pod for i in await ledger.leases("p")} == {B}
    assert await admitted_on(ledger, on_pods("2", 40, tenant="b")) == A
    await ledger.release(lease)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.pods) == (40, {A: 40})


async def test_reassert_without_a_pod_keeps_the_leases_own(ledger: Ledger) -> None:
    lease = (await ledger.reserve(on_pods("1", 30))).lease
    assert lease is not None
    assert await ledger.reassert([replace(lease, pod="", blocks=35)], 30) == 0
    assert (await ledger.usage("p")).pods == {A: 35}


async def test_a_lost_lease_is_recorded_again_on_its_pod(ledger: Ledger) -> None:
    lost = Lease("lost", "p", "a", 50, pod=B)  # running there, whatever the pod's limit says
    assert await ledger.reassert([lost], 30) == 1
    assert (await ledger.usage("p")).pods == {B: 50}
    assert await admitted_on(ledger, on_pods("2", 40, tenant="b")) == A
    refused = await ledger.reserve(on_pods("3", 1, tenant="c"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    await ledger.release(lost)
    assert (await ledger.usage("p")).pods == {A: 40}


async def test_a_refusal_is_told_when_the_first_of_its_pods_frees_enough(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    for lease_id, tenant, ends_in_s in (("a1", "x", 9.0), ("b1", "y", 4.0)):
        await admitted_on(ledger, on_pods(lease_id, 30, tenant=tenant, ends_in_s=ends_in_s))
    # 60 of the pool's 100 reserved, but 10 free on each pod: B's lease ends first.
    refused = await ledger.reserve(on_pods("2", 25, tenant="c", terms=TERMS))
    assert refused.outcome is Outcome.POOL_WATERMARK
    await about(clock, t0, refused.wait_s, 4.0)
    await about(clock, t0, refused.retry_after_s, 4.0 + TERMS.jitter_s)
    # On A alone, A's lease.
    alone = await ledger.reserve(on_pods("3", 25, (PodLimit(A, 40),), tenant="c", terms=TERMS))
    await about(clock, t0, alone.wait_s, 9.0)


async def test_concurrent_reserves_admit_exactly_what_fits_on_each_pod(ledger: Ledger) -> None:
    pods = (PodLimit(A, 30), PodLimit(B, 23))
    results = await asyncio.gather(
        *(ledger.reserve(on_pods(str(i), 7, pods, tenant=f"t{i % 5}")) for i in range(30))
    )
    admitted = [r.lease for r in results if r.lease is not None]
    assert len(admitted) == 30 // 7 + 23 // 7
    usage = await ledger.usage("p")
    assert usage.pods == {A: 7 * (30 // 7), B: 7 * (23 // 7)}
