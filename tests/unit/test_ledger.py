"""One contract suite for every ledger backend: the memory ledger, a real redis-server and a
real 3-master Redis Cluster (both started here on free loopback ports), plus what only Redis has
(one round trip per operation, NOSCRIPT, epochs).

Time: the memory ledger runs on an injected clock that the tests move; Redis runs on its own
`TIME`, so there the tests use short real leases and wait until Redis's clock reaches a point
(a condition with a deadline). MARGIN covers the moment between reading the clock and the
script running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import pytest

from kvguard.admission.leases import LeaseKeeper
from kvguard.ledger import Claim, Lease, Ledger, LedgerUnavailable, Outcome
from kvguard.ledger import redis_ledger as redis_ledger_module
from kvguard.ledger.memory import MemoryLedger
from kvguard.ledger.redis_ledger import RedisLedger, connect, load_script, pool_keys
from kvguard.ledger.resilient import ResilientLedger, local_share
from kvguard.ledger.url import from_url
from kvguard.testing import LOOPBACK
from kvguard.testing.redis import RedisCluster, RedisServer

MARGIN_S = 0.25
DEADLINE_S = 10.0
# The contract is about semantics: a patient client, so that a loaded machine cannot turn a slow
# answer into LedgerUnavailable (fast failure has tests of its own).
PATIENT_S = 5.0


class LedgerClock(Protocol):
    async def now(self) -> float: ...

    async def reach(self, t: float) -> None:
        """Return once the ledger's clock reads at least `t` (seconds)."""


