"""kvguard's admission rules in simulated time, for trace replay (no gRPC, no tokenizer).

A trace carries token counts, so counting is not simulated: the rest is the decision `serve`
makes. The tenant's tier comes from `tenancy`; `admission.decide` sizes the request (the tier
cap and the room left by max_model_len clamp its output; prompt + the output a policy reserves,
the whole limit unless it says less, become blocks) and builds its claim;
`admission.admit.reserve` asks the memory ledger, on the simulation's clock, and turns its answer
into a refusal the way `serve` does. The client sends the trace's `max_tokens` when it has one,
and none otherwise. kvguard renews the lease of an open stream, so a lease here lasts as long as
its request, however long it queues.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvguard.admission import decide
from kvguard.admission.admit import reserve
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.leases import Lease
from kvguard.admission.policy import known
from kvguard.config.schema import Config
from kvguard.errors import Code, Refusal
from kvguard.ledger.memory import MemoryLedger
from kvguard.sim.trace import TraceRequest

_FOREVER_S = 1e15  # leases of open requests are renewed: they never expire in the replay


@dataclass(frozen=True, slots=True)
class Verdict:
    tier: str
    max_tokens: int  # the output limit the engine applies (clamped when guarded)
    clamped: bool = False
    refused: str | None = None  # the refusal code, None when admitted
    lease: Lease | None = None
    would_refuse: str | None = None  # shadow mode: the code it passed with, without a lease


class PolicyGate:
    """Admission as kvguard decides it, for pools[0] of `config` with `capacity`."""

    def __init__(self, config: Config, capacity: PoolCapacity, clock: Callable[[], float]):
        self.tenancy = config.tenancy
        self.shadow = config.shadow
        self.pool = config.pools[0]
        self.capacity = capacity
        self.ledger = MemoryLedger(clock=clock)
        self.held = 0  # blocks the open leases reserve, as the ledger counts them
        self._ids = itertools.count()

    def tier_of(self, tenant: str) -> str:
        return self.tenancy.tier_of(tenant) or ""

    async def admit(self, request: TraceRequest, *, reserve_output: int | None = None) -> Verdict:
        """Decide `request`, a completion of its prompt that sends the trace's `max_tokens`
        (none when it has none: kvguard injects the tier's default). It reserves its prompt and
        `reserve_output` output tokens (None: the whole limit), as `decide.plan` sizes them."""
        sent_limit = request.max_tokens
        unsized = sent_limit if sent_limit is not None else request.output_tokens
        try:
            identity = known(self.tenancy, request.tenant)
        except Refusal as refusal:
            return Verdict("", unsized, refused=refusal.code.value)
        sent = {"max_tokens": sent_limit} if sent_limit is not None else {}
        counted = decide.Counted("completion", sent, [request.prompt_tokens])
        try:
            plan = decide.plan(
                counted, self.pool, identity.tenant, identity.tier, self.capacity, reserve_output
            )
        except Refusal as refusal:
            if decide.passes_in_shadow(self.shadow, refusal.code):
                return self._shadowed(identity.tier_name, request, refusal.code)
            return Verdict(identity.tier_name, unsized, refused=refusal.code.value)
        limits = plan.limits
        try:
            claim = decide.claim(plan, f"sim-{next(self._ids)}", _FOREVER_S)
            lease = await reserve(self.ledger, claim)
        except Refusal as refusal:
            if decide.passes_in_shadow(self.shadow, refusal.code):
                return self._shadowed(identity.tier_name, request, refusal.code)
            code = refusal.code.value
            return Verdict(identity.tier_name, limits.max_tokens, limits.clamped, refused=code)
        self.held += lease.blocks
        return Verdict(identity.tier_name, limits.max_tokens, limits.clamped, lease=lease)

    def _shadowed(self, tier: str, request: TraceRequest, code: Code) -> Verdict:
        """Shadow mode lets a refused request pass as sent, without a lease: vLLM applies the
        client's limit, or the room its context leaves when it sent none."""
        room = self.pool.max_model_len - request.prompt_tokens
        limit = request.max_tokens if request.max_tokens is not None else room
        return Verdict(tier, limit, would_refuse=code.value)

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)
        self.held -= lease.blocks

    async def reserved(self) -> int:
        return (await self.ledger.usage(self.pool.name)).reserved
