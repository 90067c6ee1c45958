"""Ledgers: where reservations of KV-cache blocks live.

A backend is picked from the URL scheme (`kvguard.ledger.url.from_url`): `memory://` (one
process, `memory.MemoryLedger`) or `redis://`/`rediss://` (shared by every replica,
`redis_ledger.RedisLedger` wrapped in `resilient.ResilientLedger`). Every backend makes the same
promise: `reserve` checks the pool limit and the tenant quota and records the lease in one
atomic step, reclaiming expired leases on the way; `release` and `reassert` are idempotent.
All amounts are KV-cache blocks of the pool's block size. A lease's counted blocks may grow
after it was admitted (a running request's reservation raised as it decodes): `reassert` with
more blocks than the ledger counts raises them, without any check, and never lowers them;
`release` gives back what the ledger counts, grown or not.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Claim:
    """What one request asks for. All amounts are KV blocks of the pool's block size."""

    lease_id: str
    pool: str
    tenant: str
    blocks: int
    pool_limit: int  # most blocks the pool may hold reserved: capacity minus the watermark
    tenant_quota: int  # most blocks this tenant may hold reserved in this pool
    lease_seconds: float

    def lease(self) -> Lease:
        """The lease this claim takes when admitted."""
        return Lease(self.lease_id, self.pool, self.tenant, self.blocks)


class Outcome(enum.Enum):
    ADMITTED = "admitted"
    TENANT_QUOTA = "tenant_quota"
    POOL_WATERMARK = "pool_watermark"


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    pool: str
    tenant: str
    blocks: int


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: Outcome
    pool_reserved: int  # blocks reserved in the pool after this step
    tenant_reserved: int  # blocks reserved by the tenant after this step
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """An open lease as the ledger holds it (for operators)."""

    lease: Lease
    expires_in_s: float  # seconds until it expires unless renewed


@dataclass(frozen=True, slots=True)
class PoolUsage:
    reserved: int
    leases: int
    tenants: dict[str, int] = field(default_factory=dict)


class LedgerUnavailable(Exception):
    """The ledger cannot be reached; the caller applies `on_unavailable`."""


class Ledger(Protocol):
    async def reserve(self, claim: Claim) -> Reservation:
        """Admit `claim` (record its lease, expiring after `claim.lease_seconds` unless renewed)
        or refuse it, in one atomic step that first refuses an impossible claim and reclaims
        expired leases. Raises LedgerUnavailable when the ledger cannot be reached."""

    async def release(self, lease: Lease) -> None:
        """Give back the blocks the ledger counts for the lease (grown ones included).
        Idempotent: releasing an unknown or already released lease does nothing."""

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend a live lease, its counted blocks unchanged; False when it is gone (expired
        and reclaimed, or released)."""

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """Hold each lease for `lease_seconds` more: renew it, or record it again with
        `lease.blocks` and without any check when the ledger lost it (its request is running,
        so the ledger must count it).

        A held lease whose `lease.blocks` is more than the blocks counted for it grows to
        `lease.blocks`: the pool's and the tenant's reserved blocks rise by the difference,
        always granted (no limit or quota check; it may take the pool past its limit, and new
        reservations are then refused until leases end). Counted blocks never shrink: a
        smaller (stale) copy only renews. Idempotent. Returns how many leases were recorded
        again (a lease that grew was held, so it does not count)."""

    async def usage(self, pool: str) -> PoolUsage:
        """Blocks and leases held in `pool` (expired leases reclaimed first), per tenant."""

    async def leases(self, pool: str) -> list[LeaseInfo]:
        """The pool's open leases (expired ones reclaimed first), for operators."""

    async def close(self) -> None: ...
