"""kvguard's admission rules in simulated time, for trace replay (no gRPC, no tokenizer).

A trace carries token counts, so counting is not simulated: the rest is kvguard's own code.
The tenant's tier comes from `tenancy`; `estimate.clamp` lowers the requested output to the
tier cap (and the room left by max_model_len); `estimate.blocks_needed` turns prompt + output
into blocks; the memory ledger, on the simulation's clock, checks the tenant quota and the
pool watermark and holds the lease until the request ends. kvguard renews the lease of an open
stream, so a lease here lasts as long as its request, however long it queues.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.estimate import blocks_needed, clamp
from kvguard.config.schema import Config
from kvguard.errors import Code, Refusal
from kvguard.ledger import Claim, Lease, Outcome
from kvguard.ledger.memory import MemoryLedger
from kvguard.sim.trace import TraceRequest

_FOREVER_S = 1e15  # leases of open requests are renewed: they never expire in the replay
_REFUSALS = {
    Outcome.TENANT_QUOTA: Code.TENANT_BLOCK_QUOTA_EXCEEDED,
    Outcome.POOL_WATERMARK: Code.KV_CACHE_WATERMARK_EXCEEDED,
}


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
        self.limit = capacity.limit(self.pool.watermark)
        self.ledger = MemoryLedger(clock=clock)
        self._ids = itertools.count()

    def tier_of(self, tenant: str) -> str:
        return self.tenancy.tier_of(tenant) or ""

    async def admit(self, request: TraceRequest) -> Verdict:
        tier_name = self.tenancy.tier_of(request.tenant)
        if tier_name is None:
            return Verdict("", request.output_tokens, refused=Code.UNKNOWN_TENANT.value)
        tier = self.tenancy.tiers[tier_name]
        try:
            limits = clamp(
                "completion",
                {"max_tokens": request.output_tokens},
                tier,
                self.pool.max_model_len,
                request.prompt_tokens,
            )
        except Refusal as refusal:
            return Verdict(tier_name, request.output_tokens, refused=refusal.code.value)
        blocks = blocks_needed(
            [request.prompt_tokens], limits.max_tokens, 1, self.capacity.block_size
        )
        if blocks > tier.max_blocks or blocks > self.limit:
            code = Code.REQUEST_EXCEEDS_CAPACITY.value
            return Verdict(tier_name, limits.max_tokens, limits.clamped, refused=code)
        claim = Claim(
            f"sim-{next(self._ids)}",
            self.pool.name,
            request.tenant,
            blocks,
            self.limit,
            tier.max_blocks,
            _FOREVER_S,
        )
        reservation = await self.ledger.reserve(claim)
        if reservation.outcome is not Outcome.ADMITTED:
            code = _REFUSALS[reservation.outcome].value
            return Verdict(tier_name, limits.max_tokens, limits.clamped, refused=code)
        return Verdict(tier_name, limits.max_tokens, limits.clamped, lease=reservation.lease)

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)

    async def reserved(self) -> int:
        return (await self.ledger.usage(self.pool.name)).reserved
