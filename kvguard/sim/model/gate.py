"""kvguard's admission rules in simulated time, for trace replay (no gRPC, no tokenizer).

A trace carries token counts, so counting is not simulated: the rest is the decision `serve`
makes. The tenant's tier comes from `tenancy`; `admission.decide` sizes the request (the tier
cap and the room left by max_model_len clamp its output; prompt + the output a policy reserves,
the whole limit unless it says less, become blocks) and builds its claim; the memory ledger
answers it, on the simulation's clock, and `decide.refusal` turns the answer into a refusal the
way `serve` does. The client sends the trace's `max_tokens` when it has one,
and none otherwise. kvguard renews the lease of an open stream, so a lease here lasts as long as
its request, however long it queues.

Each `refresh_seconds` of simulated time the gate reads the engine as discovery reads vLLM's
/metrics, and gives the reading to the same engine feedback (`admission.engine`: the blocks in
use and the ledger's, new preemptions, the intervals between tokens). In every mode its decode
rate is read: a claim's lease is expected to end when its limit is produced at that rate, and
the LeaseKeeper moves its expected end as the rate does, which is what a refusal's time is told
from. In calibrated mode the gate also learns as `serve` does: the same reading gives the
output lengths of the requests that finished, in vLLM's histogram buckets, its trust and its
unaccounted blocks size the claims, the `server.response_sample` share of requests teaches
their tier and tenant what they produced, and the LeaseKeeper grows each lease every second as
its request decodes.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvguard.admission import decide, sequence
from kvguard.admission.calibration import Calibration, Estimate
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.engine import EngineFeedback
from kvguard.admission.leases import GROW_INTERVAL_S, Lease, LeaseKeeper
from kvguard.admission.outputs import Histogram, Observed, OutputLengths, Sampler
from kvguard.admission.policy import known
from kvguard.admission.record import ReservedFrom
from kvguard.admission.sequence import Asked, DecisionSequence, Wait
from kvguard.config.schema import Config
from kvguard.errors import Code, Refusal
from kvguard.ledger import Claim, Reservation
from kvguard.ledger.memory import MemoryLedger
from kvguard.sim.model.trace import TraceRequest

_FOREVER_S = 1e15  # leases of open requests are renewed: they never expire in the replay


def generation_bounds(max_model_len: int) -> tuple[float, ...]:
    """vLLM's bucket bounds for vllm:request_generation_tokens: 1, 2, 5, 10, 20, 50, ... up to
    max_model_len."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True, slots=True)
class Verdict:
    tier: str
    max_tokens: int  # the output limit the engine applies (clamped when guarded)
    clamped: bool = False
    refused: str | None = None  # the refusal code, None when admitted
    lease: Lease | None = None
    would_refuse: str | None = None  # shadow mode: the code it passed with, without a lease
    observed: bool = False  # its response is read (the sampled share): its stream is seen
    # A 429's answer: the seconds until its promised retry (None: none promised), and whether
    # retrying helps at all.
    retry_after_s: float | None = None
    should_retry: bool = True
    wait_s: float = 0.0  # a promised retry may wait this long for its held blocks


