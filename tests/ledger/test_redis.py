"""What only the Redis ledger has, on a real redis-server and a real Redis Cluster: scripts
that name their keys, one round trip per operation (growing leases too), releases batched per
pool, NOSCRIPT recovery, epochs that reveal a Redis which restarted empty, and fast failure."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvguard.ledger import Lease, Ledger, LedgerUnavailable, Outcome
from kvguard.ledger import redis_ledger as redis_ledger_module
from kvguard.ledger.redis_ledger import RedisLedger, connect
from kvguard.ledger.scripts import load_script, pool_keys
from kvguard.testing.redis import RedisCluster, RedisServer
from kvguard.testing.wait import wait_until
from tests.ledger.conftest import PATIENT_S, claim, until_usage
from tests.ledger.proxies import reserve_then_cancel, through_proxies
from tests.ledger.redis_stats import commandstats, reset_stats


def test_scripts_name_their_keys_arguments_and_return_value() -> None:
    for name in ("reserve", "release", "renew", "reassert", "usage"):
        script = load_script(name)
        header = script.source.split("--#include", 1)[0]
        assert header.startswith(f"-- {name}:"), name
        for word in ("KEYS", "ARGV", "Returns"):
            assert word in header, (name, word)
        lines = script.source.splitlines()
        assert not any(line.startswith("--#include") for line in lines)  # expanded
        assert "local function reclaim" in script.source


def test_every_key_of_a_pool_shares_its_hash_tag() -> None:
    keys = pool_keys("qwen-7b")
    assert len(set(keys)) == 5
    assert all(key.split("{", 1)[1].split("}", 1)[0] == "qwen-7b" for key in keys)


async def test_one_round_trip_per_admission_and_per_release(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    await ledger.start()  # scripts registered once per client
    await ledger.usage("p")  # connections opened, cluster slots discovered
    reset_stats(redis)
    lease = (await ledger.reserve(claim("1", 10))).lease
    assert lease is not None
    await ledger.release(lease)
    stats = commandstats(redis)
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


async def test_renewing_many_leases_is_one_call_per_pool(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    leases = await _leases_in_two_pools(ledger, 30)
    reset_stats(redis)
    assert await ledger.reassert(leases, 30) == 0
    assert commandstats(redis).get("evalsha") == 2


async def test_growing_leases_takes_one_call_per_pool_and_a_flush_keeps_the_growth(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    grown = [replace(lease, blocks=3) for lease in await _leases_in_two_pools(ledger, 10)]
    reset_stats(redis)
    assert await ledger.reassert(grown, 30) == 0
    assert commandstats(redis).get("evalsha") == 2
    redis.flushall()  # what a restart without persistence leaves
    assert await ledger.reassert(grown, 30) == 10  # recorded again, grown
    for pool in "pq":
        usage = await ledger.usage(pool)
        assert (usage.reserved, usage.leases, usage.tenants) == (15, 5, {"a": 15})


async def test_releases_that_queue_up_go_in_one_call_per_pool(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    leases = await _leases_in_two_pools(ledger, 40)
    reset_stats(redis)
    # Started together, every release queues before the first call goes out.
    await asyncio.gather(*(ledger.release(lease) for lease in leases))
    assert commandstats(redis).get("evalsha") == 2
    for pool in "pq":
        usage = await ledger.usage(pool)
        assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})
    reset_stats(redis)
    await asyncio.gather(*(ledger.release(lease) for lease in leases[:5]))  # idempotent
    assert commandstats(redis).get("evalsha") == 2
    assert (await ledger.usage("p")).reserved == 0


async def test_a_long_queue_of_releases_goes_in_bounded_calls(
    redis_ledger: tuple[Any, RedisLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    redis, ledger = redis_ledger
    monkeypatch.setattr(redis_ledger_module, "LEASES_PER_CALL", 4)
    leases = await _leases_in_two_pools(ledger, 20)
    reset_stats(redis)
    await asyncio.gather(*(ledger.release(lease) for lease in leases))
    assert commandstats(redis).get("evalsha") == 2 * 3  # 10 leases a pool: 4 + 4 + 2
    assert [(await ledger.usage(pool)).reserved for pool in "pq"] == [0, 0]


async def test_a_release_waits_for_the_call_in_flight_then_goes_in_the_next(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    first, second, third = [
        (await ledger.reserve(claim(str(i), 5, quota=100))).lease for i in range(3)
    ]
    assert first is not None and second is not None and third is not None
    reset_stats(redis)
    releasing = asyncio.ensure_future(ledger.release(first))
    # Its call is on its way: taken from the queue, its answer not yet back.
    await wait_until(
        lambda: "p" in ledger._releasing and "p" not in ledger._queued_releases,
        "the first release's call to go out",
        poll_s=0,  # every turn of the event loop: the answer must not arrive before the check
    )
    await asyncio.gather(ledger.release(second), ledger.release(third), releasing)
    assert commandstats(redis).get("evalsha") == 2
    assert (await ledger.usage("p")).reserved == 0


async def test_a_reserve_cancelled_after_its_script_ran_leaves_no_lease(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, direct = redis_ledger
    async with through_proxies(redis) as (proxies, ledger):
        await ledger.start()  # connections open, scripts registered, slots discovered
        await reserve_then_cancel(ledger, proxies, direct)
        proxies.answers.set()
        await until_usage(direct, 0, 0)  # the ledger released it itself


async def test_a_redis_without_the_scripts_runs_them_anyway(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, ledger = redis_ledger
    await ledger.start()
    for node in redis.nodes if isinstance(redis, RedisCluster) else [redis]:
        node.cli("script", "flush")
    reset_stats(redis)
    assert (await ledger.reserve(claim("1", 10))).outcome is Outcome.ADMITTED
    assert (await ledger.reserve(claim("2", 10))).outcome is Outcome.ADMITTED
    stats = commandstats(redis)
    # NOSCRIPT once, then EVAL (which caches it), then EVALSHA again.
    assert (stats.get("evalsha"), stats.get("eval")) == (2, 1), stats
    assert (await ledger.usage("p")).reserved == 20


async def test_a_pool_whose_state_vanished_is_reported_once(
    redis_ledger: tuple[Any, RedisLedger],
) -> None:
    redis, _ = redis_ledger
    resets: list[str] = []
    cluster = isinstance(redis, RedisCluster)
    client = connect(redis.url, cluster=cluster, timeout_s=PATIENT_S)
    ledger = RedisLedger(client, on_reset=resets.append)
    try:
        await ledger.reserve(claim("1", 10, pool="p"))
        await ledger.reserve(claim("2", 10, pool="q"))
        await ledger.check(["p", "q"])
        assert resets == []
        redis.flushall()  # what a restart without persistence leaves
        await ledger.check(["p"])
        assert resets == ["p"]
        await ledger.reserve(claim("3", 10, pool="q"))  # a new epoch, written by this reserve
        assert resets == ["p", "q"]
    finally:
        await ledger.close()


@pytest.mark.redis  # its server is never started, but RedisServer needs the binary
async def test_redis_errors_are_fast_and_unavailable(tmp_path: Path) -> None:
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
