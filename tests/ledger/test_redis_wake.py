"""A release by one replica wakes another's waiters through Redis sharded pub/sub: two
RedisLedgers on one real redis-server (and on a real Redis Cluster), each as a kvguard replica
holds it. What frees nothing publishes nothing, and a subscription that broke (Redis restarted)
checks its pools again once it is back."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from kvguard import config as configs
from kvguard.admission import policy as policies
from kvguard.admission.queue import AdmissionQueue
from kvguard.app import Service
from kvguard.ledger import Lease, Outcome
from kvguard.ledger import freed as freed_module
from kvguard.ledger.freed import freed_channel
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.resilient import ResilientLedger
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.ledger.conftest import DEADLINE_S, PATIENT_S, REDIS_BACKENDS, claim, emptied_redis
from tests.ledger.proxies import through_proxies

pytestmark = pytest.mark.redis


class Replica:
    """A RedisLedger and the pools its on_freed was called for, counted."""

    def __init__(self, url: str, *, cluster: bool = False) -> None:
        self.freed: Counter[str] = Counter()
        client = connect(url, cluster=cluster, timeout_s=PATIENT_S)
        self.ledger = RedisLedger(client, on_freed=self._count)

    def _count(self, pool: str) -> None:
        self.freed[pool] += 1

    async def subscribed(self, *pools: str) -> None:
        self.ledger.subscribe(pools)
        await wait_until(
            lambda: self.ledger.subscribed == frozenset(pools),
            lambda: f"{pools} subscribed (subscribed: {sorted(self.ledger.subscribed)})",
            timeout_s=DEADLINE_S,
        )

    async def woken(self, pool: str, times: int) -> None:
        await wait_until(
            lambda: self.freed[pool] >= times,
            lambda: f"on_freed({pool!r}) {times} times (called {self.freed[pool]})",
            timeout_s=DEADLINE_S,
        )


@pytest.fixture(params=REDIS_BACKENDS)
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two replicas on one emptied redis-server (or cluster)."""
    redis = emptied_redis(request, request.param)
    one = Replica(redis.url, cluster=request.param == "cluster")
    two = Replica(redis.url, cluster=request.param == "cluster")
    try:
        yield one, two
    finally:
        await one.ledger.close()
        await two.ledger.close()


async def test_a_release_by_one_replica_wakes_the_other(replicas: tuple[Replica, Replica]) -> None:
    one, two = replicas
    await one.subscribed("p", "q")
    reservation = await one.ledger.reserve(claim("l1", 10))
    assert reservation.outcome is Outcome.ADMITTED and reservation.lease is not None
    assert one.freed == Counter()  # a reserve frees nothing
    await two.ledger.release(reservation.lease)  # the lease as the other replica knows it
    await one.woken("p", 1)
    assert one.freed == Counter({"p": 1})  # pool q freed nothing
    assert (await one.ledger.usage("p")).reserved == 0


def same_slot(pool: str) -> str:
    """Another pool whose channel is in `pool`'s slot: the messages of both reach a subscriber in
    the order they were published."""
    for i in itertools.count():
        name = f"marker-{i}"
        if key_slot(name.encode()) == key_slot(pool.encode()):
            return name
    raise AssertionError("unreachable")


