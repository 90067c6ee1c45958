"""The shared ledger: Redis (or Redis Cluster), one Lua script call per operation.

Every operation is one EVALSHA of a script in kvguard/ledger/lua/ (scripts.py loads them and
names their keys; one round trip; EVAL, which
also caches the script, only after a NOSCRIPT answer, e.g. from a Redis that restarted). All keys
of a pool carry the hash tag `{pool}`, so each script touches one Redis Cluster slot. Expiry uses
Redis `TIME` inside the scripts: one clock for every replica.

Errors that mean "Redis cannot be reached" (refused or broken connections, timeouts, a cluster
that is down, a connection pool that stays exhausted) raise `LedgerUnavailable`, quickly: the
sockets time out after `SOCKET_TIMEOUT_S` and a free connection is awaited for `POOL_WAIT_S` at
most. Deciding what to do then is `ResilientLedger`'s job.

Every script that frees blocks (a release, or a reclaim of expired leases and promises) publishes
them on the pool's sharded pub/sub channel `kvguard:{pool}:freed` (SPUBLISH, Redis 7: the
channel lives in the pool's slot); `subscribe(pools)` listens to them (kvguard/ledger/freed.py),
so that a release by any replica wakes this one's waiters.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvguard.ledger import (
    Claim,
    Lease,
    LeaseInfo,
    LedgerUnavailable,
    PoolUsage,
    Reservation,
    Terms,
)
from kvguard.ledger.freed import FreedSubscription
from kvguard.ledger.scripts import (
    REPLICAS_KEY,
    SCRIPT_NAMES,
    LeasesAnswer,
    ReassertAnswer,
    ReserveAnswer,
    UsageAnswer,
    all_keys,
    load_script,
    pool_keys,
    text,
)

log = logging.getLogger(__name__)

# Fast failure: a healthy Redis on the same network answers in well under a millisecond, so a
# quarter of a second without an answer means it is gone (or drowning), and the request should
# get `on_unavailable` now rather than wait.
SOCKET_TIMEOUT_S = 0.25
CONNECT_TIMEOUT_S = 0.25
# Connections per process (per node for a cluster): concurrency is bounded, and a burst beyond
# it waits this long for a free connection before it counts as "unavailable".
MAX_CONNECTIONS = 64
POOL_WAIT_S = 0.25
# Leases per reassert or release script call: long argument lists would make one call block
# Redis (and every replica with it).
LEASES_PER_CALL = 500

# One immediate retry, on a connection error only: a Redis that restarted leaves every pooled
# connection broken, and the first use of each fails at once. Every script is idempotent (a
# reserve retried with the same lease id is not counted twice), so a retry is always safe.
# Timeouts are not retried: they already took SOCKET_TIMEOUT_S.
_RETRY_ERRORS: tuple[type[rexc.RedisError], ...] = (rexc.ConnectionError,)

UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,  # includes BusyLoadingError, MaxConnectionsError, pool exhaustion
    rexc.TimeoutError,
    rexc.ClusterDownError,  # includes MasterDownError
    rexc.TryAgainError,
    rexc.ReadOnlyError,  # a failover turned the node into a replica
    rexc.RedisClusterException,  # no node reachable, slot not covered
    OSError,
    TimeoutError,
)

T = TypeVar("T")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


# The latest expected end sent, in seconds from now: 15 digits of ms in lib.lua's indexes.
_MAX_ENDS_S = 1e9


def _ends_arg(ends_in_s: float | None) -> Any:
    """An expected end as the scripts take it: ms from now, or '' for none."""
    if ends_in_s is None:
        return ""
    return round(min(max(ends_in_s, 0.0), _MAX_ENDS_S) * 1000)


def _terms_args(terms: Terms | None) -> tuple[Any, ...]:
    """reserve.lua's ARGV[9..11]: max wait, jitter and grace in ms; '' without terms."""
    if terms is None:
        return ("", "", "")
    return (
        round(terms.max_wait_s * 1000),
        round(terms.jitter_s * 1000),
        round(terms.grace_s * 1000),
    )


