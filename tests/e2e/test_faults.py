"""Faults with real processes: a kvguard SIGKILLed under load, and clients that walk away at
random points of their streams. Nothing may stay reserved for longer than a lease."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.redis import RedisServer
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.gateway import gateway
from tests.processes import kvguard_serve

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Tell me a long story."}]}


@pytest.mark.redis
async def test_a_killed_kvguards_leases_come_back_within_the_lease_time(tmp_path: Path) -> None:
    lease_s = 2
    with RedisServer(tmp_path / "redis") as redis:
        port = free_port()
        data = kvguard_config(grpc_port=port)
        data["ledger"] = {"url": redis.url, "lease_seconds": lease_s}
        path = write_config(tmp_path, data)
        upstream = RecordingUpstream(token_delay=0.05)
        await upstream.start()
        ledger = RedisLedger.from_url(redis.url)
        try:
            async with (
                kvguard_serve(path, port, tmp_path / "kvguard.log") as process,
                EnvoyProcess(loopback_config(port, upstream.port), tmp_path) as envoy,
                aiohttp.ClientSession() as http,
            ):
                await envoy.wait_cluster_healthy("kvguard")
                streams = [
                    await http.post(
                        envoy.url + "/v1/chat/completions",
                        json={**CHAT, "stream": True, "max_tokens": 400},
                        headers={"x-tenant-id": f"t{i}"},
                    )
                    for i in range(4)
                ]
                assert [s.status for s in streams] == [200] * 4
                assert (await ledger.usage("qwen")).leases == 4
                process.send_signal(signal.SIGKILL)  # no drain, no release: a crash
                await process.wait()
                killed_at = time.monotonic()
                # failure_mode_allow: false: the streams kvguard was holding are cut off.
                for stream in streams:
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await stream.read()
                    stream.close()

                async def reclaimed() -> bool:
                    return (await ledger.usage("qwen")).reserved == 0

                await wait_until(reclaimed, "the leases to expire", timeout_s=lease_s + 3)
                assert time.monotonic() - killed_at <= lease_s + 3
                # And with kvguard gone, Envoy refuses instead of passing unmetered.
                async with http.post(
                    envoy.url + "/v1/chat/completions", json=CHAT, headers={"x-tenant-id": "t"}
                ) as response:
                    assert response.status == 503
                assert len(upstream.requests) == 4
        finally:
            await ledger.close()
            await upstream.stop()


async def test_clients_walking_away_at_random_points_leak_nothing(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    async with gateway(tmp_path, blocks=100000) as gw:
        gw.upstream.token_delay = 0.01

        async def client(i: int) -> None:
            give_up_after = rng.uniform(0.0, 0.3)  # before, during or after the decision
            body = {**CHAT, "stream": rng.random() < 0.7, "max_tokens": rng.randint(1, 60)}
            task = asyncio.create_task(
                gw.http.post(
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers={"x-tenant-id": f"t{i % 5}"},
                )
            )
            done, _ = await asyncio.wait({task}, timeout=give_up_after)
            if not done:
                task.cancel()
                return
            response = task.result()
            if rng.random() < 0.5:
                await response.content.read(rng.randint(1, 200))
            response.close()

        await asyncio.gather(*(client(i) for i in range(60)))

        async def all_released() -> bool:
            return await gw.reserved() == 0 and gw.service.keeper.open_leases == 0

        await wait_until(all_released, "every lease to be released", timeout_s=10)
        assert len(gw.upstream.requests) > 0  # some did get through before walking away
