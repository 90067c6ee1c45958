"""Growing leases: a calibrated request's counted blocks follow its decoding (elapsed time at the
pool's decode rate, or the tokens seen in its stream) up to its limit, on a memory ledger and an
injected clock; growth is always granted, and a lease released meanwhile stays released."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from typing import cast

import pytest

from kvguard.admission.calibration import DEFAULT_DECODE_RATE, Growth
from kvguard.admission.leases import LeaseKeeper
from kvguard.admission.sizing import blocks_needed
from kvguard.ledger import Claim, Lease, Ledger, Outcome, Terms
from kvguard.ledger.memory import MemoryLedger
from kvguard.testing.wait import wait_until
from tests.admission.late_reassert import LateReassert
from tests.clock import Clock
from tests.ledger.conftest import until_usage

BLOCK = 16
PROMPT = 40
LIMIT = 512
LEASE_S = 3600.0  # longer than any test's clock moves: no lease expires


class Recording:
    """A memory ledger that records the leases each re-assert carries."""

    def __init__(self, ledger: MemoryLedger) -> None:
        self.ledger = ledger
        self.reasserts: list[list[Lease]] = []

    async def reserve(self, claim: Claim) -> object:
        return await self.ledger.reserve(claim)

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        self.reasserts.append(list(leases))
        return await self.ledger.reassert(self.reasserts[-1], lease_seconds)

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)


def growth(
    clock: Clock,
    reserved: int,
    *,
    prompts: tuple[int, ...] = (PROMPT,),
    n: int = 1,
    limit: int = LIMIT,
) -> Growth:
    return Growth("p", prompts, n, BLOCK, limit, reserved, clock.now)


async def held(
    ledger: MemoryLedger,
    lease_id: str,
    grows: Growth,
    *,
    pool_limit: int = 10_000,
    ends_in_s: float | None = None,
) -> Lease:
    """A lease of `grows`'s blocks, within `pool_limit` more blocks (0: the pool's limit is
    these blocks), expected to end `ends_in_s` from now."""
    blocks = blocks_needed(list(grows.prompt_tokens), grows.reserved_output, grows.n, BLOCK)
    limit = pool_limit or blocks
    claim = Claim(lease_id, "p", "a", blocks, limit, 10_000, LEASE_S, ends_in_s=ends_in_s)
    reservation = await ledger.reserve(claim)
    assert reservation.lease is not None
    return reservation.lease


def keeper_on(
    ledger: object, clock: Clock, rate: float | None = 10.0, ahead_s: float = 0.0
) -> LeaseKeeper:
    """A keeper on `ledger` (a memory ledger, or one wrapping it) at the decode rate `rate`,
    growing leases to what they hold `ahead_s` later (0: exactly what they hold now)."""
    return LeaseKeeper(
        cast(Ledger, ledger),
        LEASE_S,
        clock=clock,
        decode_rate=lambda _: rate,
        grow_ahead_s=ahead_s,
    )


def test_growth_counts_the_output_decoded_so_far_between_reserved_and_limit() -> None:
    grows = Growth("p", (PROMPT,), 2, BLOCK, 100, 8, 1000.0)
    assert grows.grows and grows.limit_blocks == 2 * math.ceil(140 / BLOCK)
    assert grows.blocks_at(999.0, 10.0) == 2 * math.ceil(48 / BLOCK)  # never below reserved
    assert grows.blocks_at(1005.0, 10.0) == 2 * math.ceil(90 / BLOCK)
    assert grows.blocks_at(1001.0, 10.0, seen=70) == 2 * math.ceil(110 / BLOCK)
    assert grows.blocks_at(2000.0, 10.0) == grows.limit_blocks
    assert grows.blocks_at(1000.0, 10.0, seen=10_000) == grows.limit_blocks
    assert not Growth("p", (PROMPT,), 1, BLOCK, 100, 100, 0.0).grows


async def test_a_lease_grows_with_the_time_its_request_decodes() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8)
    lease = await held(ledger, "g", grows)
    assert lease.blocks == math.ceil((PROMPT + 8) / BLOCK) == 3
    keeper.hold(lease, grows)
    assert await keeper.grow_all() == []  # no time passed: what it reserved
    for seconds in (5.0, 20.0, 33.3):
        clock.now = grows.admitted_at + seconds
        expected = math.ceil((PROMPT + math.ceil(seconds * 10)) / BLOCK)
        grown = await keeper.grow_all()
        assert [(g.lease_id, g.blocks) for g in grown] == [("g", expected)]
        assert (await ledger.usage("p")).tenants == {"a": expected}
        assert [(s.lease_id, s.blocks) for s in keeper.snapshot()] == [("g", expected)]


async def test_an_unknown_decode_rate_is_the_default() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=None)
    grows = growth(clock, 8)
    keeper.hold(await held(ledger, "g", grows), grows)
    clock.now += 2.0
    await keeper.grow_all()
    tokens = math.ceil(2.0 * DEFAULT_DECODE_RATE)
    assert (await ledger.usage("p")).reserved == math.ceil((PROMPT + tokens) / BLOCK)


@pytest.mark.parametrize(("prompts", "n"), [((PROMPT,), 2), ((PROMPT, 10), 1), ((PROMPT, 10), 3)])
async def test_tokens_seen_beyond_the_time_estimate_raise_the_lease(
    prompts: tuple[int, ...], n: int
) -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8, prompts=prompts, n=n)
    keeper.hold(await held(ledger, "g", grows), grows)
    clock.now += 1.0  # 10 tokens by the clock
    sequences = len(prompts) * n
    keeper.seen("g", 200 * sequences - 1)  # 200 per sequence, rounded up
    await keeper.grow_all()
    expected = blocks_needed(list(prompts), 200, n, BLOCK)
    assert (await ledger.usage("p")).reserved == expected
    keeper.seen("g", 5)  # a smaller count later: counted blocks never go down
    await keeper.grow_all()
    assert (await ledger.usage("p")).reserved == expected


async def test_growth_stops_at_the_limit_and_is_not_reasserted_again() -> None:
    clock = Clock()
    recording = Recording(MemoryLedger(clock))
    keeper = keeper_on(recording, clock, rate=10.0)
    grows = growth(clock, 8, limit=100)
    limit_blocks = math.ceil((PROMPT + 100) / BLOCK)
    keeper.hold(await held(recording.ledger, "g", grows), grows)
    clock.now += 5.0
    await keeper.grow_all()
    assert len(recording.reasserts) == 1
    clock.now += 1000.0
    grown = await keeper.grow_all()
    assert [g.blocks for g in grown] == [limit_blocks]
    assert [[lease.blocks for lease in call] for call in recording.reasserts] == [
        [math.ceil(90 / BLOCK)],
        [limit_blocks],
    ]
    clock.now += 1000.0
    keeper.seen("g", 10_000)  # no longer followed
    assert await keeper.grow_all() == []
    assert len(recording.reasserts) == 2
    assert (await recording.ledger.usage("p")).reserved == limit_blocks
    assert keeper.snapshot()[0].blocks == limit_blocks


async def test_a_lease_released_after_growing_gives_back_everything() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8)
    lease = await held(ledger, "g", grows)
    keeper.hold(lease, grows)
    clock.now += 30.0
    await keeper.grow_all()
    assert (await ledger.usage("p")).reserved == math.ceil(340 / BLOCK)
    keeper.release(lease)  # the stream's copy, with the blocks it was admitted with
    await keeper.settle()
    assert (await ledger.usage("p")).reserved == 0
    assert (await ledger.usage("p")).leases == 0
    clock.now += 30.0
    assert await keeper.grow_all() == []  # a released lease no longer grows
    assert (await ledger.usage("p")).reserved == 0


async def test_a_lease_released_while_its_growth_is_reasserted_is_released_again() -> None:
    clock = Clock()
    ledger = LateReassert(MemoryLedger(clock))
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8)
    lease = await held(ledger.ledger, "g", grows)
    keeper.hold(lease, grows)
    clock.now += 30.0
    grow = asyncio.ensure_future(keeper.grow_all())
    await ledger.waiting.wait()  # its re-assert carries the grown lease
    keeper.release(lease)  # the stream ended
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0
    ledger.sent.set()
    grown_blocks = math.ceil(340 / BLOCK)
    await until_usage(ledger.ledger, grown_blocks, 1)  # the re-assert landed: recorded again
    ledger.answered.set()
    assert [g.blocks for g in await grow] == [grown_blocks]
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0
    assert keeper.open_leases == 0


async def test_grow_all_returns_only_the_leases_that_grew() -> None:
    clock = Clock()
    recording = Recording(MemoryLedger(clock))
    keeper = keeper_on(recording, clock, rate=10.0)
    fast, slow = growth(clock, 8), growth(clock, 300)
    keeper.hold(await held(recording.ledger, "fast", fast), fast)
    keeper.hold(await held(recording.ledger, "slow", slow), slow)
    clock.now += 5.0  # 50 tokens: past the first's 8, within the second's 300
    grown = await keeper.grow_all()
    assert [(g.lease_id, g.blocks) for g in grown] == [("fast", math.ceil(90 / BLOCK))]
    assert [[lease.lease_id for lease in call] for call in recording.reasserts] == [["fast"]]
    usage = await recording.ledger.usage("p")
    assert usage.reserved == math.ceil(90 / BLOCK) + math.ceil(340 / BLOCK)


async def test_leases_held_without_growth_never_grow() -> None:
    clock = Clock()
    recording = Recording(MemoryLedger(clock))
    keeper = keeper_on(recording, clock, rate=10.0)
    plain = await held(recording.ledger, "plain", growth(clock, 8))
    keeper.hold(plain)
    whole = growth(clock, LIMIT)  # reserved its whole limit: nothing to follow
    keeper.hold(await held(recording.ledger, "whole", whole), whole)
    before = (await recording.ledger.usage("p")).reserved
    clock.now += 1000.0
    keeper.seen("plain", 10_000)
    keeper.seen("whole", 10_000)
    assert await keeper.grow_all() == []
    assert recording.reasserts == []
    assert (await recording.ledger.usage("p")).reserved == before
    assert sorted(lease.blocks for lease in keeper.snapshot()) == [3, math.ceil(552 / BLOCK)]


async def test_growth_past_the_pool_limit_is_granted_and_new_claims_are_refused() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8)
    keeper.hold(await held(ledger, "g", grows, pool_limit=20), grows)
    clock.now += 1000.0
    await keeper.grow_all()
    limit_blocks = math.ceil((PROMPT + LIMIT) / BLOCK)
    assert limit_blocks > 20
    assert (await ledger.usage("p")).reserved == limit_blocks
    refused = await ledger.reserve(Claim("next", "p", "b", 1, 20, 10_000, LEASE_S))
    assert refused.outcome is Outcome.POOL_WATERMARK and refused.lease is None
    assert (await ledger.usage("p")).tenants == {"a": limit_blocks}


async def test_grow_forever_raises_growing_leases_on_its_interval() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)
    keeper = keeper_on(ledger, clock, rate=10.0)
    grows = growth(clock, 8)
    keeper.hold(await held(ledger, "g", grows), grows)
    clock.now += 5.0
    task = asyncio.ensure_future(keeper.grow_forever(interval_s=0.01))
    try:

        async def grown() -> bool:
            return (await ledger.usage("p")).reserved == math.ceil(90 / BLOCK)

        await wait_until(grown, "the lease to grow to 6 blocks")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_lease_that_must_grow_is_raised_ahead_and_left_alone_meanwhile() -> None:
    clock = Clock()
    ledger = Recording(MemoryLedger(clock=clock))
    keeper = keeper_on(ledger, clock, rate=10.0, ahead_s=2.0)
    grows = growth(clock, reserved=8)
    keeper.hold(await held(ledger.ledger, "g", grows), grows)
    clock.now += 5.0  # 50 tokens decoded: 90 tokens need 6 blocks; 2 s ahead, 110 need 7
    assert [(lease.lease_id, lease.blocks) for lease in await keeper.grow_all()] == [("g", 7)]
    clock.now += 1.0  # 60 tokens: 100 need 7 blocks, as counted
    assert await keeper.grow_all() == []
    assert len(ledger.reasserts) == 1


def test_a_request_is_expected_to_end_when_its_limit_is_produced() -> None:
    grows = Growth("p", (PROMPT,), 2, BLOCK, 100, 8, 1000.0)
    assert grows.ends_in_s(1000.0, 10.0) == 10.0  # its whole limit, per sequence
    assert grows.ends_in_s(1004.0, 10.0) == 6.0  # less what the time produced at the rate
    assert grows.ends_in_s(1001.0, 10.0, seen=70) == 3.0  # less what its stream showed
    assert grows.ends_in_s(1020.0, 10.0) == 0.0  # past it: any moment now
    assert grows.ends_in_s(1000.0, None) == 100 / DEFAULT_DECODE_RATE


async def test_the_ledger_is_told_when_a_lease_is_expected_to_end_as_that_moves() -> None:
    clock = Clock()
    recording = Recording(MemoryLedger(clock))
    rate = [10.0]
    keeper = LeaseKeeper(
        cast(Ledger, recording), LEASE_S, clock=clock, decode_rate=lambda _: rate[0]
    )
    whole = growth(clock, LIMIT)  # the worst case: 512 tokens at 10 a second, 51.2 s
    lease = await held(recording.ledger, "whole", whole, pool_limit=0, ends_in_s=51.2)
    keeper.hold(lease, whole)
    clock.now += 10.0
    assert await keeper.grow_all() == []
    assert recording.reasserts == []  # on time: nothing to tell
    rate[0] = 5.0  # the pool slows: 50 tokens produced by now, 462 left at 5 a second
    assert await keeper.grow_all() == []  # its blocks stay; its end moves
    assert [[(c.lease_id, c.ends_in_s) for c in call] for call in recording.reasserts] == [
        [("whole", pytest.approx(92.4))]
    ]
    # A refusal is told that end: the pool has no room until this lease ends.
    terms = Terms(max_wait_s=300.0, jitter_s=0.0, grace_s=1.0)
    refused = await recording.ledger.reserve(
        Claim("next", "p", "b", 1, lease.blocks, 10_000, LEASE_S, terms=terms)
    )
    assert refused.wait_s == pytest.approx(92.4)
    keeper.seen("whole", 400)  # its stream shows it ahead: 112 tokens left
    await keeper.grow_all()
    assert recording.reasserts[-1][0].ends_in_s == pytest.approx(22.4)
    assert keeper.snapshot()[0].ends_in_s == pytest.approx(22.4)
    clock.now += 0.5  # moved by less than the tolerance: not told again
    await keeper.grow_all()
    assert len(recording.reasserts) == 2
