"""Drive a kvguard Service in this process over a real gRPC stream, as Envoy would."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.app import Service
from kvguard.extproc.observe import DEFAULT_SAMPLE
from kvguard.ops.telemetry import Providers
from tests.conftest import kvguard_config, write_config


@asynccontextmanager
async def running(
    tmp_path: Path,
    *,
    providers: Providers | None = None,
    watch: bool = False,
    reload_interval_s: float = 0.05,
    pool: dict[str, Any] | None = None,
    response_sample: float = DEFAULT_SAMPLE,
    more_pools: list[dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[Service, Any]]:
    """A started Service on a free port and an ext_proc stub; `watch` enables hot reload;
    `pool` holds extra keys for the first pool, and each of `more_pools` is the first pool's
    settings with its own keys; `response_sample` is the share of exchanges (with a request
    id) whose response is read."""
    data = kvguard_config(**overrides)
    data["pools"][0].update(pool or {})
    data["pools"] += [{**data["pools"][0], **more} for more in more_pools or []]
    path = write_config(tmp_path, data)
    service = Service(
        configs.load(path, environ={}),
        config_path=path if watch else None,
        providers=providers,
        reload_interval_s=reload_interval_s,
        response_sample=response_sample,
    )
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    try:
        yield service, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await service.stop(0)


def headers(
    path: str,
    extra: dict[str, str] | None = None,
    *,
    eos: bool = False,
    tenant: str | None = "acme",
) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": path, "content-type": "application/json"}
    if tenant is not None:
        values["x-tenant-id"] = tenant
    values.update(extra or {})
    header_map = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=eos)
    )


def body(payload: Any) -> pb.ProcessingRequest:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def response_headers(status: int) -> pb.ProcessingRequest:
    header_map = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map))


async def exchange(stub: Any, *messages: pb.ProcessingRequest) -> tuple[Any, list[Any]]:
    """Send messages one at a time, reading one answer each (as Envoy does: a request for
    more time, override_message_timeout, is not an answer)."""
    call = stub.Process()
    answers = []
    for message in messages:
        await call.write(message)
        answer = await call.read()
        while answer is not grpc.aio.EOF and answer.HasField("override_message_timeout"):
            answer = await call.read()
        answers.append(answer)
    return call, answers


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def refusal(answer: pb.ProcessingResponse) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, hdrs, json.loads(immediate.body)


async def reserved(service: Service) -> int:
    return (await service.ledger.usage("qwen")).reserved


async def released(service: Service, pools: tuple[str, ...] = ("qwen",)) -> bool:
    """Whether the ledger holds nothing in `pools`: every lease of the load is released."""
    usages = [await service.ledger.usage(pool) for pool in pools]
    return all(usage.reserved == 0 for usage in usages)
