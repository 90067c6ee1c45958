"""The gateway pods, counted in DNS: a source of the replica count that `on_unavailable: local`
divides the pool by (kvguard.ledger.replicas).

`ledger.replica_service` names a headless Service of the gateway pods: DNS answers with the
addresses of its ready pods, each running `server.workers` kvguard processes. This pod counts
too before it is ready: it is added when its own address (its hostname's, which Kubernetes
writes in the pod's /etc/hosts) is not in the answer, and counted as one more pod when its
address cannot be told.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from kvguard.ops.dns import Resolver, resolve

log = logging.getLogger(__name__)

# Seconds between two lookups: a pod that starts shrinks every share within this much.
REFRESH_S = 5.0


async def own_addresses(resolver: Resolver = resolve) -> set[str]:
    """This pod's addresses, as its hostname resolves; empty when it does not."""
    try:
        return set(await resolver(socket.gethostname(), 0))
    except OSError:
        return set()


async def count(
    host: str, workers: int, resolver: Resolver = resolve, own: set[str] | None = None
) -> int | None:
    """The kvguard processes of the pods behind `host`, this one included (`own`: its
    addresses); 0 when DNS gives no address (which tells nothing), None when it cannot answer."""
    try:
        addresses = set(await resolver(host, 0))
    except OSError as exc:
        log.warning("replica count: %s cannot be resolved (%s); the last count holds", host, exc)
        return None
    if not addresses:
        return 0
    pods = len(addresses | own) if own else len(addresses) + 1
    return pods * workers


async def watch(
    host: str,
    workers: int,
    on_count: Callable[[int], None],
    *,
    resolver: Resolver = resolve,
    interval_s: float | None = None,
) -> None:
    """Resolve `host` every `interval_s` (REFRESH_S by default) and report each count DNS
    gives; say so once whenever the answer turns empty."""
    empty = False
    while True:
        processes = await count(host, workers, resolver, await own_addresses(resolver))
        if processes == 0 and not empty:
            log.warning(
                "replica count: %s has no address (a misspelt name, or no gateway pod ready "
                "yet): the last count it gave, if any, stands",
                host,
            )
        if processes is not None:
            empty = processes == 0
            on_count(processes)
        await asyncio.sleep(REFRESH_S if interval_s is None else interval_s)
