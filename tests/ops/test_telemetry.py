"""Metrics, traces and decision logs, read back exactly: the SDK's in-memory reader and span
exporter, and a real scrape of the Prometheus endpoint."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pythonjsonlogger.json import JsonFormatter

from kvguard.ops.metrics import bounded_tenants
from kvguard.ops.telemetry import Providers
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers, reserved, running
from tests.ops.fakes import FakeVllm
from tests.ops.readings import points

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "A secret prompt text"}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def admissions(reader: InMemoryMetricReader) -> dict[tuple[str, ...], int]:
    return {
        tuple(p.attributes[k] for k in ("pool", "tier", "outcome", "reason")): p.value
        for p in points(reader, "kvguard_admissions")
    }


async def test_decisions_are_counted_traced_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    providers = Providers(MeterProvider([reader]), tracer_provider, None)
    caplog.set_level(logging.INFO, logger="kvguard.decision")
    async with running(tmp_path, providers=providers, default_tier=None) as (_, stub):
        traceparent = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
        call, _ = await exchange(
            stub,
            headers("/v1/chat/completions", {"traceparent": traceparent, "x-request-id": "r1"}),
            body(CHAT),
        )
        await exchange(stub, headers("/v1/chat/completions"), body(b"{broken"))
        await exchange(stub, headers("/v1/chat/completions", tenant="nobody"))
        await exchange(
            stub, headers("/v1/chat/completions"), body({**CHAT, "max_tokens": 512, "n": 50})
        )

        assert admissions(reader) == {
            ("qwen", "pro", "admitted", ""): 1,
            ("", "pro", "refused", "invalid_request"): 1,
            ("", "", "refused", "unknown_tenant"): 1,
            ("qwen", "pro", "refused", "request_exceeds_capacity"): 1,
        }
        (duration,) = points(reader, "kvguard_decision_duration")
        assert duration.count == 3  # the decisions made on a body
        (prompt,) = points(reader, "kvguard_prompt_tokens")
        assert prompt.count == 1 and prompt.sum > 0

        async def gauges_show_the_lease() -> bool:
            reserved = {
                p.attributes["pool"]: p.value for p in points(reader, "kvguard_reserved_blocks")
            }
            return reserved.get("qwen", 0) > 0

        await wait_until(gauges_show_the_lease, "the gauge to show the lease")
        (capacity,) = points(reader, "kvguard_capacity_blocks")
        assert (capacity.attributes["pool"], capacity.value) == ("qwen", 1000)
        tenants = points(reader, "kvguard_tenant_reserved_blocks")
        assert [(p.attributes["tenant"], p.value > 0) for p in tenants] == [("acme", True)]
        await call.done_writing()

    finished = spans.get_finished_spans()
    assert len(finished) == 3
    traced = [s for s in finished if s.attributes and s.attributes.get("request_id") == "r1"]
    (span,) = traced
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN
    assert span.attributes is not None
    assert span.attributes["outcome"] == "admitted"
    assert span.attributes["tenant"] == "acme" and span.attributes["pool"] == "qwen"
    assert span.attributes["prompt_tokens"] > 0 and span.attributes["blocks"] > 0

    lines = [JsonFormatter().format(r) for r in caplog.records if r.name == "kvguard.decision"]
    assert len(lines) == 4
    logged = json.loads(lines[0])
    assert logged["request_id"] == "r1" and logged["tenant"] == "acme"
    assert logged["outcome"] == "admitted" and logged["duration_ms"] > 0
    assert not any("secret prompt" in line for line in caplog.text.splitlines() + lines)


async def test_refusals_are_counted_per_configured_tenant(tmp_path: Path) -> None:
    """A tenant the configuration names keeps its own series; every other value, however
    many clients make up, counts as "other"."""
    reader = InMemoryMetricReader()
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers) as (_, stub):
        too_many = {**CHAT, "max_tokens": 512, "n": 50}  # more blocks than any quota
        for tenant in ("acme", "acme", "stranger-1", "stranger-2"):
            await exchange(stub, headers("/v1/chat/completions", tenant=tenant), body(too_many))
        await exchange(stub, headers("/v1/chat/completions", tenant="stranger-3"), body(CHAT))
        refusals = {
            tuple(p.attributes[k] for k in ("pool", "tenant", "outcome", "reason")): p.value
            for p in points(reader, "kvguard_tenant_refusals")
        }
    assert refusals == {
        ("qwen", "acme", "refused", "request_exceeds_capacity"): 2,
        ("qwen", "other", "refused", "request_exceeds_capacity"): 2,
    }  # stranger-3 was admitted: admissions are not counted here


async def test_prometheus_endpoint_serves_the_documented_names(tmp_path: Path) -> None:
    async with running(tmp_path, metrics_listen="127.0.0.1:0") as (service, stub):
        port = service.providers.metrics_port
        assert port
        await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        await exchange(stub, headers("/v1/completions"), body({"model": "nope", "prompt": "x"}))
        async with aiohttp.ClientSession() as http:

            async def scraped() -> str:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                    assert response.status == 200
                    return await response.text()

            async def has_gauges() -> bool:
                return "kvguard_reserved_blocks{" in await scraped()

            await wait_until(has_gauges, "/metrics to show the gauges")
            text = await scraped()
    assert (
        'kvguard_admissions_total{outcome="admitted",pool="qwen",reason="",tier="pro"} 1.0' in text
    )
    refused = 'outcome="refused",pool="",reason="model_not_found",tier="pro"'
    assert f"kvguard_admissions_total{{{refused}}} 1.0" in text
    assert 'kvguard_capacity_blocks{pool="qwen"} 1000.0' in text
    assert "kvguard_decision_duration_seconds_bucket{" in text
    assert "kvguard_prompt_tokens_bucket{" in text


def test_tenant_gauge_cardinality_is_bounded() -> None:
    tenants = {f"t{i}": i for i in range(1, 31)}
    top = bounded_tenants(tenants, 3)
    assert top == {"t30": 30, "t29": 29, "t28": 28, "other": sum(range(1, 28))}
    assert bounded_tenants({"a": 1}, 3) == {"a": 1}


def _by_pool(reader: InMemoryMetricReader, name: str) -> dict[str, Any]:
    if reader.get_metrics_data() is None:
        return {}
    return {p.attributes["pool"]: p.value for p in points(reader, name)}


async def test_gauges_drop_a_pool_that_left_the_policy_or_whose_capacity_is_unknown(
    tmp_path: Path,
) -> None:
    """A gauge shows no value rather than a stale one: its last reading stayed forever."""
    vllm = FakeVllm()
    await vllm.start()
    reader = InMemoryMetricReader()
    providers = Providers(MeterProvider([reader]), None, None)
    discovered = {"capacity": {"endpoints": [vllm.url], "refresh_seconds": 0.1}}
    try:
        async with running(tmp_path, providers=providers, pool=discovered, watch=True):

            async def gauges(capacity: dict[str, Any], reserved: dict[str, Any]) -> bool:
                return (
                    _by_pool(reader, "kvguard_capacity_blocks") == capacity
                    and _by_pool(reader, "kvguard_reserved_blocks") == reserved
                )

            await wait_until(lambda: gauges({"qwen": 63}, {"qwen": 0}), "the discovered capacity")
            await vllm.stop()  # its reading expires after three refreshes: capacity unknown
            await wait_until(lambda: gauges({}, {"qwen": 0}), "the capacity to be unknown")
            data = kvguard_config()
            data["pools"][0]["name"] = "qwen2"  # static capacity, 1000 blocks
            write_config(tmp_path, data)
            await wait_until(lambda: gauges({"qwen2": 1000}, {"qwen2": 0}), "pool qwen2, reloaded")
    finally:
        await vllm.stop()


async def test_a_stream_that_ends_mid_decision_is_counted_as_cancelled(tmp_path: Path) -> None:
    """Not as a refusal without a reason: no answer went out."""
    reader = InMemoryMetricReader()
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers) as (service, stub):
        counting = asyncio.Event()
        count = service.counter.count

        async def count_held(*args: Any, **kwargs: Any) -> Any:  # a long prompt, say
            counting.set()
            await asyncio.Event().wait()  # until the stream is gone
            return await count(*args, **kwargs)

        service.counter.count = count_held  # type: ignore[method-assign]
        call = stub.Process()
        await call.write(headers("/v1/chat/completions"))
        await call.read()
        await call.write(body(CHAT))
        await counting.wait()
        call.cancel()  # Envoy resets the stream

        async def counted() -> bool:
            return reader.get_metrics_data() is not None and bool(admissions(reader))

        await wait_until(counted, "an admission to be counted")
        assert admissions(reader) == {("qwen", "pro", "cancelled", ""): 1}
        assert await reserved(service) == 0


async def test_the_log_line_has_the_requested_and_the_applied_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.decision")
    async with running(tmp_path) as (_, stub):
        for limit in ({"max_tokens": 100000}, {"max_tokens": 7}, {}):
            await exchange(stub, headers("/v1/chat/completions"), body({**CHAT, **limit}))
    lines = [
        json.loads(JsonFormatter().format(r))
        for r in caplog.records
        if r.name == "kvguard.decision"
    ]
    logged = [(line.get("requested_max_tokens"), line["max_tokens"]) for line in lines]
    # Clamped to pro's cap, left alone, injected (pro's default; the client sent none).
    assert logged == [(100000, 512), (7, 7), (None, 128)]
