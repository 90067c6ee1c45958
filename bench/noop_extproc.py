"""A no-op ext_proc server in grpc.aio (uvloop), with grpc.health.v1: every message answered
CONTINUE at once. bench_overhead.py --processor noop runs it in kvguard's place, to measure
what grpc.aio itself costs per request (the floor under kvguard's figures). bench_overhead.py
starts it with gRPC doing its I/O as in kvguard (kvguard/ops/grpc_io.py).

    .venv/bin/python bench/noop_extproc.py PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvguard.extproc import responses


class NoOp(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        async for message in requests:
            await context.write(responses.continue_response(str(message.WhichOneof("request"))))


async def main(port: int) -> None:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(NoOp(), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):  # Envoy asks the latter
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
