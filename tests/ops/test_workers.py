"""`server.workers: 2`: two processes on one port sharing a real Redis ledger, supervised."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard.ledger.redis_ledger import RedisLedger
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


async def test_two_workers_share_the_port_and_the_ledger(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        port = free_port()
        data = kvguard_config(grpc_port=port, workers=2, drain_seconds=2)
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
            calls = []
            for _ in range(8):  # a channel each: new connections spread over the workers
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                call, (_, answer) = await exchange(
                    pb_grpc.ExternalProcessorStub(channel),
                    headers("/v1/chat/completions"),
                    body(CHAT),
                )
                assert answer.WhichOneof("response") == "request_body"
                calls.append((call, channel))
            assert (await ledger.usage("qwen")).leases == 8  # one ledger for both workers

            victim = min(workers_of(supervisor.pid))
            os.kill(victim, signal.SIGKILL)

            async def replaced() -> bool:
                pids = workers_of(supervisor.pid)
                return len(pids) == 2 and victim not in pids

            await wait_until(replaced, "the killed worker replaced", timeout_s=30, poll_s=0.1)
            await wait_until(ready, "two workers, SERVING", timeout_s=30, poll_s=0.1)
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
