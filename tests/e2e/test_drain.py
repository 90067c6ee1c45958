"""SIGTERM with responses still running at drain_seconds: a real `kvguard serve` behind the real
Envoy, a slow upstream. What the clients see, and what kvguard logs."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.testing import free_port
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.processes import kvguard_behind_envoy

pytestmark = pytest.mark.integration

TENANT = {"x-tenant-id": "acme"}
# 512 tokens (the pro tier's cap) at 20 a second: a stream runs ~25 s, far past the drain.
TOKEN_DELAY_S = 0.05


async def test_streams_open_at_drain_seconds_are_cut_counted_and_logged(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, drain_seconds=2))
    log_path = tmp_path / "kvguard.log"
    upstream = RecordingUpstream(token_delay=TOKEN_DELAY_S)
    await upstream.start()
    try:
        async with kvguard_behind_envoy(path, port, upstream, log_path, tmp_path) as served:
            streamed = {"model": "qwen", "prompt": "Hi", "stream": True, "max_tokens": 512}
            async with served.http.post(
                served.url + "/v1/completions", json=streamed, headers=TENANT
            ) as s:
                assert s.status == 200
                seen = await s.content.readline()
                assert seen.startswith(b"data: ")  # the response is under way
                # A non-streamed request whose upstream has not answered yet.
                waiting = asyncio.create_task(
                    _post(served.http, served.url, {**TENANT, "x-test-delay": "600"})
                )
                await upstream.wait_for_requests(2, timeout=10)
                served.process.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):  # chunked body left unfinished
                    async for line in s.content:
                        seen += line
            assert b"data: [DONE]" not in seen
            status, error = await waiting
            assert (status, error["error"]["code"]) == (503, "kvguard_unavailable")
            assert await asyncio.wait_for(served.process.wait(), 30) == 0
            # Envoy reset both upstream requests.
            await wait_until(
                lambda: upstream.in_flight == 0,
                lambda: f"the upstream to be idle ({upstream.in_flight} requests still open)",
                timeout_s=10,
                poll_s=0.02,
            )
        records = [json.loads(line) for line in log_path.read_text().splitlines()]
        (drained,) = [r for r in records if r["message"].startswith("drained")]
        assert drained["message"] == (
            "drained: 2 streams still open at drain_seconds were cut (their leases released)"
        )
        assert drained["level"] == "WARNING"
    finally:
        await upstream.stop()


async def _post(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, Any]:
    payload = {"model": "qwen", "prompt": "Hi", "max_tokens": 512}
    async with http.post(url + "/v1/completions", json=payload, headers=headers) as response:
        return response.status, await response.json(content_type=None)
