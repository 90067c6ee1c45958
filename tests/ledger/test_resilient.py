"""The ResilientLedger over a real redis-server that a proxy cuts off or holds back: what it
admits when Redis is unreachable, what it replays when Redis is back, how it watches, and how
a lease that grew keeps its blocks across an outage or a restart."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvguard.admission.leases import LeaseKeeper
from kvguard.ledger import LedgerUnavailable, Outcome
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.resilient import ResilientLedger, local_share
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.ledger.conftest import DEADLINE_S, PATIENT_S, claim, until_usage
from tests.ledger.proxies import proxied, reserve_then_cancel


def test_the_local_share_rounds_down() -> None:
    assert [local_share(850, r) for r in (1, 2, 3, 1000)] == [850, 425, 283, 0]


@pytest.mark.redis
async def test_a_cancelled_reserves_release_that_cannot_reach_redis_is_replayed(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    async with proxied(redis_server) as (proxies, client):
        ledger = ResilientLedger(client, probe_interval_s=0.02)
        try:
            await ledger.start()
            await reserve_then_cancel(ledger, proxies, direct)
            proxies.cut()  # before the release's answer: it cannot reach Redis
            await wait_until(
                lambda: not ledger.reachable, "Redis to count as unreachable", timeout_s=DEADLINE_S
            )
            assert (await direct.usage("p")).reserved == 10
            proxies.restore()
            await until_usage(direct, 0, 0)  # replayed on recovery
            assert ledger.reachable
        finally:
            await ledger.close()


@pytest.mark.redis
async def test_a_lease_redis_admits_after_the_flip_to_local_counts_in_the_local_share(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    async with proxied(redis_server) as (proxies, client):
        ledger = ResilientLedger(
            client, on_unavailable="local", replicas=2, probe_interval_s=30, heartbeat_s=30
        )
        try:
            await ledger.start()
            proxies.answers.clear()
            first = claim("B", 40, tenant="b", limit=100, quota=100)
            reserving = asyncio.ensure_future(ledger.reserve(first))
            await until_usage(direct, 40, 1)  # admitted in Redis; the answer is on its way
            # Meanwhile another call finds Redis unreachable (each failed call does this).
            ledger._went_down(LedgerUnavailable("another call timed out"))
            proxies.answers.set()
            assert (await reserving).outcome is Outcome.ADMITTED
            # This process's share is 100 // 2 = 50 blocks, and B holds 40 of them.
            second = await ledger.reserve(claim("C", 20, tenant="c", limit=100, quota=100))
            assert second.outcome is Outcome.POOL_WATERMARK
        finally:
            await ledger.close()


@pytest.mark.redis
async def test_a_lease_released_while_a_pool_reset_reasserts_is_released_again(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    """Redis restarted empty: the pool's open leases are re-asserted; one whose stream ended
    while that script waited to be sent was recorded again, and the script's answer was lost."""
    async with proxied(redis_server) as (proxies, client):
        keeper: LeaseKeeper
        ledger = ResilientLedger(
            client, open_leases=lambda: keeper.snapshot(), probe_interval_s=0.02, heartbeat_s=30
        )
        keeper = LeaseKeeper(ledger, 60)
        primary = ledger.primary
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
            await until_usage(direct, 20, 2)  # both recorded again
            proxies.cut()
            await wait_until(
                lambda: not ledger.reachable, "the re-assert to fail", timeout_s=DEADLINE_S
            )  # answer lost
            primary._run = run  # type: ignore[method-assign]
            proxies.restore()
            await until_usage(direct, 10, 1)  # released again on recovery
            assert [lease.lease_id for lease in keeper.snapshot()] == ["open"]
        finally:
            await ledger.close()