class Clock:
    """The memory ledger's injected clock: moves only when a test moves it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    async def now(self) -> float:
        return self.t

    async def reach(self, t: float) -> None:
        self.t = max(self.t, t)


class RedisClock:
    """Redis TIME, the clock the scripts use."""

    def __init__(self, ledger: RedisLedger) -> None:
        self._ledger = ledger

    async def now(self) -> float:
        return await self._ledger.time()

    async def reach(self, t: float) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while await self._ledger.time() < t:
            assert time.monotonic() < deadline, f"Redis TIME did not reach {t}"
            await asyncio.sleep(0.01)


LEDGER_URLS = ["memory://", "redis", "redis-cluster"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(params=LEDGER_URLS)
async def clock_and_ledger(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[LedgerClock, Ledger]]:
    if request.param == "memory://":
        clock = Clock()
        yield clock, from_url(request.param, clock=clock)
        return
    cluster = request.param == "redis-cluster"
    redis: Any = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    redis.flushall()
    ledger = ResilientLedger(RedisLedger.from_url(redis.url, cluster=cluster, timeout_s=PATIENT_S))
    try:
        yield RedisClock(ledger.primary), ledger
    finally:
        await ledger.close()


@pytest.fixture(params=["redis", "redis-cluster"])
async def redis_ledger(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, RedisLedger]]:
    """A bare RedisLedger and the server (or cluster) it talks to."""
    cluster = request.param == "redis-cluster"
    redis: Any = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    redis.flushall()
    ledger = RedisLedger.from_url(redis.url, cluster=cluster, timeout_s=PATIENT_S)
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


async def test_admits_within_limits_and_counts_per_tenant(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    first = await ledger.reserve(claim("1", 40, tenant="a"))
    second = await ledger.reserve(claim("2", 30, tenant="b"))
    assert first.outcome is Outcome.ADMITTED and second.outcome is Outcome.ADMITTED
    assert (second.pool_reserved, second.tenant_reserved) == (70, 30)
    assert second.lease == Lease("2", "p", "b", 30)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (70, 2, {"a": 40, "b": 30})


async def test_tenant_quota_refuses_before_the_pool_is_full(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    assert (await ledger.reserve(claim("1", 50))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(claim("2", 11))
    assert refused.outcome is Outcome.TENANT_QUOTA
    assert refused.lease is None
    assert (refused.pool_reserved, refused.tenant_reserved) == (50, 50)
    assert (await ledger.reserve(claim("3", 10))).outcome is Outcome.ADMITTED  # exactly 60


async def test_pool_limit_refuses_any_tenant(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    for i, tenant in enumerate("abc"):
        await ledger.reserve(claim(str(i), 30, tenant=tenant))
    refused = await ledger.reserve(claim("x", 11, tenant="d"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (await ledger.reserve(claim("y", 10, tenant="d"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("p")).reserved == 100


async def test_impossible_claims_are_refused_and_record_nothing(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    over_quota = await ledger.reserve(claim("1", 61))
    over_limit = await ledger.reserve(claim("2", 101, quota=500))
    assert (over_quota.outcome, over_limit.outcome) == (
        Outcome.TENANT_QUOTA,
        Outcome.POOL_WATERMARK,
    )
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_a_retried_reserve_is_counted_once(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    first = await ledger.reserve(claim("same", 40))
    again = await ledger.reserve(claim("same", 40))
    assert first.outcome is Outcome.ADMITTED and again.outcome is Outcome.ADMITTED
    assert again.lease == first.lease
    assert (await ledger.usage("p")).reserved == 40


async def test_release_is_idempotent(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    lease = (await ledger.reserve(claim("1", 40))).lease
    assert lease is not None
    await ledger.release(lease)
    await ledger.release(lease)
    await ledger.release(Lease("never", "p", "a", 5))
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_leases_lists_what_is_open_with_its_time_left(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    first = (await ledger.reserve(claim("1", 40, tenant="a", lease_s=30))).lease
    await ledger.reserve(claim("2", 7, tenant="b:c", lease_s=30))
    assert first is not None
    listed = sorted(await ledger.leases("p"), key=lambda i: i.lease.lease_id)
    assert [i.lease for i in listed] == [Lease("1", "p", "a", 40), Lease("2", "p", "b:c", 7)]
    assert all(25 < i.expires_in_s <= 30 for i in listed)
    await ledger.release(first)
    assert [i.lease.lease_id for i in await ledger.leases("p")] == ["2"]
    assert await ledger.leases("elsewhere") == []


async def test_tenant_names_survive_any_characters(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    odd = "org:42/tëam {x}"
    lease = (await ledger.reserve(claim("1", 7, tenant=odd))).lease
    assert (await ledger.usage("p")).tenants == {odd: 7}
    assert lease is not None
    await ledger.release(lease)
    assert (await ledger.usage("p")).tenants == {}


async def test_expired_leases_are_reclaimed_by_the_next_reserve(clock_and_ledger) -> None:
    clock, ledger = clock_and_ledger
    t0 = await clock.now()
    await ledger.reserve(claim("old", 60, lease_s=1))
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.TENANT_QUOTA
    await clock.reach(t0 + 1 + MARGIN_S)
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases) == (10, 1)


async def test_renew_keeps_a_lease_alive(clock_and_ledger) -> None:
    clock, ledger = clock_and_ledger
    t0 = await clock.now()
    lease = (await ledger.reserve(claim("1", 60, lease_s=2))).lease
    assert lease is not None
    await clock.reach(t0 + 1.2)
    assert await ledger.renew(lease, 2)
    await clock.reach(t0 + 2 + MARGIN_S)  # past the first expiry, before the renewed one
    assert (await ledger.usage("p")).reserved == 60
    await clock.reach(t0 + 1.2 + 2 + MARGIN_S)
    assert (await ledger.usage("p")).reserved == 0  # usage reclaims expired leases itself
    assert not await ledger.renew(lease, 2)


async def test_reassert_records_lost_leases_once_and_without_checks(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    kept = (await ledger.reserve(claim("kept", 50))).lease
    lost = (await ledger.reserve(claim("lost", 40, tenant="b"))).lease
    assert kept is not None and lost is not None
    await ledger.release(lost)  # the ledger lost it (as a Redis that restarted empty would)
    big = Lease("big", "p", "c", 90)  # a running request, whatever the limits say
    assert await ledger.reassert([kept, lost, big], 30) == 2
    assert await ledger.reassert([kept, lost, big], 30) == 0  # idempotent
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases) == (180, 3)
    assert usage.tenants == {"a": 50, "b": 40, "c": 90}
    assert (await ledger.reserve(claim("more", 1, tenant="d"))).outcome is Outcome.POOL_WATERMARK


async def test_reassert_renews_held_leases(clock_and_ledger) -> None:
    clock, ledger = clock_and_ledger
    t0 = await clock.now()
    lease = (await ledger.reserve(claim("1", 20, lease_s=1))).lease
    assert lease is not None
    await clock.reach(t0 + 0.5)
    assert await ledger.reassert([lease], 2) == 0
    await clock.reach(t0 + 1 + MARGIN_S)
    assert (await ledger.usage("p")).reserved == 20


async def test_pools_are_independent(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    assert (await ledger.reserve(claim("1", 60, pool="p"))).outcome is Outcome.ADMITTED
    assert (await ledger.reserve(claim("2", 60, pool="q"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("q")).tenants == {"a": 60}
    assert (await ledger.usage("p")).tenants == {"a": 60}


async def test_concurrent_reserves_admit_exactly_what_fits(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    results = await asyncio.gather(
        *(ledger.reserve(claim(str(i), 7, tenant=f"t{i % 5}", quota=100)) for i in range(50))
    )
    admitted = [r for r in results if r.outcome is Outcome.ADMITTED]
    assert len(admitted) == 100 // 7
    assert max(r.pool_reserved for r in results) == 7 * (100 // 7)
    assert (await ledger.usage("p")).reserved == 7 * (100 // 7)


async def test_the_keeper_renews_by_reasserting_its_open_leases(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    keeper = LeaseKeeper(ledger, 30)
    leases = []
    for i, pool in enumerate(["p", "p", "q"]):
        lease = (await ledger.reserve(claim(str(i), 10, pool=pool))).lease
        assert lease is not None
        keeper.hold(lease)
        leases.append(lease)
    await ledger.release(leases[0])  # lost by the ledger while its stream is still open
    keeper.release(leases[1])  # its stream ended
    await keeper.settle()
    assert await keeper.renew_all() == 1
    assert await keeper.renew_all() == 0
    assert ((await ledger.usage("p")).reserved, (await ledger.usage("q")).reserved) == (10, 10)
    assert [lease.lease_id for lease in keeper.snapshot()] == ["0", "2"]


class LateReassert:
    """A memory ledger whose re-assert waits for a connection (`sent`), then lands in the ledger
    at once and waits for its answer (`answered`): a command on the wire lands whether or not its
    caller still waits."""

    def __init__(self, ledger: MemoryLedger) -> None:
        self.ledger = ledger
        self.sent, self.answered = asyncio.Event(), asyncio.Event()
        self.waiting = asyncio.Event()

    async def reassert(self, leases: list[Lease], lease_seconds: float) -> int:
        self.waiting.set()
        await self.sent.wait()
        added = await self.ledger.reassert(leases, lease_seconds)
        await self.answered.wait()
        return added

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)


async def test_a_renewal_cancelled_after_its_reassert_went_out_leaves_no_released_lease() -> None:
    """Shutdown cancels the keeper's renewal; a lease released while that renewal's re-assert
    waited for a connection was recorded again by it, and is released again."""
    ledger = LateReassert(MemoryLedger(Clock()))
    keeper = LeaseKeeper(ledger, 30)  # type: ignore[arg-type]
    lease = (await ledger.ledger.reserve(claim("ended", 10))).lease
    assert lease is not None
    keeper.hold(lease)
    renewal = asyncio.ensure_future(keeper.renew_all())
    await ledger.waiting.wait()  # its snapshot holds the lease
    keeper.release(lease)  # the stream ended
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0
    ledger.sent.set()
    await _until_usage(ledger.ledger, 10, 1)  # the re-assert landed: recorded again
    renewal.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renewal
    await keeper.settle()
    assert (await ledger.ledger.usage("p")).reserved == 0


def test_the_local_share_rounds_down() -> None:
    assert [local_share(850, r) for r in (1, 2, 3, 1000)] == [850, 425, 283, 0]


def test_memory_expiry_is_exact() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)

    async def scenario() -> list[Outcome]:
        await ledger.reserve(claim("old", 60, lease_s=10))
        clock.t += 9.9
        before = (await ledger.reserve(claim("new", 10))).outcome
        clock.t += 0.1  # expiry is inclusive: at exactly now + lease_seconds it is gone
        after = (await ledger.reserve(claim("new", 10))).outcome
        return [before, after]

    assert asyncio.run(scenario()) == [Outcome.TENANT_QUOTA, Outcome.ADMITTED]


# -- what only Redis has ------------------------------------------------------------------------


def test_scripts_name_their_keys_arguments_and_return_value() -> None:
    for name in ("reserve", "release", "renew", "reassert", "usage"):
        script = load_script(name)
        header = script.source.split("--#include", 1)[0]
        assert header.startswith(f"-- {name}:"), name
        for word in ("KEYS", "ARGV", "Returns"):
            assert word in header, (name, word)
        assert "lib.lua" not in script.source.split("\n", 30)[-1]  # the include was expanded
        assert "local function reclaim" in script.source


def test_every_key_of_a_pool_shares_its_hash_tag() -> None:
    keys = pool_keys("qwen-7b")
    assert len(set(keys)) == 5
    assert all(key.split("{", 1)[1].split("}", 1)[0] == "qwen-7b" for key in keys)


def _commandstats(redis: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    nodes = redis.nodes if isinstance(redis, RedisCluster) else [redis]
    for node in nodes:
        for line in node.cli("info", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, stats = line.removeprefix("cmdstat_").split(":", 1)
                calls = int(stats.split(",")[0].removeprefix("calls="))
                out[name] = out.get(name, 0) + calls
    return out


def _reset_stats(redis: Any) -> None:
    for node in redis.nodes if isinstance(redis, RedisCluster) else [redis]:
        node.cli("config", "resetstat")


async def test_one_round_trip_per_admission_and_per_release(redis_ledger) -> None:
    redis, ledger = redis_ledger
    await ledger.start()  # scripts registered once per client
    await ledger.usage("p")  # connections opened, cluster slots discovered
    _reset_stats(redis)
    lease = (await ledger.reserve(claim("1", 10))).lease
    assert lease is not None
    await ledger.release(lease)
    stats = _commandstats(redis)
    assert stats.get("evalsha") == 2, stats
    assert "eval" not in stats and "script|load" not in stats, stats


async def _leases_in_two_pools(ledger: Ledger, n: int) -> list[Lease]:
    """n leases of one block, alternately in pools p and q."""
    leases = []
    for i in range(n):
        lease = (await ledger.reserve(claim(str(i), 1, pool="pq"[i % 2], quota=100))).lease
        assert lease is not None
        leases.append(lease)
    return leases


async def test_renewing_many_leases_is_one_call_per_pool(redis_ledger) -> None:
    redis, ledger = redis_ledger
    leases = await _leases_in_two_pools(ledger, 30)
    _reset_stats(redis)
    assert await ledger.reassert(leases, 30) == 0
    assert _commandstats(redis).get("evalsha") == 2


async def test_releases_that_queue_up_go_in_one_call_per_pool(redis_ledger) -> None:
    redis, ledger = redis_ledger
    leases = await _leases_in_two_pools(ledger, 40)
    _reset_stats(redis)
    # Started together, every release queues before the first call goes out.
    await asyncio.gather(*(ledger.release(lease) for lease in leases))
    assert _commandstats(redis).get("evalsha") == 2
    for pool in "pq":
        usage = await ledger.usage(pool)
        assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})
    _reset_stats(redis)
    await asyncio.gather(*(ledger.release(lease) for lease in leases[:5]))  # idempotent
    assert _commandstats(redis).get("evalsha") == 2
    assert (await ledger.usage("p")).reserved == 0


async def test_a_long_queue_of_releases_goes_in_bounded_calls(
    redis_ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis, ledger = redis_ledger
    monkeypatch.setattr(redis_ledger_module, "LEASES_PER_CALL", 4)
    leases = await _leases_in_two_pools(ledger, 20)
    _reset_stats(redis)
    await asyncio.gather(*(ledger.release(lease) for lease in leases))
    assert _commandstats(redis).get("evalsha") == 2 * 3  # 10 leases a pool: 4 + 4 + 2
    assert [(await ledger.usage(pool)).reserved for pool in "pq"] == [0, 0]


async def test_a_release_waits_for_the_call_in_flight_then_goes_in_the_next(
    redis_ledger,
) -> None:
    redis, ledger = redis_ledger
    first, second, third = [
        (await ledger.reserve(claim(str(i), 5, quota=100))).lease for i in range(3)
    ]
    assert first is not None and second is not None and third is not None
    _reset_stats(redis)
    releasing = asyncio.ensure_future(ledger.release(first))
    await asyncio.sleep(0)  # its call is on its way
    await asyncio.gather(ledger.release(second), ledger.release(third), releasing)
    assert _commandstats(redis).get("evalsha") == 2
    assert (await ledger.usage("p")).reserved == 0


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
async def through_proxies(redis: Any) -> AsyncIterator[tuple[Proxies, RedisLedger]]:
    """A RedisLedger that reaches `redis` (a server or a cluster) only through Proxies."""
    cluster = isinstance(redis, RedisCluster)
    ports = redis.ports if cluster else [redis.port]
    proxies = Proxies()
    await proxies.start(ports)
    seed = f"redis://{LOOPBACK}:{proxies.ports[ports[0]]}/0"
    client = connect(seed, cluster=cluster, timeout_s=PATIENT_S)  # held answers are not lost
    if cluster:  # the nodes it discovers are reached through their proxies too
        client.nodes_manager.address_remap = lambda node: (LOOPBACK, proxies.ports[node[1]])
    ledger = RedisLedger(client)
    try:
        yield proxies, ledger
    finally:
        proxies.restore()
        await ledger.close()
        await proxies.close()


async def _until_usage(ledger: Ledger, reserved: int, leases: int) -> None:
    """Return once pool p holds `reserved` blocks in `leases` leases (within DEADLINE_S)."""
    deadline = time.monotonic() + DEADLINE_S
    while ((usage := await ledger.usage("p")).reserved, usage.leases) != (reserved, leases):
        assert time.monotonic() < deadline, f"pool p still holds {usage}"
        await asyncio.sleep(0.01)  # pacing of the reads, not synchronisation


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Return once `condition()` holds (within DEADLINE_S); else fail saying `what` was awaited."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        await asyncio.sleep(0.01)  # pacing, not synchronisation


async def _reserve_then_cancel(ledger: Ledger, proxies: Proxies, direct: Ledger) -> None:
    """A reserve whose script ran in Redis and whose caller then went away (its Envoy stream
    ended) while the answer was on the way: the caller never learns the lease."""
    proxies.answers.clear()
    reserving = asyncio.ensure_future(ledger.reserve(claim("gone", 10, lease_s=900)))
    await _until_usage(direct, 10, 1)  # the script ran; its answer is held
    reserving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserving


async def test_a_reserve_cancelled_after_its_script_ran_leaves_no_lease(redis_ledger) -> None:
    redis, direct = redis_ledger
    async with through_proxies(redis) as (proxies, ledger):
        await ledger.start()  # connections open, scripts registered, slots discovered
        await _reserve_then_cancel(ledger, proxies, direct)
        proxies.answers.set()
        await _until_usage(direct, 0, 0)  # the ledger released it itself


async def test_a_cancelled_reserves_release_that_cannot_reach_redis_is_replayed(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    async with through_proxies(redis_server) as (proxies, primary):
        ledger = ResilientLedger(primary, probe_interval_s=0.02)
        try:
            await ledger.start()
            await _reserve_then_cancel(ledger, proxies, direct)
            proxies.cut()  # before the release's answer: it cannot reach Redis
            await _until(lambda: not ledger.reachable, "Redis to count as unreachable")
            assert (await direct.usage("p")).reserved == 10
            proxies.restore()
            await _until_usage(direct, 0, 0)  # replayed on recovery
            assert ledger.reachable
        finally:
            await ledger.close()


async def test_a_lease_redis_admits_after_the_flip_to_local_counts_in_the_local_share(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    async with through_proxies(redis_server) as (proxies, primary):
        ledger = ResilientLedger(
            primary, on_unavailable="local", replicas=2, probe_interval_s=30, heartbeat_s=30
        )
        try:
            await ledger.start()
            proxies.answers.clear()
            first = claim("B", 40, tenant="b", limit=100, quota=100)
            reserving = asyncio.ensure_future(ledger.reserve(first))
            await _until_usage(direct, 40, 1)  # admitted in Redis; the answer is on its way
            # Meanwhile another call finds Redis unreachable (each failed call does this).
            ledger._went_down(LedgerUnavailable("another call timed out"))
            proxies.answers.set()
            assert (await reserving).outcome is Outcome.ADMITTED
            # This process's share is 100 // 2 = 50 blocks, and B holds 40 of them.
            second = await ledger.reserve(claim("C", 20, tenant="c", limit=100, quota=100))
            assert second.outcome is Outcome.POOL_WATERMARK
        finally:
            await ledger.close()


async def test_a_lease_released_while_a_pool_reset_reasserts_is_released_again(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    """Redis restarted empty: the pool's open leases are re-asserted; one whose stream ended
    while that script waited to be sent was recorded again, and the script's answer was lost."""
    async with through_proxies(redis_server) as (proxies, primary):
        keeper: LeaseKeeper
        ledger = ResilientLedger(
            primary, open_leases=lambda: keeper.snapshot(), probe_interval_s=0.02, heartbeat_s=30
        )
        keeper = LeaseKeeper(ledger, 60)
        try:
            await ledger.start()
            for lease_id in ("ended", "open"):
                reservation = await ledger.reserve(claim(lease_id, 10))
                assert reservation.lease is not None
                keeper.hold(reservation.lease)
            redis_server.flushall()  # what a restart without persistence leaves
            send, snapshotted = asyncio.Event(), asyncio.Event()
            run = primary._run

            async def reassert_sent_late(name: str, keys: Any, args: Any) -> Any:
                if name == "reassert":  # waits for a connection, after its snapshot
                    snapshotted.set()
                    await send.wait()
                    proxies.answers.clear()  # this answer will be lost
                return await run(name, keys, args)

            primary._run = reassert_sent_late  # type: ignore[method-assign]
            await primary.check(["p"])  # the epoch is gone: the pool's leases are re-asserted
            await snapshotted.wait()
            keeper.release(next(lease for lease in keeper.snapshot() if lease.lease_id == "ended"))
            await keeper.settle()
            send.set()
            await _until_usage(direct, 20, 2)  # both recorded again
            proxies.cut()
            await _until(lambda: not ledger.reachable, "the re-assert to fail")  # answer lost
            primary._run = run  # type: ignore[method-assign]
            proxies.restore()
            await _until_usage(direct, 10, 1)  # released again on recovery
            assert [lease.lease_id for lease in keeper.snapshot()] == ["open"]
        finally:
            await ledger.close()


