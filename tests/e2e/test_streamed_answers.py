"""Streamed answers through the shipped Envoy, bare and with kvguard, as bench_overhead measures
them: the client reads each token's event as the upstream sends it, and the same events as the
upstream's own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.bench_overhead import without_ext_proc
from kvguard import config as configs
from kvguard.app import Service
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.streaming_upstream import StreamingUpstream
from tests.conftest import kvguard_config, write_config

pytestmark = pytest.mark.integration

GAP_S = 0.05  # between tokens: a stream of TOKENS lasts (TOKENS - 1) * GAP_S
TOKENS = 6
STREAMED = {"model": "qwen", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}


@asynccontextmanager
async def envoys(tmp_path: Path, upstream: StreamingUpstream) -> AsyncIterator[dict[str, str]]:
    """{"direct", "bare", "guarded"}: the upstream's URL, and those of the benchmark's bare Envoy
    and of an Envoy with kvguard (in this process), both from the shipped file, in front of it."""
    service = Service(configs.load(write_config(tmp_path, kvguard_config()), environ={}))
    await service.start()
    guarded_config = loopback_config(service.grpc.port, upstream.port)
    (tmp_path / "bare").mkdir()
    (tmp_path / "guarded").mkdir()
    bare_config = without_ext_proc(guarded_config)
    try:
        async with (
            EnvoyProcess(bare_config, tmp_path / "bare") as bare,
            EnvoyProcess(guarded_config, tmp_path / "guarded") as guarded,
        ):
            await guarded.wait_cluster_healthy("kvguard")
            yield {"direct": upstream.url, "bare": bare.url, "guarded": guarded.url}
    finally:
        await service.stop(0)
        await service.keeper.settle()


def tokens_of(raw: bytes) -> list[Any]:
    """Each event's choices (or [DONE]), without the id and time that differ per answer."""
    assert raw.endswith(b"\n\n")
    events = [event.removeprefix(b"data: ") for event in raw[:-2].split(b"\n\n")]
    return [e.decode() if e == b"[DONE]" else json.loads(e)["choices"] for e in events]


async def test_each_token_arrives_as_it_is_sent_and_unchanged(tmp_path: Path) -> None:
    upstream = StreamingUpstream(tokens=TOKENS, token_gap=GAP_S)
    await upstream.start()
    try:
        async with envoys(tmp_path, upstream) as urls, aiohttp.ClientSession() as http:
            seen = {}
            for name, url in urls.items():
                done_before = upstream.streams_done
                async with http.post(
                    url + "/v1/chat/completions", json=STREAMED, headers={"x-tenant-id": "acme"}
                ) as response:
                    assert response.status == 200, (name, await response.read())
                    first = await response.content.readuntil(b"\n\n")
                    # Envoy passed the first token on while the upstream waited for the others.
                    assert upstream.streams_done == done_before, name
                    seen[name] = tokens_of(first + await response.read())
                assert upstream.streams_done == done_before + 1
    finally:
        await upstream.stop()
    assert len(seen["direct"]) == TOKENS + 1
    assert seen["direct"][-1] == "[DONE]"
    assert seen["bare"] == seen["direct"]
    assert seen["guarded"] == seen["direct"]