def connect(url: str, *, cluster: bool = False, timeout_s: float | None = None) -> Any:
    """A redis-py asyncio client for `url` (redis:// or rediss://) with kvguard's fast-failure
    settings; `cluster`: the URL names a seed node of a Redis Cluster. `timeout_s` replaces the
    socket, connect and pool-wait timeouts (tools and tests that value patience over speed)."""
    retry = Retry(NoBackoff(), 1, supported_errors=_RETRY_ERRORS)
    settings: dict[str, Any] = {
        "socket_timeout": timeout_s or SOCKET_TIMEOUT_S,
        "socket_connect_timeout": timeout_s or CONNECT_TIMEOUT_S,
        "retry": retry,
    }
    if cluster:
        # Per node; redis-py's cluster client has no blocking pool: past the bound it fails at
        # once with MaxConnectionsError, which counts as unavailable.
        return RedisCluster.from_url(url, max_connections=MAX_CONNECTIONS, **settings)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=timeout_s or POOL_WAIT_S, **settings
    )
    return aioredis.Redis.from_pool(pool)


@dataclass
class _QueuedReleases:
    """Releases of one pool waiting for the release call in flight, to go in the next one."""

    lease_ids: list[str]
    sent: asyncio.Future[None]  # resolved when the call carrying them returns (or fails)