async def test_an_outage_an_operation_finds_is_probed_at_once_not_after_the_heartbeat(
    redis_server: RedisServer,
) -> None:
    redis_server.flushall()
    async with through_proxies(redis_server) as (proxies, primary):
        ledger = ResilientLedger(primary, probe_interval_s=0.02, heartbeat_s=3600)
        try:
            await ledger.start()  # the watcher sleeps for its heartbeat
            proxies.cut()
            with pytest.raises(LedgerUnavailable):
                await ledger.reserve(claim("A", 1))
            proxies.restore()
            await _until(lambda: ledger.reachable, "a probe (every 0.02 s, not in an hour)")
        finally:
            await ledger.close()


async def test_close_leaves_no_watcher_behind(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    """A cancelled reserve's release fails while close() waits for it: Redis is then seen
    unreachable, and nothing may start watching it again."""
    async with through_proxies(redis_server) as (proxies, primary):
        ledger = ResilientLedger(primary, probe_interval_s=0.02)
        await ledger.start()
        await _reserve_then_cancel(ledger, proxies, direct)  # its release waits for an answer
        closing = asyncio.ensure_future(ledger.close())
        # close() stops the watcher, then waits for the release.
        await _until(lambda: ledger._watcher is None, "close() to stop the watcher")
        proxies.cut()
        await closing
        assert not ledger.reachable  # the release failed
        assert ledger._watcher is None


async def test_renewing_a_released_lease_locally_does_not_bring_it_back(tmp_path: Path) -> None:
    never_started = RedisServer(tmp_path / "redis")  # its port refuses connections
    ledger = ResilientLedger(
        RedisLedger.from_url(never_started.url), on_unavailable="local", probe_interval_s=30
    )
    try:
        await ledger.start()
        assert not ledger.reachable
        lease = (await ledger.reserve(claim("L", 10))).lease
        assert lease is not None
        await ledger.release(lease)
        assert await ledger.renew(lease, 60) is False
        assert (await ledger.usage("p")).reserved == 0
    finally:
        await ledger.close()


async def test_a_redis_without_the_scripts_runs_them_anyway(redis_ledger) -> None:
    redis, ledger = redis_ledger
    await ledger.start()
    for node in redis.nodes if isinstance(redis, RedisCluster) else [redis]:
        node.cli("script", "flush")
    _reset_stats(redis)
    assert (await ledger.reserve(claim("1", 10))).outcome is Outcome.ADMITTED
    assert (await ledger.reserve(claim("2", 10))).outcome is Outcome.ADMITTED
    stats = _commandstats(redis)
    # NOSCRIPT once, then EVAL (which caches it), then EVALSHA again.
    assert (stats.get("evalsha"), stats.get("eval")) == (2, 1), stats
    assert (await ledger.usage("p")).reserved == 20


async def test_a_pool_whose_state_vanished_is_reported_once(redis_ledger) -> None:
    redis, ledger = redis_ledger
    resets: list[str] = []
    ledger.on_reset = resets.append
    await ledger.reserve(claim("1", 10, pool="p"))
    await ledger.reserve(claim("2", 10, pool="q"))
    await ledger.check(["p", "q"])
    assert resets == []
    redis.flushall()  # what a restart without persistence leaves
    await ledger.check(["p"])
    assert resets == ["p"]
    await ledger.reserve(claim("3", 10, pool="q"))  # a new epoch, written by this reserve
    assert resets == ["p", "q"]


async def test_redis_errors_are_fast_and_unavailable(tmp_path: Path) -> None:
    from kvguard.ledger import LedgerUnavailable

    server = RedisServer(tmp_path / "gone")  # never started: connections are refused
    ledger = RedisLedger.from_url(server.url)
    try:
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            await ledger.reserve(claim("1", 10))
        assert time.monotonic() - started < 1.0
        # Releases queued behind one another all learn that their call failed.
        leases = [Lease(str(i), "p", "t", 1) for i in range(3)]
        failed = await asyncio.gather(
            *(ledger.release(lease) for lease in leases), return_exceptions=True
        )
        assert [type(e) for e in failed] == [LedgerUnavailable] * 3
    finally:
        await ledger.close()
