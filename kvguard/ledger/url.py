"""Pick a ledger backend from its URL scheme, with a plain mapping."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvguard.ledger import Lease, Ledger
from kvguard.ledger.memory import MemoryLedger
from kvguard.ledger.replicas import ReplicaCount


def from_url(
    url: str,
    clock: Callable[[], float] | None = None,
    *,
    cluster: bool = False,
    on_unavailable: str = "reject",
    replicas: ReplicaCount | int = 1,
    lease_seconds: float = 900,
    on_reachability: Callable[[bool], None] | None = None,
    open_leases: Callable[[], Iterable[Lease]] | None = None,
    on_error: Callable[[], None] | None = None,
    on_freed: Callable[[str], None] | None = None,
) -> Ledger:
    """The ledger for `url`; the scheme picks the backend.

    `memory://`: the embedded ledger on `clock` (seconds; monotonic by default). `redis://` and
    `rediss://`: the shared ledger (`cluster`: the URL names a Redis Cluster seed node), wrapped
    in a ResilientLedger that applies `on_unavailable` with `replicas` (a fixed count, or one
    counted at runtime) while Redis cannot be reached, reports reachability to
    `on_reachability`, counts errors through `on_error`, re-asserts
    `open_leases()` for `lease_seconds` when Redis comes back, and calls `on_freed(pool)` when
    any replica frees blocks of a subscribed pool. The memory ledger needs none of these.
    """

    def redis() -> Ledger:
        # Imported here: a memory-only deployment never loads the Redis client.
        from kvguard.ledger.redis_ledger import connect
        from kvguard.ledger.resilient import ResilientLedger

        return ResilientLedger(
            connect(url, cluster=cluster),
            on_unavailable=on_unavailable,
            replicas=replicas,
            lease_seconds=lease_seconds,
            on_reachability=on_reachability,
            open_leases=open_leases,
            on_error=on_error,
            on_freed=on_freed,
        )

    backends: dict[str, Callable[[], Ledger]] = {
        "memory": lambda: MemoryLedger(clock=clock),
        "redis": redis,
        "rediss": redis,
    }
    scheme = url.split("://", 1)[0]
    if scheme not in backends:
        raise ValueError(f"ledger url {url!r}: no backend for scheme {scheme!r}")
    return backends[scheme]()
