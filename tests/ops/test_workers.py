"""`server.workers: 2`: two processes on one port sharing a real Redis ledger, supervised, and
one Prometheus endpoint for both, served by the supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.ops.workers import supervise
from kvguard.testing import free_port
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers
from tests.processes import SERVING, health

pytestmark = [pytest.mark.integration, pytest.mark.redis]

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}]}


def workers_of(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """metrics_listen's samples: (name, sorted labels) -> value."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(5)) as answer,
    ):
        assert answer.status == 200
        text = await answer.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


ADMITTED = (
    "kvguard_admissions_total",
    (("outcome", "admitted"), ("pool", "qwen"), ("reason", ""), ("tier", "pro")),
)
CAPACITY = ("kvguard_capacity_blocks", (("pool", "qwen"),))
RESTARTS = ("kvguard_worker_restarts_total", ())


async def admit(port: int) -> tuple[Any, grpc.aio.Channel]:
    """One admitted request, its stream left open (its lease held); a channel each: new
    connections spread over the workers."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call, (_, answer) = await exchange(
        pb_grpc.ExternalProcessorStub(channel), headers("/v1/chat/completions"), body(CHAT)
    )
    assert answer.WhichOneof("response") == "request_body"
    return call, channel


async def scraped(port: int, want: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
    """Wait until metrics_listen shows every sample of `want` at its value."""
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    async def shows() -> bool:
        nonlocal seen
        seen = await scrape(port)
        return all(seen.get(key) == value for key, value in want.items())

    await wait_until(
        shows, lambda: f"{want} at metrics_listen, saw {seen}", timeout_s=15, poll_s=0.2
    )


async def test_two_workers_share_the_port_the_ledger_and_the_metrics(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        port, metrics_port = free_port(), free_port()
        data = kvguard_config(
            grpc_port=port,
            workers=2,
            drain_seconds=2,
            metrics_listen=f"127.0.0.1:{metrics_port}",
        )
        data["ledger"] = {"url": redis.url, "lease_seconds": 30, "replicas": 2}
        path = write_config(tmp_path, data)
        log = (tmp_path / "kvguard.log").open("wb")
        supervisor = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvguard", "serve", "--config", str(path), stdout=log, stderr=log
        )
        ledger = RedisLedger.from_url(redis.url)
        try:

            async def ready() -> bool:
                return len(workers_of(supervisor.pid)) == 2 and await health(port) == SERVING

            await wait_until(ready, "two workers, SERVING", timeout_s=30, poll_s=0.1)
            calls = [await admit(port) for _ in range(8)]
            assert (await ledger.usage("qwen")).leases == 8  # one ledger for both workers
            # Both workers' admissions added up; the capacity both report, once.
            await scraped(metrics_port, {ADMITTED: 8, CAPACITY: 1000, RESTARTS: 0})

            victim = min(workers_of(supervisor.pid))
            os.kill(victim, signal.SIGKILL)

            async def replaced() -> bool:
                pids = workers_of(supervisor.pid)
                return len(pids) == 2 and victim not in pids

            await wait_until(replaced, "the killed worker replaced", timeout_s=30, poll_s=0.1)
            await wait_until(ready, "two workers, SERVING", timeout_s=30, poll_s=0.1)
            # The dead worker's admissions stay in the total (read before it died), and the
            # restart is counted: at the first scrape, no waiting.
            after = await scrape(metrics_port)
            assert (after[ADMITTED], after[CAPACITY], after[RESTARTS]) == (8, 1000, 1)
            calls += [await admit(port) for _ in range(4)]
            await scraped(metrics_port, {ADMITTED: 12, CAPACITY: 1000, RESTARTS: 1})
            for call, channel in calls:
                call.cancel()
                await channel.close()
            supervisor.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(supervisor.wait(), 30) == 0
            assert "starting it again" in (tmp_path / "kvguard.log").read_text()
        finally:
            if supervisor.returncode is None:
                supervisor.kill()
                await supervisor.wait()
            await ledger.close()
            log.close()


async def test_a_taken_metrics_listen_fails_before_any_worker_starts(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        data = kvguard_config(
            grpc_port=free_port(), workers=2, metrics_listen=f"127.0.0.1:{taken.getsockname()[1]}"
        )
        data["ledger"] = {"url": redis.url, "replicas": 2}
        path = write_config(tmp_path, data)
        supervisor = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvguard", "serve", "--config", str(path),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(supervisor.communicate(), 30)
        assert supervisor.returncode == 1
        assert f"error: {path}: server.metrics_listen: " in stderr.decode()
        assert "Address already in use" in stderr.decode()
        assert "supervising" not in stderr.decode()  # no worker was started


def test_workers_that_keep_dying_stop_the_supervisor_with_1() -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert supervise(2, lambda _, __: 3) == 1  # each worker exits 3 at once
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
