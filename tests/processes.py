"""`kvguard serve` as a real process for the tests: started, waited on, cleaned up; alone, or
behind the real Envoy with a client for requests through it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(port: int, service: str = "") -> int:
    """The grpc.health.v1 status of `service`, or -1 when nothing answers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.aio.AioRpcError:
            return -1
        return int(answer.status)


@asynccontextmanager
async def kvguard_serve(
    config: Path, port: int, log_path: Path, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`kvguard serve --config CONFIG` (in `env`, when given), ready (SERVING on `port`) when
    yielded; killed after unless the test ended it itself."""
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvguard", "serve", "--config", str(config),
            stdout=log, stderr=log, env=env,
        )  # fmt: skip
        try:

            async def ready() -> bool:
                assert process.returncode is None, log_path.read_text()
                return await health(port) == SERVING

            await wait_until(ready, "kvguard to become ready", timeout_s=30, poll_s=0.1)
            yield process
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


@dataclass
class Served:
    """A running `kvguard serve`, the Envoy in front of it, and a client session."""

    process: asyncio.subprocess.Process
    envoy: EnvoyProcess
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        """Envoy's listener: where clients send their requests."""
        return self.envoy.url


@asynccontextmanager
async def kvguard_behind_envoy(
    config: Path, port: int, upstream: RecordingUpstream, log_path: Path, workdir: Path
) -> AsyncIterator[Served]:
    """kvguard_serve(config, port, log_path) as the ext_proc service of the real Envoy (its
    files in `workdir`) in front of `upstream`, yielded once Envoy sees kvguard healthy. After,
    the client and Envoy close, and the process is killed unless the test ended it."""
    async with (
        kvguard_serve(config, port, log_path) as process,
        EnvoyProcess(loopback_config(port, upstream.port), workdir) as envoy,
        aiohttp.ClientSession() as http,
    ):
        await envoy.wait_cluster_healthy("kvguard")
        yield Served(process, envoy, http)