@pytest.mark.redis
async def test_a_reassert_after_a_redis_restart_keeps_a_grown_lease(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        keeper: LeaseKeeper
        ledger = ResilientLedger(
            connect(redis.url, timeout_s=PATIENT_S),
            open_leases=lambda: keeper.snapshot(),
            probe_interval_s=0.02,
            heartbeat_s=0.05,
        )
        keeper = LeaseKeeper(ledger, 60)
        view = RedisLedger.from_url(redis.url, timeout_s=PATIENT_S)
        try:
            await ledger.start()
            lease = (await ledger.reserve(claim("L", 10))).lease
            assert lease is not None
            grown = replace(lease, blocks=70)  # past the quota (60): growth is always granted
            keeper.hold(grown)
            assert await keeper.renew_all() == 0
            await until_usage(view, 70, 1)
            await asyncio.to_thread(redis.restart)  # empty, on the same port
            await until_usage(view, 70, 1)  # re-asserted by the watcher, grown
            assert (await view.usage("p")).tenants == {"a": 70}
            keeper.release(grown)
            await keeper.settle()
            await until_usage(view, 0, 0)
        finally:
            await view.close()
            await ledger.close()


@pytest.mark.redis
async def test_growth_during_an_outage_reaches_the_local_ledger_then_redis(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    async with proxied(redis_server) as (proxies, client):
        keeper: LeaseKeeper
        ledger = ResilientLedger(
            client,
            on_unavailable="local",
            open_leases=lambda: keeper.snapshot(),
            probe_interval_s=0.02,
            heartbeat_s=30,
        )
        keeper = LeaseKeeper(ledger, 60)
        try:
            await ledger.start()
            before = (await ledger.reserve(claim("A", 10, tenant="a"))).lease  # in Redis
            assert before is not None
            keeper.hold(before)
            proxies.cut()
            during = (await ledger.reserve(claim("B", 10, tenant="b"))).lease  # taken locally
            assert not ledger.reachable and during is not None
            keeper.hold(during)
            for lease, blocks in ((before, 40), (during, 25)):
                keeper.hold(replace(lease, blocks=blocks))
            assert await keeper.renew_all() == 0
            local = await ledger.usage("p")
            assert (local.reserved, local.tenants) == (65, {"a": 40, "b": 25})
            assert (await direct.usage("p")).reserved == 10  # Redis has not seen it yet
            keeper.hold(replace(during, blocks=30))  # grown again, not re-asserted yet
            proxies.restore()
            await wait_until(lambda: ledger.reachable, "Redis to be back", timeout_s=DEADLINE_S)
            # Recovery sends the keeper's leases as they are now, not the copy taken locally.
            usage = await direct.usage("p")
            assert (usage.reserved, usage.leases, usage.tenants) == (70, 2, {"a": 40, "b": 30})
            for lease in keeper.snapshot():
                keeper.release(lease)
            await keeper.settle()
            await until_usage(direct, 0, 0)
        finally:
            await ledger.close()


@pytest.mark.redis
async def test_an_outage_an_operation_finds_is_probed_at_once_not_after_the_heartbeat(
    redis_server: RedisServer,
) -> None:
    redis_server.flushall()
    async with proxied(redis_server) as (proxies, client):
        ledger = ResilientLedger(client, probe_interval_s=0.02, heartbeat_s=3600)
        try:
            await ledger.start()  # the watcher sleeps for its heartbeat
            proxies.cut()
            with pytest.raises(LedgerUnavailable):
                await ledger.reserve(claim("A", 1))
            proxies.restore()
            await wait_until(
                lambda: ledger.reachable,
                "a probe (every 0.02 s, not in an hour)",
                timeout_s=DEADLINE_S,
            )
        finally:
            await ledger.close()


@pytest.mark.redis
async def test_close_leaves_no_watcher_behind(
    redis_server: RedisServer, direct: RedisLedger
) -> None:
    """A cancelled reserve's release fails while close() waits for it: Redis is then seen
    unreachable, and nothing may start watching it again."""
    async with proxied(redis_server) as (proxies, client):
        ledger = ResilientLedger(client, probe_interval_s=0.02)
        await ledger.start()
        await reserve_then_cancel(ledger, proxies, direct)  # its release waits for an answer
        closing = asyncio.ensure_future(ledger.close())
        # close() stops the watcher, then waits for the release.
        await wait_until(
            lambda: ledger._watcher is None, "close() to stop the watcher", timeout_s=DEADLINE_S
        )
        proxies.cut()
        await closing
        assert not ledger.reachable  # the release failed
        assert ledger._watcher is None


@pytest.mark.redis
async def test_renewing_a_released_lease_locally_does_not_bring_it_back(tmp_path: Path) -> None:
    never_started = RedisServer(tmp_path / "redis")  # its port refuses connections
    ledger = ResilientLedger(
        connect(never_started.url), on_unavailable="local", probe_interval_s=30
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
