"""kvguard's admission rules in simulated time, for trace replay (no gRPC, no tokenizer).

A trace carries token counts, so counting is not simulated: the rest is the decision `serve`
makes. The tenant's tier comes from `tenancy`; `admission.decide` sizes the request (the tier
cap and the room left by max_model_len clamp its output; prompt + output become blocks) and
builds its claim; `admission.admit.reserve` asks the memory ledger, on the simulation's clock,
and turns its answer into a refusal the way `serve` does. kvguard renews the lease of an open
stream, so a lease here lasts as long as its request, however long it queues.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvguard.admission import decide
from kvguard.admission.admit import reserve
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.leases import Lease
from kvguard.admission.policy import identify
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


class PolicyGate:
    """Admission as kvguard decides it, for pools[0] of `config` with `capacity`."""

    def __init__(self, config: Config, capacity: PoolCapacity, clock: Callable[[], float]):
        self.tenancy = config.tenancy
        self.pool = config.pools[0]
        self.capacity = capacity
        self.ledger = MemoryLedger(clock=clock)
        self._ids = itertools.count()

    def tier_of(self, tenant: str) -> str:
        return self.tenancy.tier_of(tenant) or ""

    async def admit(self, request: TraceRequest, *, sends_max_tokens: bool = True) -> Verdict:
        """Decide `request`, a completion of its prompt that sends its trace output as
        max_tokens (without it, when `sends_max_tokens` is False: kvguard injects the tier's
        default)."""
        identity = identify(self.tenancy, request.tenant)
        if identity is None:
            return Verdict("", request.output_tokens, refused=Code.UNKNOWN_TENANT.value)
        sent = {"max_tokens": request.output_tokens} if sends_max_tokens else {}
        counted = decide.Counted("completion", sent, [request.prompt_tokens])
        try:
            plan = decide.plan(counted, self.pool, identity.tenant, identity.tier, self.capacity)
        except Refusal as refusal:
            return Verdict(identity.tier_name, request.output_tokens, refused=refusal.code.value)
        limits = plan.limits
        try:
            claim = decide.claim(plan, f"sim-{next(self._ids)}", _FOREVER_S)
            lease = await reserve(self.ledger, claim)
        except Refusal as refusal:
            code = refusal.code.value
            return Verdict(identity.tier_name, limits.max_tokens, limits.clamped, refused=code)
        return Verdict(identity.tier_name, limits.max_tokens, limits.clamped, lease=lease)

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)

    async def reserved(self) -> int:
        return (await self.ledger.usage(self.pool.name)).reserved
