"""The simulator's refusals as serve's (kvguard.sim.model.gate): the pool's short queue (a refused
request waits, promised nothing, and is decided again as blocks free; past its wait it gets
the promise's terms), the time told from when the leases are expected to end, and the figure
of blocks held for others while a request that fits was refused."""

from __future__ import annotations

import pytest

from kvguard.admission.capacity import PoolCapacity
from kvguard.config.loading import parse as parse_config
from kvguard.ledger import Outcome, Reservation
from kvguard.sim.model.gate import PolicyGate
from kvguard.sim.model.trace import TraceRequest
from tests.clock import Clock

CONFIG = """
tenancy:
  default_tier: chat
  tiers:
    chat: {max_tokens_cap: 1000, default_max_tokens: 1000, max_blocks: 100}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 4096
    watermark: 0.0
    capacity: {blocks: 100, block_size: 16}
    retry_after_max_seconds: 30
    queue: {max_wait_seconds: %s}
"""
# 600 prompt + 1 000 output tokens: 100 blocks of 16, the whole pool.
WHOLE = TraceRequest(0.0, "a", 600, 1000, 1000)


def gate(wait_s: float, clock: Clock) -> PolicyGate:
    config = parse_config(CONFIG % wait_s, "sim.yaml", environ={})
    return PolicyGate(config, PoolCapacity(100, 16), clock)


async def test_a_refused_request_waits_in_the_queue_and_is_admitted_as_blocks_free() -> None:
    clock = Clock(0.0)
    sim = gate(2.0, clock)
    first = await sim.admit(WHOLE, "first")
    assert first.lease is not None
    waiting = await sim.admit(TraceRequest(0.0, "b", 600, 1000, 1000), "second")
    assert (waiting.refused, waiting.wait_s) == ("kv_cache_watermark_exceeded", 2.0)
    assert (await sim.ledger.usage("p")).promises == 0  # promised nothing while it waits
    clock.now = 0.5
    again = await sim.admit(TraceRequest(0.0, "b", 600, 1000, 1000), "second")
    assert again.wait_s == pytest.approx(1.5)  # its wait ends when it did
    await sim.release(first.lease)
    admitted = await sim.admit(TraceRequest(0.0, "b", 600, 1000, 1000), "second")
    assert admitted.lease is not None and admitted.wait_s == 0.0


async def test_past_its_wait_it_is_told_when_the_leases_end_and_promised() -> None:
    clock = Clock(0.0)
    sim = gate(2.0, clock)
    assert (await sim.admit(WHOLE, "first")).lease is not None
    request = TraceRequest(0.0, "b", 600, 1000, 1000)
    assert (await sim.admit(request, "second")).wait_s == 2.0
    clock.now = 2.0
    told = await sim.admit(request, "second", final=True)
    # The first lease is expected to end when its 1 000 tokens are produced at the decode
    # rate assumed until one is measured (100 a second): 10 s after it began.
    assert told.retry_after_s is not None
    assert 8.0 <= told.retry_after_s <= 8.5  # plus up to 0.5 s of jitter
    assert (told.wait_s, (await sim.ledger.usage("p")).promises) == (0.0, 1)


async def test_without_a_queue_a_refusal_is_answered_at_once() -> None:
    clock = Clock(0.0)
    sim = gate(0.0, clock)
    assert (await sim.admit(WHOLE, "first")).lease is not None
    refused = await sim.admit(TraceRequest(0.0, "b", 600, 1000, 1000), "second")
    assert (refused.wait_s, refused.retry_after_s is not None) == (0.0, True)


async def test_blocks_held_for_others_while_a_fitting_request_is_refused_are_counted() -> None:
    """The figure's bookkeeping, with a ledger that (unlike kvguard's) refuses a request that
    fits beside the leases while it holds 30 blocks for another tenant's retries."""
    clock = Clock(0.0)
    sim = gate(0.0, clock)

    async def refusing(_claim: object) -> Reservation:
        return Reservation(Outcome.POOL_WATERMARK, 0, 0)

    async def holding(_pool: str) -> object:
        class Usage:
            holding = 30

        return Usage()

    sim.ledger.reserve = refusing  # type: ignore[method-assign, assignment]
    sim.ledger.usage = holding  # type: ignore[method-assign, assignment]
    small = TraceRequest(0.0, "b", 10, 10, 10)
    assert (await sim.admit(small, "r")).refused == "kv_cache_watermark_exceeded"
    clock.now = 4.0
    await sim.admit(small, "r")  # decided again 4 s later: 30 blocks x 4 s
    assert sim.fitting_refused_block_s == pytest.approx(120.0)
    clock.now = 5.0
    sim.ended(clock.now)  # and the last refusal until the run's end
    assert sim.fitting_refused_block_s == pytest.approx(150.0)
