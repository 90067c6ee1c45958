"""Loopback TCP proxies in front of a redis-server or a cluster: a test holds Redis's answers
back, or cuts every connection, at a moment of its choosing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import pytest

from kvguard.ledger import Ledger
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.testing import LOOPBACK
from kvguard.testing.redis import RedisCluster
from tests.ledger.conftest import PATIENT_S, claim, until_usage


class Proxies:
    """Loopback TCP proxies, one per Redis port (any number of connections each): what a client
    sends goes on at once; what the server answers waits while `answers` is clear. `cut()`
    drops every connection and refuses new ones until `restore()`."""

    def __init__(self) -> None:
        self.answers = asyncio.Event()
        self.answers.set()
        self.up = True
        self.ports: dict[int, int] = {}  # Redis port -> its proxy's port
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, ports: list[int]) -> None:
        for port in ports:
            server = await asyncio.start_server(partial(self._forward, port), LOOPBACK, 0)
            self._servers.append(server)
            self.ports[port] = server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self.up = False
        for writer in self._writers:
            writer.transport.abort()

    def restore(self) -> None:
        self.up = True
        self.answers.set()

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        self.cut()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _forward(
        self, port: int, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        if not self.up:
            client_out.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        server_in, server_out = await asyncio.open_connection(LOOPBACK, port)
        self._writers.update((client_out, server_out))
        await asyncio.gather(
            self._pump(client_in, server_out, held=False),
            self._pump(server_in, client_out, held=True),
        )

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, held: bool
    ) -> None:
        try:
            while data := await source.read(65536):
                if held:
                    await self.answers.wait()
                if sink.is_closing():
                    break  # cut
                sink.write(data)
                await sink.drain()
        except OSError:
            pass  # the other side is gone
        finally:
            sink.close()


@contextlib.asynccontextmanager
async def proxied(redis: Any) -> AsyncIterator[tuple[Proxies, Any]]:
    """A redis-py client that reaches `redis` (a server or a cluster) only through Proxies, for
    the ledger a test builds on it (closed here too: closing it again is harmless)."""
    cluster = isinstance(redis, RedisCluster)
    ports = redis.ports if cluster else [redis.port]
    proxies = Proxies()
    await proxies.start(ports)
    seed = f"redis://{LOOPBACK}:{proxies.ports[ports[0]]}/0"
    client = connect(seed, cluster=cluster, timeout_s=PATIENT_S)  # held answers are not lost
    if cluster:  # the nodes it discovers are reached through their proxies too
        client.nodes_manager.address_remap = lambda node: (LOOPBACK, proxies.ports[node[1]])
    try:
        yield proxies, client
    finally:
        proxies.restore()
        await client.aclose()
        await proxies.close()


@contextlib.asynccontextmanager
async def through_proxies(
    redis: Any, *, on_freed: Callable[[str], None] | None = None
) -> AsyncIterator[tuple[Proxies, RedisLedger]]:
    """A RedisLedger that reaches `redis` (a server or a cluster) only through Proxies."""
    async with proxied(redis) as (proxies, client):
        ledger = RedisLedger(client, on_freed=on_freed)
        try:
            yield proxies, ledger
        finally:
            proxies.restore()
            await ledger.close()


async def reserve_then_cancel(ledger: Ledger, proxies: Proxies, direct: Ledger) -> None:
    """A reserve whose script ran in Redis and whose caller then went away (its Envoy stream
    ended) while the answer was on the way: the caller never learns the lease."""
    proxies.answers.clear()
    reserving = asyncio.ensure_future(ledger.reserve(claim("gone", 10, lease_s=900)))
    await until_usage(direct, 10, 1)  # the script ran; its answer is held
    reserving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserving
