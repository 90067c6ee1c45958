"""`kvguard serve` as a real process for the tests: started, waited on, cleaned up."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
            deadline = time.monotonic() + 30
            while await health(port) != SERVING:
                assert process.returncode is None, log_path.read_text()
                assert time.monotonic() < deadline, "kvguard did not become ready"
                await asyncio.sleep(0.1)
            yield process
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
