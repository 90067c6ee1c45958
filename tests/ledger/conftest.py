"""The ledgers under test: the memory ledger on an injected clock, a real redis-server and a
real 3-master Redis Cluster (both started once for tests/ledger/, on free loopback ports).

Time: the memory ledger runs on a clock that the tests move; Redis runs on its own `TIME`, so
there the tests use short real leases and wait until Redis's clock reaches a point (a condition
with a deadline). MARGIN_S covers the moment between reading the clock and the script running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from kvguard.ledger import Claim, Ledger, PoolUsage
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.resilient import ResilientLedger
from kvguard.ledger.url import from_url
from kvguard.testing.redis import RedisCluster, RedisServer
from kvguard.testing.wait import wait_until
from tests.clock import Clock

MARGIN_S = 0.25
DEADLINE_S = 10.0
# The contract is about semantics: a patient client, so that a loaded machine cannot turn a slow
# answer into LedgerUnavailable (fast failure has tests of its own).
PATIENT_S = 5.0


class LedgerClock(Protocol):
    async def now(self) -> float: ...

    async def reach(self, t: float) -> None:
        """Return once the ledger's clock reads at least `t` (seconds)."""


class MemoryClock:
    """The memory ledger's LedgerClock: the tests' clock (tests/clock.py) it was built on, which
    moves only when a test moves it."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    async def now(self) -> float:
        return self.clock.now

    async def reach(self, t: float) -> None:
        self.clock.now = max(self.clock.now, t)


class RedisClock:
    """Redis TIME, the clock the scripts use."""

    def __init__(self, ledger: RedisLedger) -> None:
        self._ledger = ledger

    async def now(self) -> float:
        return await self._ledger.time()

    async def reach(self, t: float) -> None:
        async def reached() -> bool:
            return await self._ledger.time() >= t

        await wait_until(reached, f"Redis TIME to reach {t}", timeout_s=DEADLINE_S)


@dataclass(frozen=True)
class Backend:
    """A ledger under test and the clock its leases expire by."""

    ledger: Ledger
    clock: LedgerClock


# Every backend the contract holds for; those on Redis need a redis-server.
BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("cluster", id="cluster", marks=pytest.mark.redis),
]
REDIS_BACKENDS = [param for param in BACKENDS if param.values[0] != "memory"]


@pytest.fixture(scope="package")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="package")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


def emptied_redis(request: pytest.FixtureRequest, backend: str) -> Any:
    """The shared redis-server (or cluster, for "cluster"), emptied for this test."""
    redis: Any = request.getfixturevalue(
        "redis_cluster" if backend == "cluster" else "redis_server"
    )
    redis.flushall()
    return redis


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each ledger as kvguard builds it: memory://, or Redis behind the ResilientLedger."""
    if request.param == "memory":
        clock = Clock()
        yield Backend(from_url("memory://", clock=clock), MemoryClock(clock))
        return
    redis = emptied_redis(request, request.param)
    ledger = ResilientLedger(
        connect(redis.url, cluster=request.param == "cluster", timeout_s=PATIENT_S)
    )
    try:
        yield Backend(ledger, RedisClock(ledger.primary))
    finally:
        await ledger.close()


@pytest.fixture
def ledger(backend: Backend) -> Ledger:
    return backend.ledger


@pytest.fixture
def clock(backend: Backend) -> LedgerClock:
    return backend.clock


@pytest.fixture(params=REDIS_BACKENDS)
async def redis_ledger(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, RedisLedger]]:
    """A bare RedisLedger and the server (or cluster) it talks to."""
    redis = emptied_redis(request, request.param)
    ledger = RedisLedger.from_url(
        redis.url, cluster=request.param == "cluster", timeout_s=PATIENT_S
    )
    try:
        yield redis, ledger
    finally:
        await ledger.close()


@pytest.fixture
async def direct(redis_server: RedisServer) -> AsyncIterator[RedisLedger]:
    """The emptied redis-server's own view, for tests whose ledger reaches it through Proxies."""
    redis_server.flushall()
    view = RedisLedger.from_url(redis_server.url, timeout_s=PATIENT_S)
    try:
        yield view
    finally:
        await view.close()


def claim(
    lease_id: str,
    blocks: int,
    *,
    tenant: str = "a",
    pool: str = "p",
    limit: int = 100,
    quota: int = 60,
    lease_s: float = 30.0,
) -> Claim:
    return Claim(lease_id, pool, tenant, blocks, limit, quota, lease_s)


async def until_usage(ledger: Ledger, reserved: int, leases: int) -> None:
    """Return once pool p holds `reserved` blocks in `leases` leases (within DEADLINE_S)."""
    usage: PoolUsage | None = None

    async def holds() -> bool:
        nonlocal usage
        usage = await ledger.usage("p")
        return (usage.reserved, usage.leases) == (reserved, leases)

    await wait_until(
        holds,
        lambda: f"pool p to hold {reserved} blocks in {leases} leases (it holds {usage})",
        timeout_s=DEADLINE_S,
    )
