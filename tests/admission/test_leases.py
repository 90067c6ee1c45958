"""The LeaseKeeper on every ledger: it renews the leases of open streams by re-asserting them,
and a lease whose stream ended is never left recorded by a renewal that raced its release."""

from __future__ import annotations

import asyncio

import pytest

from kvguard.admission.leases import LeaseKeeper
from kvguard.ledger import Ledger
from kvguard.ledger.memory import MemoryLedger
from tests.admission.late_reassert import LateReassert
from tests.clock import Clock
from tests.ledger.conftest import claim, until_usage


async def test_the_keeper_renews_by_reasserting_its_open_leases(ledger: Ledger) -> None:
    keeper = LeaseKeeper(ledger, 30)
    leases = []
    for i, pool in enumerate(["p", "p", "q"]):
        lease = (await ledger.reserve(claim(str(i), 10, pool=pool))).lease
        assert lease is not None
        keeper.hold(lease)
        leases.append(lease)
    await ledger.release(leases[0])  # lost by the ledger while its stream is still open
    keeper.release(leases[1])  # its stream ended
    await keeper.settle()
    assert await keeper.renew_all() == 1
    assert await keeper.renew_all() == 0
    assert ((await ledger.usage("p")).reserved, (await ledger.usage("q")).reserved) == (10, 10)
    assert [lease.lease_id for lease in keeper.snapshot()] == ["0", "2"]


async def test_a_renewal_cancelled_after_its_reassert_went_out_leaves_no_released_lease() -> None:
    """Shutdown cancels the keeper's renewal; a lease released while that renewal's re-assert
    waited for a connection was recorded again by it, and is released again."""
    ledger = LateReassert(MemoryLedger(Clock()))
    keeper = LeaseKeeper(ledger, 30)  # type: ignore[arg-type]
    lease = (await ledger.ledger.reserve(claim("ended", 10))).lease
    assert lease is not None
    keeper.hold(lease)
    renewal = asyncio.ensure_future(keeper.renew_all())
    await ledger.waiting.wait()  # its snapshot holds the lease
    keeper.release(lease)  # the stream ended
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0
    ledger.sent.set()
    await until_usage(ledger.ledger, 10, 1)  # the re-assert landed: recorded again
    renewal.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renewal
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0
