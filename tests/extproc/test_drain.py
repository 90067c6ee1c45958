"""Drain: streams that end within the grace are waited for; those still open at its end are
cut, counted in kvguard_drain_cut_streams_total and in the log line, and their leases released."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvguard.extproc.service import ExternalProcessor
from kvguard.ops.telemetry import Providers
from kvguard.testing.wait import wait_until
from tests.extproc.harness import body, exchange, headers, reserved, running

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


def drain_cut(reader: InMemoryMetricReader) -> list[int]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        int(point.value)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "kvguard_drain_cut_streams"
        for point in metric.data.data_points
    ]


def drained(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in caplog.messages if m.startswith("drained")]


async def test_streams_open_at_the_end_of_the_grace_are_cut_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reader = InMemoryMetricReader()
    caplog.set_level(logging.INFO, logger="kvguard.app")
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers) as (service, stub):
        admitted, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        # Open, without a lease.
        unguarded, _ = await exchange(stub, headers("/v1/models", {":method": "GET"}))
        ended, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        await ended.done_writing()
        assert await ended.read() == grpc.aio.EOF
        assert await reserved(service) > 0

        await service.stop(0.2)

        assert drain_cut(reader) == [2]
        assert drained(caplog) == [
            "drained: 2 streams still open at drain_seconds were cut (their leases released)"
        ]
        assert await reserved(service) == 0
        for call in (admitted, unguarded):  # Envoy sees the stream end in an error
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await call.read()
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_streams_that_end_within_the_grace_are_waited_for_not_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reader = InMemoryMetricReader()
    caplog.set_level(logging.INFO, logger="kvguard.app")
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers) as (service, stub):
        calls = [
            (await exchange(stub, headers("/v1/chat/completions"), body(CHAT)))[0] for _ in range(2)
        ]
        stopping = asyncio.create_task(service.stop(600))
        await wait_until(lambda: _refused(stub), "new streams to be refused")  # the grace has begun
        for call in calls:
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
        await stopping  # returns once both streams ended, long before the grace

        assert drain_cut(reader) == [0]
        assert drained(caplog) == [
            "drained: 0 streams still open at drain_seconds were cut (their leases released)"
        ]
        assert await reserved(service) == 0


async def test_a_stream_taken_before_the_grace_but_not_yet_handled_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC has taken the stream, but its handler has not started when the drain begins (the
    moment between the two): the drain waits for it like any other, and nothing is cut."""
    reader = InMemoryMetricReader()
    caplog.set_level(logging.INFO, logger="kvguard.app")
    providers = Providers(MeterProvider([reader]), None, None)
    taken, release = asyncio.Event(), asyncio.Event()
    process = ExternalProcessor.Process

    async def held(self: ExternalProcessor, requests: Any, context: Any) -> None:
        if not taken.is_set():  # the first stream only; _refused's probes pass straight through
            taken.set()
            await release.wait()
        await process(self, requests, context)

    monkeypatch.setattr(ExternalProcessor, "Process", held)  # before the servicer is registered
    async with running(tmp_path, providers=providers) as (service, stub):
        call = stub.Process()
        await call.write(headers("/v1/chat/completions"))
        await taken.wait()  # gRPC took the stream; kvguard's handler has not started
        stopping = asyncio.create_task(service.stop(600))
        await wait_until(lambda: _refused(stub), "new streams to be refused")  # the grace has begun
        release.set()

        first = await call.read()
        await call.write(body(CHAT))
        second = await call.read()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert (first.WhichOneof("response"), second.WhichOneof("response")) == (
            "request_headers",
            "request_body",
        )
        await stopping

        assert drain_cut(reader) == [0]
        assert drained(caplog) == [
            "drained: 0 streams still open at drain_seconds were cut (their leases released)"
        ]
        assert await reserved(service) == 0


async def _refused(stub: Any) -> bool:
    """Whether a new stream is refused; one that is still taken is ended at once."""
    try:
        call, _ = await exchange(stub, headers("/v1/models", {":method": "GET"}))
    except grpc.aio.AioRpcError as refused:
        return bool(refused.code() == grpc.StatusCode.UNAVAILABLE)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return False
