"""Ledgers: where reservations of KV-cache blocks live.

A backend is picked from the URL scheme (`kvguard.ledger.url.from_url`). Every backend makes
the same
promise: `reserve` checks the pool limit and the tenant quota and records the lease in one
atomic step, reclaiming expired leases on the way; `release` is idempotent.
"""

from __future__ import annotations

import enum
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
class PoolUsage:
    reserved: int
    leases: int
    tenants: dict[str, int] = field(default_factory=dict)


class LedgerUnavailable(Exception):
    """The ledger cannot be reached; the caller applies `on_unavailable`."""


class Ledger(Protocol):
    async def reserve(self, claim: Claim) -> Reservation: ...

    async def release(self, lease: Lease) -> None:
        """Idempotent: releasing an unknown or already released lease does nothing."""

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend a live lease; False when it is gone (expired and reclaimed, or released)."""

    async def usage(self, pool: str) -> PoolUsage: ...

    async def close(self) -> None: ...
