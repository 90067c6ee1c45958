"""The freed-blocks channel: wakes this process's waiters when any replica frees blocks.

Every script that frees blocks (a release, or a reclaim of expired leases and promises) publishes
them on the pool's sharded pub/sub channel `kvguard:{pool}:freed` (SPUBLISH, Redis 7: the
channel lives in the pool's slot). `FreedSubscription`, which each RedisLedger holds, listens
to the channels of the pools given to `subscribe` (one connection per node that serves them)
and calls `on_freed(pool)` for each message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from kvguard.ledger.scripts import text
from kvguard.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# A connection silent this long is sent a PING, and one that stays silent as long again counts
# as broken (a peer gone without closing it). A broken subscription is opened again after a
# backoff from the ledger's connect timeout, doubling up to RESUBSCRIBE_MAX_S.
KEEPALIVE_S = 10.0
RESUBSCRIBE_MAX_S = 2.0


def freed_channel(pool: str) -> str:
    """The sharded pub/sub channel on which the scripts publish the blocks freed in `pool`
    (lib.lua, publish_freed): the pool's hash tag, so its slot."""
    return f"kvguard:{{{pool}}}:freed"


class _Subscriber(PubSub):
    """A PubSub that reports when redis-py connects it again (and subscribed it again) after
    its connection broke: messages may have been lost meanwhile."""

    def __init__(self, pool: Any, on_reconnect: Callable[[], None]) -> None:
        super().__init__(pool)
        self._on_reconnect = on_reconnect

    async def on_connect(self, connection: Any) -> None:
        await super().on_connect(connection)
        self._on_reconnect()


