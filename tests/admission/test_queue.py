"""The admission queue (kvguard.admission.queue) on the memory ledger: waiters are admitted as
blocks free, the tenant holding the fewest blocks first and first in, first out within a tenant;
a tenant at its quota is passed over, a waiter that does not fit the pool holds its place
(unless blocks held for its own tenant's retry are what it waits for: another tenant's waiter
never waits for them); a wait ends in None, a full queue refuses at once, and a waiter that
leaves reserves nothing."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from kvguard.admission.queue import AdmissionQueue, QueueFull
from kvguard.ledger import Claim, Lease, LedgerUnavailable, Reservation, Terms
from kvguard.ledger.memory import MemoryLedger
from kvguard.testing.wait import wait_until

LIMIT, QUOTA = 100, 80
LONG_S = 30.0  # a wait no test reaches


class Queued:
    """A queue on a memory ledger, with the blocks held per tenant as the keeper would count
    them, the leases released for waiters that left, and every outcome."""

    def __init__(self) -> None:
        self.ledger = MemoryLedger()
        self.held: defaultdict[str, int] = defaultdict(int)
        self.given_back: list[Lease] = []
        self.outcomes: list[str] = []
        self.attempts = 0
        self.queue = AdmissionQueue(
            lambda _pool, tenant: self.held[tenant],
            self.give_back,
            on_outcome=lambda _pool, outcome, _s: self.outcomes.append(outcome),
        )

    def give_back(self, lease: Lease) -> None:
        self.given_back.append(lease)
        asyncio.get_running_loop().create_task(self.ledger.release(lease))

    async def take(self, lease_id: str, blocks: int, tenant: str = "filler") -> Lease:
        """A lease held outside the queue (the filler's quota is the whole pool)."""
        quota = LIMIT if tenant == "filler" else QUOTA
        claim = Claim(lease_id, "p", tenant, blocks, LIMIT, quota, 60)
        reservation = await self.ledger.reserve(claim)
        assert reservation.lease is not None
        self.held[tenant] += blocks
        return reservation.lease

    async def free(self, lease: Lease) -> None:
        await self.ledger.release(lease)
        self.held[lease.tenant] -= lease.blocks
        self.queue.notify("p")

    def wait(
        self, lease_id: str, blocks: int, tenant: str, max_wait_s: float = LONG_S
    ) -> asyncio.Task[Reservation | None]:
        claim = Claim(lease_id, "p", tenant, blocks, LIMIT, QUOTA, 60)

        async def attempt() -> Reservation:
            self.attempts += 1
            return await self.ledger.reserve(claim)

        return asyncio.get_running_loop().create_task(
            self.queue.wait("p", tenant, attempt, max_wait_s, 10)
        )

    async def until_queued(self, n: int) -> None:
        await wait_until(lambda: self.queue.queued("p") == n, f"{n} requests to wait")


def admitted(task: asyncio.Task[Reservation | None]) -> str:
    result = task.result()
    assert result is not None and result.lease is not None
    return result.lease.lease_id


async def test_a_waiter_is_admitted_when_a_release_frees_its_blocks() -> None:
    q = Queued()
    full = await q.take("full", 100)
    waiting = q.wait("w", 30, "a")
    await q.until_queued(1)
    assert not waiting.done()
    await q.free(full)
    await asyncio.wait_for(waiting, 5)
    assert admitted(waiting) == "w"
    assert (await q.ledger.usage("p")).reserved == 30
    assert q.outcomes == ["admitted"] and q.queue.queued("p") == 0


async def test_the_tenant_holding_fewer_blocks_goes_first_then_first_in_first_out() -> None:
    q = Queued()
    await q.take("busy", 40, tenant="busy")  # busy holds 40 blocks, quiet none
    full = await q.take("full", 60)
    order: list[str] = []
    tasks = [q.wait(f"busy-{i}", 20, "busy") for i in range(2)]
    tasks += [q.wait(f"quiet-{i}", 20, "quiet") for i in range(2)]
    await q.until_queued(4)
    for task in tasks:
        task.add_done_callback(lambda t: order.append(admitted(t)))
    await q.free(full)  # room for three of the four
    await wait_until(lambda: len(order) == 3, "three waiters to be admitted")
    # quiet (0 blocks) twice: then it holds 40 like busy, whose first comes next by arrival.
    assert order == ["quiet-0", "quiet-1", "busy-0"]
    assert q.queue.queued("p") == 1


async def test_a_tenant_at_its_quota_is_passed_over() -> None:
    q = Queued()
    await q.take("mine", 70, tenant="greedy")
    at_quota = q.wait("greedy-more", 20, "greedy")  # 90 > its quota of 80
    await q.until_queued(1)
    other = q.wait("other", 20, "other")
    await asyncio.wait_for(other, 5)
    assert admitted(other) == "other"
    assert not at_quota.done()
    at_quota.cancel()


async def test_a_waiter_that_does_not_fit_holds_its_place() -> None:
    q = Queued()
    full = await q.take("full", 90)
    big = q.wait("big", 60, "a")
    await q.until_queued(1)
    small = q.wait("small", 5, "b")  # it would fit beside the 90, but big came first
    await q.until_queued(2)
    await wait_until(lambda: q.attempts == 2, "big to be tried at each arrival")
    await q.free(await q.take("tiny", 5))  # a wake that frees too little for big
    await wait_until(lambda: q.attempts == 3, "big to be tried again")
    assert not big.done() and not small.done()  # small, which fits, was not tried
    await q.free(full)
    await asyncio.wait_for(asyncio.gather(big, small), 5)
    assert (admitted(big), admitted(small)) == ("big", "small")


async def test_a_wait_ends_in_none_and_a_full_queue_refuses_at_once() -> None:
    q = Queued()
    await q.take("full", 100)
    assert await q.wait("late", 10, "a", max_wait_s=0.05) is None
    waiting = [q.wait(f"w{i}", 10, "a") for i in range(10)]
    await q.until_queued(10)
    with pytest.raises(QueueFull):
        await q.wait("one-too-many", 10, "a")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert q.outcomes.count("timed_out") == 1 and q.outcomes.count("full") == 1
    assert q.outcomes.count("left") == 10 and q.queue.queued("p") == 0


async def test_a_waiter_that_leaves_reserves_nothing() -> None:
    q = Queued()
    full = await q.take("full", 100)
    gone = q.wait("gone", 30, "a")
    await q.until_queued(1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await q.free(full)
    await asyncio.sleep(0)
    assert (await q.ledger.usage("p")).reserved == 0
    assert q.outcomes == ["left"]


async def test_a_lease_admitted_as_its_waiter_leaves_is_given_back() -> None:
    q = Queued()
    full = await q.take("full", 100)
    gone = q.wait("gone", 30, "a")
    await q.until_queued(1)
    await q.free(full)  # the pump admits it on the next turn of the loop...
    gone.cancel()  # ...while its stream ends
    await asyncio.gather(gone, return_exceptions=True)

    async def nothing_reserved() -> bool:
        return (await q.ledger.usage("p")).reserved == 0

    await wait_until(nothing_reserved, "no lease to outlive its request")


async def test_a_failing_ledger_fails_the_wait() -> None:
    q = Queued()

    async def unreachable() -> Reservation:
        raise LedgerUnavailable("down")

    with pytest.raises(LedgerUnavailable):
        await q.queue.wait("p", "a", unreachable, LONG_S, 10)
    assert q.outcomes == ["failed"]


async def test_a_waiter_wakes_when_a_promise_ends_by_itself() -> None:
    q = Queued()
    # The pool full with a lease expected to end now: a refused claim of tenant b is promised
    # a slot now, comes back at once and holds its 20 blocks for well under a second.
    full = await q.ledger.reserve(Claim("full", "p", "filler", 100, LIMIT, LIMIT, 60, ends_in_s=0))
    assert full.lease is not None
    terms = Terms(max_wait_s=5.0, jitter_s=0.0, grace_s=0.2)
    claim = Claim("promised", "p", "b", 20, LIMIT, QUOTA, 60, "k" * 32, terms)
    assert (await q.ledger.reserve(claim)).promised
    assert (await q.ledger.reserve(claim)).waiting_s > 0  # back: held for it
    await q.ledger.release(full.lease)
    await q.take("more", 10)
    waiting = q.wait("w", 80, "b")  # b's quota fits it only once its promise is gone
    await asyncio.wait_for(waiting, 5)  # no release: the ledger said when the promise ends
    assert admitted(waiting) == "w"
    assert (await q.ledger.usage("p")).promises == 0


async def test_blocks_held_for_a_tenants_retry_never_hold_back_another_tenants_waiter() -> None:
    q = Queued()
    leases = Claim("leases", "p", "filler", 40, LIMIT, LIMIT, 60, ends_in_s=0)
    assert (await q.ledger.reserve(leases)).lease is not None
    # Tenant a's retry came back at its time: 70 blocks held against a's own later claims.
    terms = Terms(max_wait_s=5.0, jitter_s=0.0, grace_s=LONG_S)
    promise = Claim("promised", "p", "a", 70, LIMIT, QUOTA, 60, "k" * 32, terms, ends_in_s=0)
    assert (await q.ledger.reserve(promise)).promised
    assert (await q.ledger.reserve(promise)).waiting_s > 0
    first = q.wait("a-more", 10, "a")  # fits a's quota, not the pool beside a's held blocks
    await q.until_queued(1)
    other = q.wait("b", 20, "b")  # fits beside the pool's leases: a's hold is not b's
    await asyncio.wait_for(other, 5)
    assert admitted(other) == "b"
    assert not first.done()
    first.cancel()
