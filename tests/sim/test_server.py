"""The simulator's OpenAI-compatible front, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio

from kvguard.ops import vllm_metrics
from kvguard.ops.vllm_metrics import TokenIntervals, parse_cache_config
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.server import SimServer
from kvguard.testing.vllm import parse_metrics
from kvguard.testing.wait import wait_until

FAST = StepCost(base_s=0.001, prefill_token_s=0.0, decode_seq_s=0.0)
CONFIG = EngineConfig(num_gpu_blocks=17, block_size=16, max_model_len=256, cost=FAST)


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = SimServer(CONFIG, model="m", natural_tokens=(3, 5))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def post(sim: SimServer, path: str, body: dict[str, Any], **headers: str) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.post(sim.url + path, json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


async def test_chat_honours_the_limits_ignore_eos_and_n(sim: SimServer) -> None:
    status, body = await post(sim, "/v1/chat/completions", CHAT | {"max_tokens": 9})
    assert status == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"  # natural end (3-5 tokens) before the limit
    assert 3 <= body["usage"]["completion_tokens"] <= 5
    status, body = await post(
        sim,
        "/v1/chat/completions",
        CHAT | {"max_tokens": 99, "max_completion_tokens": 9, "ignore_eos": True, "n": 2},
        **{"x-kvguard-prompt-tokens": "21"},
    )
    assert status == 200
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["choices"][1]["message"]["content"] == "tok " * 9
    assert body["usage"] == {"prompt_tokens": 21, "completion_tokens": 18, "total_tokens": 39}


async def test_completions_batch_and_token_id_prompts(sim: SimServer) -> None:
    body = {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "ignore_eos": True}
    status, answer = await post(sim, "/v1/completions", body)
    assert status == 200
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 8
    status, answer = await post(sim, "/v1/completions", {"model": "m", "prompt": "x" * 1100})
    assert status == 400 and "maximum context length" in answer["error"]["message"]


async def test_streams_one_chunk_per_token_then_usage(sim: SimServer) -> None:
    body = CHAT | {
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(sim.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
    assert texts == ["tok "] * 6 + [""]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_metrics_use_vllm_names_and_count_preemptions(sim: SimServer) -> None:
    # Four requests of 100 + 150 tokens: 16 blocks each at the end, 16 usable in all.
    body = {"model": "m", "prompt": "y" * 400, "max_tokens": 150, "ignore_eos": True}
    results = await asyncio.gather(
        *(post(sim, "/v1/completions", body, **{"x-tenant-id": t}) for t in "abab")
    )
    assert [status for status, _ in results] == [200] * 4
    async with aiohttp.ClientSession() as http, http.get(sim.url + "/metrics") as response:
        text = await response.text()
    cache = parse_cache_config(text)  # what kvguard's capacity discovery reads
    assert (cache.usable_blocks, cache.block_size) == (16, 16)
    values = parse_metrics(text)
    assert values["vllm:num_preemptions_total"] == sim.engine.preemptions_total > 0
    assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0.0
    assert values["vllm:generation_tokens_total"] == 600
    assert values["kvguard_sim_preemptions_total"] == sim.engine.preemptions_total
    # One interval between consecutive tokens per token after each sequence's first.
    assert values["vllm:inter_token_latency_seconds_count"] == 600 - 4
    assert values["vllm:inter_token_latency_seconds_sum"] == sim.engine.token_gap_seconds_total
    intervals = TokenIntervals(596, sim.engine.token_gap_seconds_total)
    assert vllm_metrics.parse_metrics(text).intervals == intervals  # what kvguard reads
    assert 'kvguard_sim_preemptions_total{tenant="b"}' in text


async def test_a_client_that_goes_away_frees_its_blocks(sim: SimServer) -> None:
    body = CHAT | {"max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(sim.url + "/v1/chat/completions", json=body)
        await response.content.readline()  # the first token arrived: it holds blocks now
        assert sim.engine.pool.used > 0
        response.close()
    await wait_until(lambda: sim.engine.idle and sim.engine.pool.used == 0, "the engine to be idle")
    assert sim.engine.finished_total.get("abort") == 1


async def test_records_the_limits_a_tagged_request_arrived_with(sim: SimServer) -> None:
    await post(sim, "/v1/chat/completions", CHAT | {"max_tokens": 2}, **{"x-sim-tag": "t1"})
    assert sim.received_limits == {"t1": {"max_tokens": 2}}