class RedisLedger:
    """A Ledger on Redis or Redis Cluster, shared by every kvguard process of a deployment.

    Its callbacks are given at construction (ResilientLedger gives its own) and never change.
    `on_reset(pool)` is called when a pool's epoch changes under this process (Redis restarted
    empty, or was flushed): the process must then re-assert its open leases of that pool.
    `on_release_lost(lease, exc)` is called when the release of a cancelled reserve (which
    nobody awaits) could not reach Redis: the process must replay it later.
    `on_freed(pool)` is called for each release (or reclaim) that freed blocks of a pool given
    to `subscribe`, whichever process made it, and for each such pool once its subscription is
    back after it broke (what was published meanwhile is lost: the caller checks again).

    Releases are coalesced per pool: a release goes out at once when none of that pool is in
    flight, and otherwise joins the next call, which carries every release that queued up
    meanwhile. No release waits for more than one round trip, and under load one command
    carries many (redis-py's CPU cost is per command, whatever the command carries).
    """

    def __init__(
        self,
        client: Any,
        *,
        on_reset: Callable[[str], None] | None = None,
        on_release_lost: Callable[[Lease, LedgerUnavailable], None] | None = None,
        on_freed: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        # redis-py's asyncio cluster client breaks when concurrent commands find it
        # uninitialised (each starts its own discovery and they close each other's
        # connections): discover once, under a lock, before any command, and again after an
        # error (which makes redis-py rediscover).
        self._cluster = isinstance(client, RedisCluster)
        self._needs_discovery = self._cluster
        self._discovery = asyncio.Lock()
        self._scripts = {name: load_script(name) for name in SCRIPT_NAMES}
        self._epochs: dict[str, str] = {}
        self._on_reset = on_reset
        self._on_release_lost = on_release_lost
        self._subscription = FreedSubscription(
            client,
            discover=self._discover,
            rediscover=self._forget_slots,
            backoff_s=CONNECT_TIMEOUT_S,
            on_freed=on_freed,
        )
        self._queued_releases: dict[str, _QueuedReleases] = {}
        self._releasing: dict[str, asyncio.Task[None]] = {}  # per pool, while calls are due

    @classmethod
    def from_url(
        cls, url: str, *, cluster: bool = False, timeout_s: float | None = None
    ) -> RedisLedger:
        return cls(connect(url, cluster=cluster, timeout_s=timeout_s))

    async def _discover(self) -> None:
        """Learn a cluster's slots, once for every command waiting on it."""
        if self._needs_discovery:
            async with self._discovery:
                if self._needs_discovery:
                    await self._client.initialize()
                    self._needs_discovery = False

    def _forget_slots(self) -> None:
        """Make the next command learn a cluster's slots again (they may have moved)."""
        self._needs_discovery = self._cluster

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        try:
            await self._discover()
            return await op()
        except UNAVAILABLE_ERRORS as exc:
            self._needs_discovery = self._cluster
            raise LedgerUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        script = self._scripts[name]

        async def op() -> Any:
            try:
                return await self._client.evalsha(script.sha, len(keys), *keys, *args)
            except rexc.NoScriptError:
                # Redis restarted or flushed its script cache: EVAL runs and caches it again.
                return await self._client.eval(script.source, len(keys), *keys, *args)

        return await self._call(op)

    async def start(self) -> None:
        """Register every script on every node (SCRIPT LOAD); raise LedgerUnavailable."""
        for script in self._scripts.values():
            await self._call(partial(self._client.script_load, script.source))

    def _saw_epoch(self, pool: str, epoch: Any) -> None:
        value = text(epoch)
        if not value:
            return
        before = self._epochs.get(pool)
        self._epochs[pool] = value
        if before is not None and before != value and self._on_reset is not None:
            self._on_reset(pool)

    async def reserve(self, claim: Claim) -> Reservation:
        try:
            answer = await self._run(
                "reserve",
                all_keys(claim.pool),
                (
                    claim.lease_id,
                    claim.tenant,
                    claim.blocks,
                    claim.pool_limit,
                    claim.tenant_quota,
                    _ms(claim.lease_seconds),
                    claim.retry_key,
                    _ends_arg(claim.ends_in_s),
                    *_terms_args(claim.terms),
                    *(arg for pod in claim.pods for arg in (pod.address, pod.limit)),
                ),
            )
        except asyncio.CancelledError:
            # The caller is gone (its stream ended), but the script may have run: release the
            # lease id, unawaited, or nobody would. An unknown lease id is a no-op (release.lua).
            sent = self._queue_release(claim.pool, claim.lease_id)
            sent.add_done_callback(partial(self._unawaited_release_sent, claim.lease()))
            raise
        reserved = ReserveAnswer.from_script(answer)
        self._saw_epoch(claim.pool, reserved.epoch)
        return reserved.reservation(claim)

    async def release(self, lease: Lease) -> None:
        """Returns once a release call carrying this lease has returned; raises
        LedgerUnavailable if that call could not reach Redis."""
        await asyncio.shield(self._queue_release(lease.pool, lease.lease_id))

    def _queue_release(self, pool: str, lease_id: str) -> asyncio.Future[None]:
        """Queue a release for the next call of `pool` (starting the calls if none is due);
        returns the future that the call carrying it resolves."""
        queued = self._queued_releases.get(pool)
        if queued is None:
            loop = asyncio.get_running_loop()
            sent = loop.create_future()
            sent.add_done_callback(_retrieve)  # no warning when every waiter is gone
            queued = self._queued_releases[pool] = _QueuedReleases([], sent)
            if pool not in self._releasing:
                self._releasing[pool] = loop.create_task(self._send_releases(pool))
        queued.lease_ids.append(lease_id)
        return queued.sent

    def _unawaited_release_sent(self, lease: Lease, sent: asyncio.Future[None]) -> None:
        exc = None if sent.cancelled() else sent.exception()
        if isinstance(exc, LedgerUnavailable) and self._on_release_lost is not None:
            self._on_release_lost(lease, exc)

    async def _send_releases(self, pool: str) -> None:
        """One call per batch of queued releases of `pool`, until none is left. Nothing cancels
        it: close() waits for it, and only the loop's own shutdown cancels it (and its waiters)."""
        try:
            while (queued := self._queued_releases.pop(pool, None)) is not None:
                ids = queued.lease_ids
                try:
                    for start in range(0, len(ids), LEASES_PER_CALL):
                        chunk = ids[start : start + LEASES_PER_CALL]
                        await self._run("release", all_keys(pool), chunk)
                except Exception as exc:
                    queued.sent.set_exception(exc)
                else:
                    queued.sent.set_result(None)
        finally:
            del self._releasing[pool]

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        renewed = await self._run(
            "renew", all_keys(lease.pool), (_ms(lease_seconds), lease.lease_id)
        )
        return bool(int(renewed[0]))

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """Hold every lease (renewed and grown to `lease.blocks` when that is more than Redis
        counts, or recorded again; no checks); one script call per pool and LEASES_PER_CALL
        leases. Returns how many were recorded again."""
        by_pool: defaultdict[str, list[Lease]] = defaultdict(list)
        for lease in leases:
            by_pool[lease.pool].append(lease)
        added = 0
        for pool, held in by_pool.items():
            for start in range(0, len(held), LEASES_PER_CALL):
                args: list[Any] = [_ms(lease_seconds)]
                for lease in held[start : start + LEASES_PER_CALL]:
                    args += [
                        lease.lease_id,
                        lease.tenant,
                        lease.blocks,
                        _ends_arg(lease.ends_in_s),
                        lease.pod,
                    ]
                answer = ReassertAnswer.from_script(
                    await self._run("reassert", all_keys(pool), args)
                )
                added += int(answer.added)
                # Not a reset to report: this very call has just re-asserted the leases.
                self._epochs[pool] = text(answer.epoch)
        return added

    async def usage(self, pool: str) -> PoolUsage:
        answer = UsageAnswer.from_script(await self._run("usage", all_keys(pool), ()))
        flat = answer.tenants
        tenants = {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        on_pods = answer.pods
        pods = {text(on_pods[i]): int(on_pods[i + 1]) for i in range(0, len(on_pods), 2)}
        return PoolUsage(
            int(answer.reserved),
            int(answer.leases),
            tenants,
            int(answer.promised),
            int(answer.promises),
            int(answer.holding),
            pods,
        )

    async def leases(self, pool: str) -> list[LeaseInfo]:
        answer = LeasesAnswer.from_script(await self._run("leases", all_keys(pool), ()))
        flat = answer.leases
        out = []
        for i in range(0, len(flat), 4):
            lease_id, value, expiry_ms = text(flat[i]), text(flat[i + 1]), int(flat[i + 2])
            blocks, _, tenant = value.partition(":")
            lease = Lease(lease_id, pool, tenant, int(blocks), pod=text(flat[i + 3]))
            out.append(LeaseInfo(lease, (expiry_ms - int(answer.now)) / 1000))
        return out

    async def check(self, pools: Iterable[str]) -> None:
        """Reach Redis (raise LedgerUnavailable) and report pools whose epoch changed."""
        names = list(pools)
        if not names:
            await self._call(self._client.ping)
            return
        for pool in names:
            epoch = await self._call(partial(self._client.get, pool_keys(pool)[4]))
            if epoch is None:
                if pool in self._epochs and self._on_reset is not None:
                    del self._epochs[pool]
                    self._on_reset(pool)  # state gone: nothing wrote since the restart
            else:
                self._saw_epoch(pool, epoch)

    async def register(self, process_id: str, ttl_s: float) -> int:
        """Register `process_id` as alive for `ttl_s` (0: deregister it); returns how many
        kvguard processes are registered and alive (raises LedgerUnavailable)."""
        ttl_ms = _ms(ttl_s) if ttl_s > 0 else 0
        return int(await self._run("replicas", [REPLICAS_KEY], [process_id, ttl_ms]))

    async def time(self) -> float:
        """Redis TIME in seconds: the ledger's clock (tests wait on it)."""
        seconds, micros = await self._call(self._client.time)
        return int(seconds) + int(micros) / 1e6

    @property
    def shared(self) -> bool:
        return True

    @property
    def on_freed(self) -> Callable[[str], None] | None:
        """The `on_freed` given at construction."""
        return self._subscription.on_freed

    @property
    def subscribed(self) -> frozenset[str]:
        """The pools whose channels are subscribed now (all of those given to subscribe(),
        or none)."""
        return self._subscription.subscribed

    def subscribe(self, pools: Iterable[str]) -> None:
        """Call `on_freed(pool)` whenever blocks of one of `pools` are freed (freed.py)."""
        self._subscription.subscribe(pools)

    async def close(self) -> None:
        """Stop the subscription, let the release calls under way finish (the client's
        timeouts bound them), then close the connections."""
        await self._subscription.close()
        await asyncio.gather(*self._releasing.values(), return_exceptions=True)
        await self._client.aclose()


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