class PolicyGate:
    """Admission as kvguard decides it, for pools[0] of `config` with `capacity`."""

    def __init__(
        self,
        config: Config,
        capacity: PoolCapacity,
        clock: Callable[[], float],
        *,
        calibrated: bool = False,
        seed: int = 0,
    ):
        self.tenancy = config.tenancy
        self.shadow = config.shadow
        self.pool = config.pools[0]
        if calibrated:  # the policy's mode for the pool; a tier's own mode still applies
            reservation = self.pool.reservation.model_copy(update={"mode": "calibrated"})
            self.pool = self.pool.model_copy(update={"reservation": reservation})
        self.capacity = capacity
        self.ledger = MemoryLedger(clock=clock)
        self.held = 0  # blocks the open leases reserve, as the ledger counts them
        self._clock = clock
        self.calibration = None
        if calibrated:
            outputs = OutputLengths(self.pool.reservation.window_seconds)
            self.calibration = Calibration(outputs)
        # What the engine's readings teach: the calibration's, else the gate's own (for the
        # decode rate; its trust and unaccounted blocks are read only in calibrated mode).
        self.feedback = self.calibration.engine if self.calibration else EngineFeedback()
        self._counted: dict[str, int] = {}  # lease id -> blocks the ledger counts (grown)
        ids = itertools.count()
        # Claims as serve builds them; promises with seeded jitter.
        self.decisions = DecisionSequence(
            _FOREVER_S,
            self.calibration,
            decode_rate=self.feedback.decode_rate,
            rng=random.Random(seed),
            lease_ids=lambda: f"sim-{next(ids)}",
        )
        self._queued: dict[str, float] = {}  # uid -> when its wait in the pool's queue ends
        # Block-seconds that blocks held for other tenants' retries (or any not counted by the
        # ledger's answer) kept a request that fits beside the leases refused, until it was
        # decided again (the invariant of tenant isolation: always 0); its refusals pending.
        self.fitting_refused_block_s = 0.0
        self._fitting_refused: dict[str, tuple[float, int]] = {}
        self._sampler = Sampler(config.server.response_sample)
        self.keeper = LeaseKeeper(
            self.ledger,
            _FOREVER_S,
            clock=clock,
            decode_rate=self.feedback.decode_rate,
            trust=lambda _pool: self.trust,
        )
        self._bounds = generation_bounds(self.pool.max_model_len)
        self._finished: list[int] = [0] * (len(self._bounds) + 1)  # per bucket, +Inf last
        self._finished_sum = 0
        self._scraped: Histogram | None = None
        self._steps = self._busy_s = 0.0
        self._next_scrape = self.pool.capacity.refresh_seconds
        self._next_grow = GROW_INTERVAL_S

    def tier_of(self, tenant: str) -> str:
        return self.tenancy.tier_of(tenant) or ""

    async def admit(
        self,
        request: TraceRequest,
        uid: str,
        *,
        reserve_output: int | None = None,
        final: bool = False,
    ) -> Verdict:
        """Decide `request` (`uid`: its request id, the same for its retries), a completion of
        its prompt that sends the trace's `max_tokens` (none when it has none: kvguard injects
        the tier's default). It reserves its prompt and `reserve_output` output tokens (an
        oracle's; None: the calibrated estimate in calibrated mode, else the whole limit), as
        `decide.plan` sizes them. A promised retry whose held blocks are not all free yet, and
        in a pool with a queue a request refused for the quota or the watermark, gets a verdict
        with `wait_s`: it is decided again as blocks free (promised nothing while it is
        queued), and with `final` once its wait is over, as serve's is."""
        sent_limit = request.max_tokens
        unsized = sent_limit if sent_limit is not None else request.output_tokens
        try:
            identity = known(self.tenancy, request.tenant)
        except Refusal as refusal:
            return Verdict("", unsized, refused=refusal.code.value)
        sent = {"max_tokens": sent_limit} if sent_limit is not None else {}
        counted = decide.Counted("completion", sent, [request.prompt_tokens])
        now = self._clock()
        self._decided_again(uid, now)
        asked = Asked(self.pool, identity, counted, self.capacity, now, self.shadow, uid.encode())
        oracle = None
        if reserve_output is not None:
            oracle = Estimate(reserve_output, ReservedFrom.ORACLE)
        try:
            plan = self.decisions.plan(asked, oracle)
        except Refusal as refusal:
            if decide.passes_in_shadow(self.shadow, refusal.code):
                return self._shadowed(identity.tier_name, request, refusal.code)
            return Verdict(identity.tier_name, unsized, refused=refusal.code.value)
        limits = plan.limits
        reservation = None
        try:
            claim = self.decisions.claim(asked, plan)
            queued_until = self._queued.pop(uid, None) if final else self._queued.get(uid)
            queue_s = 0.0 if final else sequence.queue_seconds(claim, self.pool, self.shadow)
            if final and queued_until is None:  # a promise's wait ended: told when
                claim = sequence.told(claim)
            # Its last try, after a wait, has the claim's terms.
            reservation = await self.ledger.reserve(sequence.first_ask(claim, queue_s))
            refused = decide.refusal(reservation, claim)
            if refused is not None:
                await self._refused(uid, claim, reservation, now)
                if sequence.wait_after(reservation, queue_s > 0) is Wait.QUEUE:
                    # Into the queue (or still in it) until its wait ends.
                    until = self._queued.setdefault(uid, now + queue_s)
                    return Verdict(identity.tier_name, limits.max_tokens, limits.clamped,
                                   refused=refused.code.value, wait_s=until - now)  # fmt: skip
                raise refused
            lease = reservation.lease
            assert lease is not None
        except Refusal as refusal:
            if decide.passes_in_shadow(self.shadow, refusal.code):
                return self._shadowed(identity.tier_name, request, refusal.code)
            # Back at its promise's time, its held blocks not all free yet: it waits, as serve
            # does (`wait_s`), else it is answered.
            waiting_s = 0.0
            if reservation is not None and sequence.wait_after(reservation, False) is Wait.PROMISE:
                waiting_s = reservation.waiting_s
            return Verdict(
                identity.tier_name,
                limits.max_tokens,
                limits.clamped,
                refused=refusal.code.value,
                retry_after_s=refusal.retry_after_s,
                should_retry=refusal.should_retry is not False,
                wait_s=waiting_s,
            )
        self.held += lease.blocks
        self._counted[lease.lease_id] = lease.blocks
        observed = False
        if self.calibration is not None:
            observed = self._sampler.pick(uid)
        growth = sequence.growth(asked, plan)
        self.keeper.hold(lease, growth)
        return Verdict(
            identity.tier_name, limits.max_tokens, limits.clamped, lease=lease, observed=observed
        )

    async def _refused(self, uid: str, claim: Claim, reservation: Reservation, now: float) -> None:
        """Note a refusal of a claim that fits beside the leases and its own tenant's held
        retries, the blocks held for others then against it (`fitting_refused_block_s`)."""
        own = reservation.holding
        tenant = self.keeper.held_blocks(claim.pool, claim.tenant)
        fits = (
            tenant + own + claim.blocks <= claim.tenant_quota
            and self.held + own + claim.blocks <= claim.pool_limit
        )
        if fits:
            held = (await self.ledger.usage(claim.pool)).holding - own
            self._fitting_refused[uid] = (now, max(0, held))

    def _decided_again(self, uid: str, now: float) -> None:
        refused = self._fitting_refused.pop(uid, None)
        if refused is not None:
            self.fitting_refused_block_s += refused[1] * (now - refused[0])

    def ended(self, now: float) -> None:
        """The run ended: refusals never decided again count until `now`."""
        for uid in list(self._fitting_refused):
            self._decided_again(uid, now)

    def _shadowed(self, tier: str, request: TraceRequest, code: Code) -> Verdict:
        """Shadow mode lets a refused request pass as sent, without a lease: vLLM applies the
        client's limit, or the room its context leaves when it sent none."""
        room = self.pool.max_model_len - request.prompt_tokens
        limit = request.max_tokens if request.max_tokens is not None else room
        return Verdict(tier, limit, would_refuse=code.value)

    async def release(self, lease: Lease) -> None:
        self.keeper.forget(lease.lease_id)  # the gate releases it, at once
        await self.ledger.release(lease)
        self.held -= self._counted.pop(lease.lease_id, lease.blocks)

    def finished(self, verdict: Verdict, output_tokens: int) -> None:
        """A request ended having produced `output_tokens`: vLLM counts it in its histogram,
        and kvguard learns it per tier and tenant when it read the response."""
        if self.calibration is None:
            return
        self._finished[bisect.bisect_left(self._bounds, output_tokens)] += 1
        self._finished_sum += output_tokens
        if verdict.observed and verdict.lease is not None:
            self.calibration.observe(
                self.pool, verdict.tier, verdict.lease.tenant, output_tokens, self._clock()
            )

    def stepped(self, seconds: float) -> None:
        """An engine step of `seconds` ended: each running sequence decoded one token."""
        self._steps += 1
        self._busy_s += seconds

    async def tick(
        self,
        now: float,
        preemptions_total: int,
        engine_used: int,
        progress: Callable[[], Iterable[tuple[Verdict, int]]],
    ) -> None:
        """Discovery's scrape every refresh_seconds and the keeper's growth every second;
        `progress` gives the open requests with the output tokens each has so far (what the
        streams of the observed ones show)."""
        if now >= self._next_scrape:
            self._next_scrape = now + self.pool.capacity.refresh_seconds
            self._scrape(now, preemptions_total, engine_used)
        if now >= self._next_grow:
            self._next_grow = now + GROW_INTERVAL_S
            for verdict, tokens in progress():
                if verdict.observed and verdict.lease is not None:
                    self.keeper.seen(verdict.lease.lease_id, tokens)
            for lease in await self.keeper.grow_all():
                self.held += lease.blocks - self._counted[lease.lease_id]
                self._counted[lease.lease_id] = lease.blocks

    def _scrape(self, now: float, preemptions_total: int, engine_used: int) -> None:
        """One reading of the engine, as discovery's of vLLM: to the engine feedback (the steps
        since the last, each an interval between tokens, as vLLM's inter-token latency counts
        them), and in calibrated mode the output lengths of the requests that finished."""
        pool = self.pool.name
        self.feedback.reserved(pool, self.held)
        self.feedback.read(
            pool,
            now,
            capacity_blocks=self.capacity.blocks,
            used=engine_used,
            preempted=preemptions_total - (self.feedback.preemptions(pool) or 0),
            intervals=self._steps,
            interval_s=self._busy_s,
        )
        self._steps = self._busy_s = 0.0
        if self.calibration is None:
            return
        cumulative = tuple(float(c) for c in itertools.accumulate(self._finished[:-1]))
        total = float(sum(self._finished))
        histogram = Histogram(self._bounds, cumulative, total, float(self._finished_sum))
        new = Observed(now, histogram.since(self._scraped))
        self.calibration.outputs.add(pool, new)
        self._scraped = histogram

    @property
    def trust(self) -> float:
        return self.calibration.engine.trust(self.pool.name) if self.calibration else 1.0

    async def reserved(self) -> int:
        return (await self.ledger.usage(self.pool.name)).reserved
