"""`kvguard ledger status`: what a Redis ledger holds, per pool and tenant, read from Redis.

Reads go through the same `usage` script that admission uses (expired leases are reclaimed
first), so the figures are what the next admission would see. Amounts are KV-cache blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.admission.capacity import pool_limit
from kvguard.config.redact import redact
from kvguard.ledger.redis_ledger import RedisLedger


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    capacity: int | None  # usable blocks; None when discovered at run time
    watermark: float


@dataclass(frozen=True, slots=True)
class PoolStatus:
    spec: PoolSpec
    reserved: int
    leases: int
    tenants: dict[str, int] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)  # blocks reserved on each pod

    @property
    def limit(self) -> int | None:
        """Most blocks the pool may hold reserved (capacity minus the watermark)."""
        if self.spec.capacity is None:
            return None
        return pool_limit(self.spec.capacity, self.spec.watermark)

    @property
    def free(self) -> int | None:
        return None if self.spec.capacity is None else self.spec.capacity - self.reserved


async def read_status(url: str, cluster: bool, pools: list[PoolSpec]) -> list[PoolStatus]:
    """One `usage` call per pool; raises LedgerUnavailable when Redis cannot be reached."""
    # An operator's read can wait longer than an admission may.
    ledger = RedisLedger.from_url(url, cluster=cluster, timeout_s=2.0)
    try:
        out = []
        for spec in pools:
            usage = await ledger.usage(spec.name)
            out.append(
                PoolStatus(
                    spec, usage.reserved, usage.leases, dict(usage.tenants), dict(usage.pods)
                )
            )
        return out
    finally:
        await ledger.close()


def render(url: str, cluster: bool, statuses: list[PoolStatus]) -> str:
    """A table per pool, then each tenant's reserved blocks (largest first), then each pod's
    (by address), where the pool counts pods."""

    def show(value: int | None) -> str:
        return "?" if value is None else str(value)

    lines = [f"ledger {redact(url)}{' (Redis Cluster)' if cluster else ''}"]
    rows = [("pool", "capacity", "limit", "reserved", "free", "leases")]
    for s in statuses:
        rows.append(
            (
                s.spec.name,
                show(s.spec.capacity),
                show(s.limit),
                str(s.reserved),
                show(s.free),
                str(s.leases),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    for s in statuses:
        if s.spec.capacity is None:
            lines.append(f"pool {s.spec.name}: capacity discovered at run time (not known here)")
        if not s.tenants:
            lines.append(f"pool {s.spec.name}: no tenant holds blocks")
            continue
        lines.append(f"pool {s.spec.name}, reserved blocks per tenant:")
        width = max(len(t) for t in s.tenants)
        for tenant, blocks in sorted(s.tenants.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {tenant.ljust(width)}  {blocks}")
    for s in statuses:
        if s.pods:
            lines.append(f"pool {s.spec.name}, reserved blocks per pod:")
            width = max(len(p) for p in s.pods)
            for pod, blocks in sorted(s.pods.items()):
                lines.append(f"  {pod.ljust(width)}  {blocks}")
    return "\n".join(lines)