async def test_a_release_that_frees_nothing_publishes_nothing(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    marker = same_slot("p")
    await one.subscribed("p", marker)

    async def mark(times: int) -> None:
        """A release in the marker pool, seen by `one`: whatever came before it has too."""
        reservation = await two.ledger.reserve(claim(f"mark{times}", 1, pool=marker))
        assert reservation.lease is not None
        await two.ledger.release(reservation.lease)
        await one.woken(marker, times)

    await two.ledger.release(Lease("unknown", "p", "a", 10))
    await mark(1)
    assert one.freed["p"] == 0
    reservation = await two.ledger.reserve(claim("l1", 3))
    assert reservation.lease is not None
    await two.ledger.release(reservation.lease)
    await two.ledger.release(reservation.lease)  # released already: it frees nothing
    await mark(2)
    assert one.freed == Counter({"p": 1, marker: 2})


async def test_an_expired_lease_reclaimed_by_one_replica_wakes_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    await one.subscribed("p")
    short = await one.ledger.reserve(claim("short", 10, lease_s=0.05))
    assert short.lease is not None

    async def reclaimed() -> bool:
        return (await two.ledger.usage("p")).leases == 0

    await wait_until(reclaimed, "the short lease to be reclaimed", timeout_s=DEADLINE_S)
    await one.woken("p", 1)


async def test_subscribing_other_pools_replaces_the_channels(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    await one.subscribed("p")
    await one.subscribed("q")
    for pool in ("p", "q"):
        reservation = await two.ledger.reserve(claim(f"l-{pool}", 2, pool=pool))
        assert reservation.lease is not None
        await two.ledger.release(reservation.lease)
    await one.woken("q", 1)
    marker = await two.ledger.reserve(claim("marker", 1, pool="q"))
    assert marker.lease is not None
    await two.ledger.release(marker.lease)
    await one.woken("q", 2)
    assert one.freed == Counter({"q": 2})  # p is no longer listened to


async def test_a_restarted_redis_leads_to_a_check_of_every_subscribed_pool(
    tmp_path: Path,
) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        one = Replica(redis.url)
        two = Replica(redis.url)
        try:
            await one.subscribed("p", "q")
            await asyncio.to_thread(redis.restart)  # empty, on the same port
            await one.woken("p", 1)
            await one.woken("q", 1)
            await wait_until(
                lambda: one.ledger.subscribed == {"p", "q"},
                "the subscription to be open again",
                timeout_s=DEADLINE_S,
            )
            # And it listens again: a release by the other replica wakes it.
            reservation = await two.ledger.reserve(claim("l1", 4))
            assert reservation.lease is not None
            await two.ledger.release(reservation.lease)
            await one.woken("p", 2)
            assert one.freed == Counter({"p": 2, "q": 1})
        finally:
            await one.ledger.close()
            await two.ledger.close()


async def test_a_subscription_survives_redis_being_away(tmp_path: Path) -> None:
    """Redis stopped for longer than a reconnection: the subscription keeps trying."""
    with RedisServer(tmp_path / "redis") as redis:
        one = Replica(redis.url)
        try:
            await one.subscribed("p")
            await asyncio.to_thread(redis.stop)
            await wait_until(
                lambda: not one.ledger.subscribed, "the subscription to break", timeout_s=5
            )
            assert one.freed == Counter()  # nothing to check while Redis is away
            await asyncio.to_thread(redis.start)
            await one.woken("p", 1)
            assert one.ledger.subscribed == {"p"}
        finally:
            await one.ledger.close()


async def test_a_waiter_in_one_replicas_queue_is_admitted_when_another_releases(
    request: pytest.FixtureRequest,
) -> None:
    """Replica A's queue holds a refused request; B's release is all that frees its blocks (no
    lease expires, nothing else wakes A)."""
    redis = emptied_redis(request, "redis")
    released: list[Lease] = []
    queue = AdmissionQueue(lambda _pool, _tenant: 0, released.append)
    a = ResilientLedger(connect(redis.url, timeout_s=PATIENT_S), on_freed=queue.notify)
    b = RedisLedger.from_url(redis.url, timeout_s=PATIENT_S)
    try:
        await a.start()
        a.subscribe(["p"])
        await wait_until(lambda: a.primary.subscribed == {"p"}, "p subscribed", timeout_s=5)
        held = await b.reserve(claim("b1", 60, limit=60, quota=60, lease_s=60))
        assert held.lease is not None
        waiting = asyncio.create_task(
            queue.wait(
                "p",
                "a",
                lambda: a.reserve(claim("a1", 20, limit=60, quota=60)),
                max_wait_s=DEADLINE_S,
                max_queued=10,
            )
        )
        await wait_until(lambda: queue.queued("p") == 1, "the request to queue", timeout_s=5)
        assert not waiting.done()
        await b.release(held.lease)
        admitted = await asyncio.wait_for(waiting, DEADLINE_S)
        assert admitted is not None and admitted.outcome is Outcome.ADMITTED
        assert (await b.usage("p")).tenants == {"a": 20}
        assert released == []
    finally:
        await a.close()
        await b.close()


def test_the_channel_shares_the_pools_slot() -> None:
    assert freed_channel("qwen") == "kvguard:{qwen}:freed"
    assert key_slot(freed_channel("qwen").encode()) == key_slot(b"kvguard:{qwen}:leases")


async def test_a_subscription_cut_while_redis_stays_checks_its_pools(
    request: pytest.FixtureRequest,
) -> None:
    """Its connection killed (a proxy or an operator cut it), redis-py connects again at once:
    what was published meanwhile is lost, so the pools are checked, and it listens again."""
    redis = emptied_redis(request, "redis")
    one = Replica(redis.url)
    two = Replica(redis.url)
    try:
        await one.subscribed("p")
        assert redis.cli("client", "kill", "type", "pubsub").strip() == "1"
        await one.woken("p", 1)
        await wait_until(
            lambda: one.ledger.subscribed == {"p"}, "the subscription back", timeout_s=DEADLINE_S
        )
        reservation = await two.ledger.reserve(claim("l1", 4))
        assert reservation.lease is not None
        await two.ledger.release(reservation.lease)
        await one.woken("p", 2)
        assert one.freed == Counter({"p": 2})
    finally:
        await one.ledger.close()
        await two.ledger.close()


async def test_a_service_subscribes_its_policys_pools(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """kvguard serve on Redis: its queue is woken by the pools of the policy in force."""
    redis = emptied_redis(request, "redis")
    config = kvguard_config()
    config["ledger"] = {"url": redis.url, "lease_seconds": 60}
    service = Service(configs.load(write_config(tmp_path, config), environ={}))
    ledger = service.ledger
    assert isinstance(ledger, ResilientLedger)
    assert ledger.primary.on_freed == service.queue.notify
    await service.start()
    try:
        await wait_until(
            lambda: ledger.primary.subscribed == {"qwen"}, "qwen subscribed", timeout_s=DEADLINE_S
        )
        config["pools"][0]["name"] = "qwen-renamed"
        renamed = configs.load(write_config(tmp_path, config), environ={})
        service.publish(policies.build(renamed, {}))
        await wait_until(
            lambda: ledger.primary.subscribed == {"qwen-renamed"},
            lambda: f"qwen-renamed subscribed instead (subscribed: {ledger.primary.subscribed})",
            timeout_s=DEADLINE_S,
        )
    finally:
        await service.stop(0)


async def test_a_silent_subscription_counts_as_broken(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection whose peer went silent without closing it (its answers held back): a PING
    goes unanswered, the subscription is opened again, and the pool checked once it is."""
    monkeypatch.setattr(freed_module, "KEEPALIVE_S", 0.2)
    redis_server.flushall()
    freed: Counter[str] = Counter()

    def count(pool: str) -> None:
        freed[pool] += 1

    async with through_proxies(redis_server, on_freed=count) as (proxies, ledger):
        ledger.subscribe(["p"])
        await wait_until(lambda: ledger.subscribed == {"p"}, "p subscribed", timeout_s=DEADLINE_S)
        proxies.answers.clear()
        await wait_until(
            lambda: not ledger.subscribed, "the silent subscription to break", timeout_s=DEADLINE_S
        )
        assert freed == Counter()
        proxies.restore()
        await wait_until(lambda: freed["p"] == 1, "p checked again", timeout_s=DEADLINE_S)
        assert ledger.subscribed == {"p"}
