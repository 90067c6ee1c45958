"""The replica count `on_unavailable: local` divides the pool by: its sources (Redis's
registrations, the gateway Service's ready pods in DNS, a fixed floor), the count held through an
outage, and the process that never knew one; then the same over real redis-servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvguard.ledger import LedgerUnavailable, Outcome
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.replicas import REGISTRATION_TTL_S, ReplicaCount
from kvguard.ledger.resilient import ResilientLedger
from kvguard.ledger.scripts import REPLICAS_KEY
from kvguard.ops import replica_service
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.clock import Clock
from tests.ledger.conftest import DEADLINE_S, claim
from tests.ledger.proxies import proxied


def test_nothing_known_is_no_count() -> None:
    replicas = ReplicaCount()
    assert replicas.count is None
    replicas.resolved(0)  # no ready pod yet: tells nothing
    assert replicas.count is None


def test_the_larger_source_counts() -> None:
    replicas = ReplicaCount(clock=Clock())
    replicas.registered(3)
    assert replicas.count == 3
    replicas.resolved(4)  # DNS knows of a pod whose processes have not registered yet
    assert replicas.count == 4
    replicas.registered(6)
    assert replicas.count == 6


def test_a_fixed_count_is_a_floor() -> None:
    clock = Clock()
    replicas = ReplicaCount(2, clock=clock)
    assert replicas.count == 2
    replicas.registered(5)
    assert replicas.count == 5
    clock.now += REGISTRATION_TTL_S + 1
    replicas.registered(1)
    assert replicas.count == 2
    with pytest.raises(ValueError):
        ReplicaCount(0)


def test_a_known_count_is_at_least_this_pods_workers() -> None:
    replicas = ReplicaCount(own=4, clock=Clock())
    assert replicas.count is None  # nothing known yet
    replicas.registered(1)  # the first worker to register, before its siblings
    assert replicas.count == 4


def test_redis_counts_the_largest_heartbeat_of_the_last_ttl() -> None:
    """A Redis that restarted empty counts at first only the processes registered since: the
    others are still alive, and count until a TTL without them passed."""
    clock = Clock()
    replicas = ReplicaCount(clock=clock)
    replicas.registered(4)
    clock.now += 1
    replicas.registered(1)
    assert replicas.count == 4
    clock.now += REGISTRATION_TTL_S
    replicas.registered(2)  # two left for good
    assert replicas.count == 2


def test_an_outage_holds_the_count_and_dns_can_only_raise_it() -> None:
    clock = Clock()
    replicas = ReplicaCount(clock=clock)
    replicas.registered(4)
    replicas.resolved(4)
    replicas.outage(True)
    clock.now += 60  # a long outage: no heartbeat meanwhile
    replicas.resolved(2)  # pods unready during the outage: the shares do not grow
    assert replicas.count == 4
    replicas.resolved(6)  # pods started during the outage: the shares shrink
    assert replicas.count == 6


def test_the_held_count_stands_one_ttl_past_the_recovery() -> None:
    """Redis came back empty: the others register again within their heartbeat, and an outage
    again meanwhile must not find a count of 1."""
    clock = Clock()
    replicas = ReplicaCount(clock=clock)
    replicas.registered(4)
    replicas.outage(True)
    clock.now += 60
    replicas.outage(False)
    replicas.registered(1)  # the first to register again
    assert replicas.count == 4
    replicas.outage(True)  # down again at once
    assert replicas.count == 4
    replicas.outage(False)
    replicas.registered(2)
    clock.now += REGISTRATION_TTL_S
    replicas.registered(2)
    assert replicas.count == 2  # counted live again


def test_a_count_first_known_during_an_outage_is_used() -> None:
    replicas = ReplicaCount()
    replicas.outage(True)
    assert replicas.count is None
    replicas.resolved(3)
    assert replicas.count == 3


async def test_dns_counts_the_pods_times_workers_this_pod_included() -> None:
    answers: dict[str, list[str] | OSError] = {"gw": ["127.0.0.2", "127.0.0.3"]}

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    assert await replica_service.count("gw", 4, resolver, own={"127.0.0.2"}) == 8
    # This pod, not ready yet, is not in the answer; an address unknown counts as one more.
    assert await replica_service.count("gw", 4, resolver, own={"127.0.0.9"}) == 12
    assert await replica_service.count("gw", 4, resolver, own=set()) == 12
    answers["gw"] = OSError("no DNS")
    assert await replica_service.count("gw", 4, resolver, own={"127.0.0.2"}) is None
    answers["gw"] = []  # nothing ready, or a misspelt name: tells nothing
    assert await replica_service.count("gw", 4, resolver, own={"127.0.0.2"}) == 0


async def test_dns_counts_reach_the_replica_count() -> None:
    pods = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]

    async def resolver(host: str, port: int) -> list[str]:
        # This pod is 127.0.0.2 (its hostname, from /etc/hosts in a pod).
        return list(pods) if host == "gw" else ["127.0.0.2"]

    replicas = ReplicaCount()
    watching = asyncio.ensure_future(
        replica_service.watch("gw", 2, replicas.resolved, resolver=resolver, interval_s=0.01)
    )
    try:
        await wait_until(lambda: replicas.count == 6, "3 pods x 2 workers", timeout_s=DEADLINE_S)
        pods.pop()  # a pod went away
        await wait_until(lambda: replicas.count == 4, "2 pods x 2 workers", timeout_s=DEADLINE_S)
    finally:
        watching.cancel()


# -- over real redis-servers -------------------------------------------------------------------


@pytest.mark.redis
async def test_replicas_count_each_other_in_redis_and_leave_on_close(
    redis_server: RedisServer,
) -> None:
    redis_server.flushall()
    clock = Clock()  # the count's window of heartbeats; Redis keeps its own time
    one = ResilientLedger(connect(redis_server.url), replicas=ReplicaCount(clock=clock))
    two = ResilientLedger(connect(redis_server.url), replicas=ReplicaCount())
    try:
        await one.start()
        assert one.replicas.count == 1  # registered at start
        await two.start()
        assert two.replicas.count == 2
        await wait_until(
            lambda: one.replicas.count == 2, "one's heartbeat to count two", timeout_s=DEADLINE_S
        )
        await two.close()
        clock.now += REGISTRATION_TTL_S + 1  # the heartbeats that counted two are past
        await wait_until(
            lambda: one.replicas.count == 1, "one's heartbeat to count itself", timeout_s=DEADLINE_S
        )
    finally:
        await one.close()
        await two.close()
    direct = RedisLedger.from_url(redis_server.url)
    try:
        assert await direct._client.zcard(REPLICAS_KEY) == 0  # both left
    finally:
        await direct.close()


@pytest.mark.redis
async def test_an_outage_shares_the_pool_by_the_last_count(redis_server: RedisServer) -> None:
    redis_server.flushall()
    clock = Clock()
    other = ResilientLedger(connect(redis_server.url), replicas=ReplicaCount())
    async with proxied(redis_server) as (proxies, client):
        ledger = ResilientLedger(
            client,
            on_unavailable="local",
            replicas=ReplicaCount(clock=clock),
            probe_interval_s=0.02,
        )
        try:
            await other.start()
            await ledger.start()
            assert ledger.replicas.count == 2
            proxies.cut()
            await wait_until(
                lambda: not ledger.reachable, "Redis to count as unreachable", timeout_s=DEADLINE_S
            )
            await other.close()  # gone from Redis; the cut-off process cannot know
            # This process's share is 100 // 2 = 50 blocks.
            first = await ledger.reserve(claim("A", 50, limit=100, quota=100))
            assert first.outcome is Outcome.ADMITTED
            second = await ledger.reserve(claim("B", 1, tenant="b", limit=100, quota=100))
            assert second.outcome is Outcome.POOL_WATERMARK
            assert ledger.replicas.count == 2
            proxies.restore()
            await wait_until(lambda: ledger.reachable, "Redis to be back", timeout_s=DEADLINE_S)
            assert ledger.replicas.count == 2  # held one TTL past the recovery
            clock.now += REGISTRATION_TTL_S + 1
            await wait_until(
                lambda: ledger.replicas.count == 1, "a live count again", timeout_s=DEADLINE_S
            )
        finally:
            await ledger.close()
            await other.close()


@pytest.mark.redis
async def test_a_process_that_never_knew_a_count_refuses(tmp_path: Path) -> None:
    never_started = RedisServer(tmp_path / "redis")  # its port refuses connections
    replicas = ReplicaCount()
    ledger = ResilientLedger(
        connect(never_started.url),
        on_unavailable="local",
        replicas=replicas,
        probe_interval_s=30,
    )
    try:
        await ledger.start()
        assert not ledger.reachable
        with pytest.raises(LedgerUnavailable, match="never known"):
            await ledger.reserve(claim("A", 1, limit=100, quota=100))
        replicas.resolved(4)  # the gateway Service answered in DNS: 4 processes
        admitted = await ledger.reserve(claim("B", 25, limit=100, quota=100))
        assert admitted.outcome is Outcome.ADMITTED
        refused = await ledger.reserve(claim("C", 1, tenant="c", limit=100, quota=100))
        assert refused.outcome is Outcome.POOL_WATERMARK
    finally:
        await ledger.close()


@pytest.mark.redis
async def test_the_registry_counts_live_registrations_on_every_backend(
    redis_ledger: tuple[object, RedisLedger],
) -> None:
    _, ledger = redis_ledger
    assert await ledger.register("a", 30) == 1
    assert await ledger.register("b", 30) == 2
    assert await ledger.register("a", 30) == 2  # a heartbeat renews, it adds nobody
    assert await ledger.register("c", 0.001) == 3
    now = await ledger.time()

    async def expired() -> bool:
        return await ledger.time() > now + 0.01

    await wait_until(expired, "Redis TIME past c's registration", timeout_s=DEADLINE_S)
    assert await ledger.register("a", 30) == 2  # c expired
    assert await ledger.register("b", 0) == 1  # b left
