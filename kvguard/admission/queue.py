"""A short queue before a 429 (docs/design.md, "A short queue before a 429").

A request refused for its tenant's quota or the pool's watermark waits, holding its stream,
and is admitted as soon as blocks free, or gets its 429 when its wait ends. A promised retry
back at its time waits here too, for the rest of its held blocks, before every other waiter.
One pump per pool tries the waiters' claims, one at a time, in the queue's order: the tenant
this process holds the fewest blocks for first, then first in, first out within a tenant. A
waiter whose tenant is at its quota, or that counted blocks held for its tenant's retries, is
passed over; any other waiter that does not fit the pool stops the pass (the order holds:
smaller claims behind it do not take the blocks it waits for).

The pump runs when something may have freed blocks (`notify`): a release, a capacity or policy
change, a new waiter, and the moment the ledger says a lease or a promise ends by itself.
Nothing polls. Fairness is per kvguard process: each process orders its own waiters; replicas
sharing a Redis ledger compete for the freed blocks.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvguard.ledger import Lease, Outcome, Reservation

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The pool's queue holds max_queued requests: refuse at once."""


@dataclass(eq=False)
class _Waiter:
    tenant: str
    seq: int
    attempt: Callable[[], Awaitable[Reservation]]
    since: float
    promised: bool  # a promised retry waiting for its held blocks: tried first, never in the way
    answer: asyncio.Future[Reservation] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class _Pool:
    waiters: list[_Waiter] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None  # the next moment room may appear by itself


class QueueOutcome(enum.StrEnum):
    """How a queued request's wait ended: kvguard_queue_wait_seconds's outcome label."""

    ADMITTED = "admitted"
    TIMED_OUT = "timed_out"
    FULL = "full"  # refused at once: the pool's queue was full
    LEFT = "left"  # its client went away
    FAILED = "failed"  # an attempt raised (the ledger unreachable)


class AdmissionQueue:
    """The waiting requests of every pool of this process.

    `held(pool, tenant)`: the blocks this process holds for a tenant, the queue's order.
    `release(lease)`: gives back a lease admitted for a waiter that left meanwhile.
    `on_outcome(pool, outcome, waited_s)`: each queued request's end, for the metrics:
    admitted, timed_out, full (refused at once), left (its client went away) or failed.
    """

    def __init__(
        self,
        held: Callable[[str, str], int],
        release: Callable[[Lease], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_outcome: Callable[[str, QueueOutcome, float], None] = lambda _pool, _outcome, _s: None,
    ) -> None:
        self._held = held
        self._release = release
        self._clock = clock
        self._on_outcome = on_outcome
        self._pools: dict[str, _Pool] = {}
        self._seq = itertools.count()

    def queued(self, pool: str) -> int:
        state = self._pools.get(pool)
        return len(state.waiters) if state is not None else 0

    def lengths(self) -> dict[str, int]:
        return {name: len(state.waiters) for name, state in self._pools.items()}

    def notify(self, pool: str | None = None) -> None:
        """Something may have freed blocks in `pool` (every pool when None): run its pump."""
        states = self._pools.values() if pool is None else [self._pools.get(pool)]
        for state in states:
            if state is not None and state.waiters:
                state.wake.set()

    async def wait(
        self,
        pool: str,
        tenant: str,
        attempt: Callable[[], Awaitable[Reservation]],
        max_wait_s: float,
        max_queued: int,
        *,
        promised: bool = False,
    ) -> Reservation | None:
        """Queue until `attempt()` (a reservation without promise terms) admits: its
        reservation; None when `max_wait_s` passed first. Raises QueueFull at once when the
        pool's queue is full, and what `attempt` raises (LedgerUnavailable). A `promised`
        retry, whose blocks the ledger holds for it, goes before every other waiter and is
        never refused for a full queue."""
        state = self._pools.setdefault(pool, _Pool())
        if not promised and len(state.waiters) >= max_queued:
            self._on_outcome(pool, QueueOutcome.FULL, 0.0)
            raise QueueFull(pool)
        waiter = _Waiter(tenant, next(self._seq), attempt, self._clock(), promised)
        state.waiters.append(waiter)
        state.wake.set()
        if state.pump is None or state.pump.done():
            state.pump = asyncio.get_running_loop().create_task(self._pump(pool, state))
        outcome, delivered = QueueOutcome.LEFT, False
        try:
            reservation = await asyncio.wait_for(asyncio.shield(waiter.answer), max_wait_s)
            outcome, delivered = QueueOutcome.ADMITTED, True
            return reservation
        except TimeoutError:
            outcome = QueueOutcome.TIMED_OUT
            return None
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = QueueOutcome.FAILED
            raise
        finally:
            if waiter in state.waiters:
                state.waiters.remove(waiter)
            if not waiter.answer.done():
                waiter.answer.cancel()  # the pump skips it from now on
            elif not delivered and _admitted(waiter.answer):
                # Admitted as it left (its client gone, or its wait over): nobody holds it.
                lease = waiter.answer.result().lease
                if lease is not None:
                    self._release(lease)
            self._on_outcome(pool, outcome, self._clock() - waiter.since)

    async def _pump(self, pool: str, state: _Pool) -> None:
        """Try the waiters in the queue's order each time the pool is woken, until none is
        left."""
        while state.waiters:
            await state.wake.wait()
            state.wake.clear()
            try:
                await self._pass(pool, state)
            except Exception:  # a fault here must not strand the waiters: they time out
                log.exception("the admission queue of pool %s failed a pass", pool)

    async def _pass(self, pool: str, state: _Pool) -> None:
        at_quota: set[str] = set()
        order = sorted(
            state.waiters, key=lambda w: (not w.promised, self._held(pool, w.tenant), w.seq)
        )
        for waiter in order:
            if waiter.answer.done() or (waiter.tenant in at_quota and not waiter.promised):
                continue
            try:
                reservation = await waiter.attempt()
            except Exception as exc:
                if not waiter.answer.done():
                    waiter.answer.set_exception(exc)
                continue
            if reservation.outcome is Outcome.ADMITTED:
                if waiter.answer.done():  # it left during the attempt
                    if reservation.lease is not None:
                        self._release(reservation.lease)
                else:
                    waiter.answer.set_result(reservation)
            else:
                self._wake_at(pool, state, reservation.changes_in_s)
                if waiter.promised:
                    continue  # its blocks are held for it: it takes nothing from the others
                if reservation.outcome is Outcome.TENANT_QUOTA or reservation.holding:
                    # Blocks held for its tenant's own retries count for it alone: another
                    # tenant's waiter is never held back by them.
                    at_quota.add(waiter.tenant)
                else:
                    return  # the pool is full for this one: those after it wait their turn

    def _wake_at(self, pool: str, state: _Pool, seconds: float) -> None:
        """Run the pump again when the ledger says room may appear by itself (a lease or a
        promise ending): a known moment, not a poll."""
        if not math.isfinite(seconds):
            return
        if state.timer is not None:
            state.timer.cancel()
        state.timer = asyncio.get_running_loop().call_later(seconds, self.notify, pool)


def _admitted(answer: asyncio.Future[Reservation]) -> bool:
    return not answer.cancelled() and answer.exception() is None
