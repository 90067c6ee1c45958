"""Redis goes away under load and comes back empty: each `on_unavailable` mode, end to end.

A real kvguard Service runs in this process on a real redis-server, driven over real ext_proc
gRPC streams as Envoy drives it. Some streams stay open across the outage (their leases must
survive it); a load of short exchanges keeps running while redis-server is stopped and started
again on the same port. Then: reject answers 503 ledger_unavailable and turns NOT_SERVING;
allow passes requests without a lease; local admits against capacity/replicas; and once Redis
is back, the ledger holds exactly the leases of the streams still open.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvguard import config as configs
from kvguard.app import Service
from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.ledger.resilient import ResilientLedger, local_share
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import (
    body,
    exchange,
    headers,
    refusal,
    response_headers,
    set_headers,
)

pytestmark = [pytest.mark.integration, pytest.mark.redis]

BLOCKS = 1000
WATERMARK = 0.15
LIMIT = 850  # floor(1000 x 0.85)
REPLICAS = 2
TIERS = {
    "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 1000},
    "pro": {"max_tokens_cap": 2048, "default_max_tokens": 128, "max_blocks": 2000},
}
BIG = 1600  # max_tokens of a held stream: about 100 blocks
SMALL = 10  # max_tokens of the load's exchanges: 2 blocks
LOAD_LIMIT = 3000  # the load stops by itself after this many exchanges
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "qwen",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hello in French."}],
    }


@dataclass
class Kvguard:
    service: Service
    stub: Any
    health: Any

    @property
    def ledger(self) -> ResilientLedger:
        assert isinstance(self.service.ledger, ResilientLedger)
        return self.service.ledger

    async def readiness(self, name: str = "") -> int:
        answer = await self.health.Check(health_pb2.HealthCheckRequest(service=name))
        return int(answer.status)


@asynccontextmanager
async def kvguard(tmp_path: Path, redis_url: str, mode: str) -> AsyncIterator[Kvguard]:
    config = kvguard_config(blocks=BLOCKS, watermark=WATERMARK, tiers=TIERS)
    # The load's clients never retry after a 429: a promise would hold their blocks meanwhile
    # (tests/ledger/test_promises.py covers promises).
    config["pools"][0]["retry_after_max_seconds"] = 0
    config["ledger"] = {
        "url": redis_url,
        "lease_seconds": 60,
        "on_unavailable": mode,
        "replicas": REPLICAS,
    }
    folder = tmp_path / f"kvguard-{mode}-{time.monotonic_ns()}"
    folder.mkdir()
    service = Service(configs.load(write_config(folder, config), environ={}))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    try:
        yield Kvguard(
            service,
            pb_grpc.ExternalProcessorStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
    finally:
        await channel.close()
        await service.stop(0)


@dataclass
class Stream:
    """An admitted exchange kept open: its lease lives until `end`."""

    call: Any
    blocks: int
    lease: str | None

    async def end(self) -> None:
        await self.call.write(response_headers(200))
        await self.call.read()
        await self.call.done_writing()
        assert await self.call.read() == grpc.aio.EOF


async def open_stream(stub: Any, max_tokens: int = BIG) -> Stream | tuple[int, str]:
    """Admitted: a Stream; refused: (status, reason)."""
    call, (_, answer) = await exchange(
        stub, headers("/v1/chat/completions"), body(chat(max_tokens))
    )
    while answer.HasField("override_message_timeout"):
        answer = await call.read()  # a slow decision (a loaded machine) asked Envoy to wait
    if answer.WhichOneof("response") == "immediate_response":
        status, hdrs, _ = refusal(answer)
        call.cancel()
        return status, hdrs["x-kvguard-reason"]
    sent = set_headers(answer.request_body.response)
    return Stream(call, int(sent["x-kvguard-blocks"]), sent.get("x-kvguard-lease"))


@dataclass
class Load:
    """Short exchanges, one after another on a few lanes, until stopped (bounded in count)."""

    stub: Any
    outcomes: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, lanes: int = 4) -> None:
        self._tasks = [asyncio.create_task(self._lane()) for _ in range(lanes)]

    async def _lane(self) -> None:
        while not self._stop.is_set() and sum(self.outcomes.values()) < LOAD_LIMIT:
            started = time.monotonic()
            result = await open_stream(self.stub, SMALL)
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
            if isinstance(result, Stream):
                self.outcomes["admitted" if result.lease else "passed_without_lease"] += 1
                await result.end()
            else:
                self.outcomes[result[1]] += 1

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def wait_for(self, outcome: str, count: int = 3) -> None:
        before = self.outcomes[outcome]

        async def seen() -> bool:
            for task in self._tasks:
                if task.done():
                    task.result()  # a lane that failed fails the test with its own error
            return self.outcomes[outcome] >= before + count

        await wait_until(seen, f"{count} more {outcome} outcomes", timeout_s=10)


async def redis_usage(url: str) -> tuple[int, int]:
    """(blocks, leases) of pool qwen, read from Redis itself."""
    ledger = RedisLedger.from_url(url)
    try:
        usage = await ledger.usage("qwen")
        return usage.reserved, usage.leases
    finally:
        await ledger.close()


async def converge(url: str, streams: list[Stream]) -> None:
    """Wait until Redis holds exactly the leases of `streams`."""
    want = (sum(s.blocks for s in streams), sum(1 for s in streams if s.lease))

    held: tuple[int, int] | None = None

    async def equal() -> bool:
        nonlocal held
        held = await redis_usage(url)
        return held == want

    await wait_until(
        equal,
        lambda: f"Redis to hold the open streams' {want} (blocks, leases); it holds {held}",
        timeout_s=10,
    )


@pytest.mark.parametrize("mode", ["reject", "allow", "local"])
async def test_redis_outage_under_load(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvguard.ledger.resilient")
    with RedisServer(tmp_path / "redis") as redis:
        async with kvguard(tmp_path, redis.url, mode) as kv:
            held = [await open_stream(kv.stub) for _ in range(2)]
            assert all(isinstance(s, Stream) and s.lease for s in held), held
            streams: list[Stream] = [s for s in held if isinstance(s, Stream)]
            load = Load(kv.stub)
            load.start()
            await load.wait_for("admitted")
            assert await kv.readiness() == _SERVING

            await asyncio.to_thread(redis.stop)

            async def unreachable() -> bool:
                return not kv.service.health.snapshot()["ledger"]

            await wait_until(unreachable, "the ledger to be unreachable", timeout_s=5)
            assert await kv.readiness("liveness") == _SERVING
            if mode == "reject":
                await wait_until(lambda: _is(kv, _NOT_SERVING), "readiness to turn NOT_SERVING")
                await load.wait_for("ledger_unavailable")
                started = time.monotonic()
                assert await open_stream(kv.stub) == (503, "ledger_unavailable")
                assert time.monotonic() - started < 1.0
            elif mode == "allow":
                assert await kv.readiness() == _SERVING
                await load.wait_for("passed_without_lease")
                passed = await open_stream(kv.stub)
                assert isinstance(passed, Stream) and passed.lease is None and passed.blocks > 0
                await passed.end()
            else:
                assert await kv.readiness() == _SERVING
                await load.stop()  # the local share is easier to read without it
                share = local_share(LIMIT, REPLICAS)
                for _ in range(20):
                    result = await open_stream(kv.stub)
                    if not isinstance(result, Stream):
                        assert result == (429, "kv_cache_watermark_exceeded")
                        break
                    assert result.lease is not None
                    streams.append(result)
                local = await kv.ledger.usage("qwen")
                # The two streams from before the outage count against this process's share.
                assert local.reserved == sum(s.blocks for s in streams)
                assert share - streams[-1].blocks < local.reserved <= share
                assert len(streams) > len(held)
                load = Load(kv.stub)
                load.start()
                await load.wait_for("admitted")

            await asyncio.to_thread(redis.start)  # empty, on the same port

            async def reachable() -> bool:
                return bool(kv.service.health.snapshot()["ledger"])

            await wait_until(reachable, "the ledger to be reachable again", timeout_s=10)
            assert await kv.readiness() == _SERVING
            await load.wait_for("admitted")
            await load.stop()
            await kv.service.keeper.settle()
            # Every lease of a stream still open, each once; nothing of the ended ones.
            await converge(redis.url, streams)
            print(f"\n{mode}: load outcomes {dict(load.outcomes)}, errors {kv.ledger.errors}")

            for stream in streams:
                await stream.end()
            await converge(redis.url, [])

            # Logged once per transition, not per request (a loaded machine may see a timeout
            # that makes one more outage; each is logged once, begin and end).
            outages = kv.ledger.outages
            assert outages >= 1 and kv.ledger.errors > outages
            messages = [r.getMessage() for r in caplog.records]
            assert sum("Redis unreachable" in m for m in messages) == outages, messages
            assert sum("Redis reachable again" in m for m in messages) == outages, messages
            assert load.slowest_s < 2.0


async def _is(kv: Kvguard, status: int) -> bool:
    return await kv.readiness() == status


async def test_a_quick_restart_converges_through_every_replica(tmp_path: Path) -> None:
    """Redis restarts empty between two requests (no error seen): each replica notices the
    pool's epoch is gone and re-asserts its open leases, with no traffic at all."""
    with RedisServer(tmp_path / "redis") as redis:
        async with (
            kvguard(tmp_path, redis.url, "reject") as one,
            kvguard(tmp_path, redis.url, "reject") as two,
        ):
            streams = []
            for kv in (one, one, two):
                stream = await open_stream(kv.stub)
                assert isinstance(stream, Stream)
                streams.append(stream)
            await converge(redis.url, streams)
            await asyncio.to_thread(redis.restart)
            await converge(redis.url, streams)  # within the 1 s heartbeat
            assert (await one.ledger.usage("qwen")).reserved == sum(s.blocks for s in streams)
            for stream in streams:
                await stream.end()
            await converge(redis.url, [])