class FreedSubscription:
    """The subscription of one RedisLedger to the freed blocks of its pools.

    `on_freed(pool)` is called for each release (or reclaim) that freed blocks of a pool given
    to `subscribe`, whichever process made it, and for each such pool once its subscription is
    back after it broke (what was published meanwhile is lost: the caller checks again).
    `discover()` learns a cluster's slots (the ledger's, shared with its commands), and
    `rediscover()` makes the next command learn them again; `backoff_s` is the first pause
    before a broken subscription is opened again.
    """

    def __init__(
        self,
        client: Any,
        *,
        discover: Callable[[], Awaitable[None]],
        rediscover: Callable[[], None],
        backoff_s: float,
        on_freed: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._discover = discover
        self._rediscover = rediscover
        self._backoff_s = backoff_s
        self.on_freed = on_freed
        # The pools given to subscribe(), and those whose channels are subscribed now.
        self._wanted: frozenset[str] = frozenset()
        self.subscribed: frozenset[str] = frozenset()
        self._subscriber: asyncio.Task[None] | None = None
        self._closed = False

    def subscribe(self, pools: Iterable[str]) -> None:
        """Call `on_freed(pool)` whenever blocks of one of `pools` are freed, from now on (a
        background task, which replaces the pools subscribed before; needs a running event
        loop). Nothing is subscribed once closed."""
        wanted = frozenset(pools)
        running = self._subscriber is not None and not self._subscriber.done()
        if self._closed or (wanted == self._wanted and (running or not wanted)):
            return
        # The pools subscribed before and still wanted may miss a message while the
        # subscription is opened again: they are checked once it is.
        recheck = wanted & self.subscribed
        self._wanted = wanted
        previous, self._subscriber = self._subscriber, None
        if wanted or previous is not None:
            self._subscriber = asyncio.get_running_loop().create_task(
                self._subscribe_forever(wanted, recheck, previous)
            )

    async def _subscribe_forever(
        self, pools: frozenset[str], recheck: frozenset[str], previous: asyncio.Task[None] | None
    ) -> None:
        """Keep `pools` subscribed, opening the subscription again (after a bounded backoff)
        whenever it breaks; nothing raised here ends it."""
        if previous is not None:
            await cancel_and_wait([previous])
        self.subscribed = frozenset()
        delay, quiet = self._backoff_s, False
        while pools:
            opened = False

            def ready() -> None:
                nonlocal opened
                opened = True

            try:
                await self._subscribe_once(pools, recheck, ready)
            except Exception as exc:  # e.g. Redis gone: its waiters keep their own timers
                if opened:
                    delay, quiet = self._backoff_s, False
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "ledger: subscription to the freed blocks of %s broke (%s: %s); "
                    "subscribing again",
                    ", ".join(sorted(pools)),
                    type(exc).__name__,
                    exc,
                )
                quiet = True  # until it was open again
            self.subscribed = frozenset()
            self._rediscover()  # the slots may have moved
            recheck = pools
            # Pacing of a reconnection, not synchronisation.
            await asyncio.sleep(delay)
            delay = min(2 * delay, RESUBSCRIBE_MAX_S)

    async def _subscribe_once(
        self, pools: frozenset[str], recheck: frozenset[str], ready: Callable[[], None]
    ) -> None:
        """Subscribe to the channels of `pools` (one connection per node that serves them) and
        deliver their messages until a connection breaks (raises). Once every channel is
        subscribed: `ready()`, and `on_freed` for each pool of `recheck`."""
        by_node = await self._channels_by_node(pools)
        unconfirmed = set(pools)
        owned: list[Any] = []  # connection pools opened here, for cluster nodes
        subscribers: list[_Subscriber] = []
        listeners: list[asyncio.Task[None]] = []

        def confirmed(pool: str) -> None:
            if pool in unconfirmed:
                unconfirmed.discard(pool)
                if not unconfirmed:
                    self.subscribed = pools
                    ready()
                    self._recheck(sorted(recheck))

        try:
            for connections, channels, own in by_node:
                if own:
                    owned.append(connections)
                names = sorted(set(channels.values()))
                subscriber = _Subscriber(connections, partial(self._recheck, names))
                subscribers.append(subscriber)
                for channel in channels:
                    # One per call: a cluster refuses channels of different slots together.
                    await subscriber.ssubscribe(channel)
                listeners.append(
                    asyncio.get_running_loop().create_task(
                        self._listen(subscriber, channels, confirmed)
                    )
                )
            done, _ = await asyncio.wait(listeners, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises why it ended
            raise rexc.ConnectionError("the subscription ended")
        finally:
            await cancel_and_wait([task for task in listeners if not task.done()])
            for subscriber in subscribers:
                await subscriber.aclose()  # type: ignore[no-untyped-call]
            for connections in owned:
                await connections.disconnect()

    async def _channels_by_node(
        self, pools: Iterable[str]
    ) -> list[tuple[Any, dict[bytes, str], bool]]:
        """The channels of `pools` (as messages name them, to their pool) grouped by the node
        that serves them, with a connection pool to that node (True: opened here, for a
        cluster node, and to be disconnected after use)."""
        channels = {freed_channel(pool).encode(): pool for pool in pools}
        if not self._cluster:
            return [(self._client.connection_pool, channels, False)]
        await self._discover()
        nodes: dict[str, tuple[Any, dict[bytes, str], bool]] = {}
        for channel, pool in channels.items():
            node = self._client.get_node_from_key(channel)
            if node is None:
                raise rexc.ClusterDownError(f"no node serves {channel!r}")
            if node.name not in nodes:
                # A connection apart, with the node's settings: its own pool serves commands.
                connections = aioredis.ConnectionPool(
                    connection_class=node.connection_class,
                    max_connections=1,
                    **node.connection_kwargs,
                )
                nodes[node.name] = (connections, {}, True)
            nodes[node.name][1][channel] = pool
        return list(nodes.values())

    async def _listen(
        self, subscriber: _Subscriber, channels: dict[bytes, str], confirmed: Callable[[str], None]
    ) -> None:
        """Deliver one connection's messages until it breaks (raises): blocks freed, and the
        confirmation of each subscription."""
        pinged = False
        while True:
            message = await subscriber.get_message(timeout=KEEPALIVE_S)
            if message is None:
                if pinged:
                    raise rexc.ConnectionError(f"no answer to a PING within {KEEPALIVE_S:g} s")
                await subscriber.ping()
                pinged = True
                continue
            pinged = False
            kind = text(message["type"])
            pool = channels.get(message["channel"]) if message["channel"] is not None else None
            if pool is None:
                continue
            if kind == "smessage":
                self._freed(pool)
            elif kind == "ssubscribe":
                confirmed(pool)
            elif kind == "sunsubscribe":
                # Redis unsubscribes a shard channel whose slot moved to another node.
                raise rexc.ConnectionError(f"{message['channel']!r} was unsubscribed")

    def _recheck(self, pools: Iterable[str]) -> None:
        for pool in pools:
            self._freed(pool)

    def _freed(self, pool: str) -> None:
        if self.on_freed is None:
            return
        try:
            self.on_freed(pool)
        except Exception:
            log.exception("ledger: on_freed(%r) failed", pool)

    async def close(self) -> None:
        """Stop the subscription; nothing is subscribed after."""
        self._closed = True
        if self._subscriber is not None:
            await cancel_and_wait([self._subscriber])
            self._subscriber = None
