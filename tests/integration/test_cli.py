"""The command line as users run it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordingUpstream
from tests.conftest import kvguard_config, write_config
from tests.integration.processes import (
    NOT_SERVING,
    SERVING,
    health,
    kvguard_serve,
)

pytestmark = pytest.mark.integration

PROMPT = "The quartermaster's private memo"


def kvguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvguard", *args]


async def run(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *kvguard(*args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_check_config_summarises_a_good_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, kvguard_config())
    code, out, _ = await run("check-config", str(path))
    assert code == 0
    assert f"{path}: ok" in out
    assert "pool qwen: models qwen; 1000 blocks of 16 tokens, admits up to 850" in out


async def test_check_config_names_the_file_and_key(tmp_path: Path) -> None:
    data = kvguard_config()
    data["pools"][0]["capacity"]["blocks"] = 0
    path = write_config(tmp_path, data)
    code, _, err = await run("check-config", str(path))
    assert code == 1
    assert err.strip() == f"error: {path}: pools[0].capacity.blocks: Input should be greater than 0"


async def test_check_config_reports_a_missing_tokenizer(tmp_path: Path) -> None:
    data = kvguard_config()
    data["pools"][0]["tokenizer"] = str(tmp_path / "nowhere")
    code, _, err = await run("check-config", str(write_config(tmp_path, data)))
    assert code == 1
    assert "nowhere" in err


async def test_serve_admits_through_envoy_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, drain_seconds=5))
    log_path = tmp_path / "kvguard.log"
    upstream = RecordingUpstream()
    await upstream.start()
    try:
        async with kvguard_serve(path, port, log_path) as process:
            async with EnvoyProcess(loopback_config(port, upstream.port), tmp_path) as envoy:
                await envoy.wait_cluster_healthy("kvguard")
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(
                        envoy.url + "/v1/completions",
                        json={"model": "qwen", "prompt": "Hi"},
                        headers={"x-tenant-id": "acme"},
                    ) as response,
                ):
                    assert response.status == 200
            assert upstream.requests[0].json()["max_tokens"] == 128
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        assert "kvguard stopped" in log_path.read_text()
    finally:
        await upstream.stop()


async def test_sigterm_drains_open_streams_then_exits_0(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, drain_seconds=20))
    log_path = tmp_path / "kvguard.log"
    upstream = RecordingUpstream()
    await upstream.start()
    try:
        async with (
            kvguard_serve(path, port, log_path) as process,
            EnvoyProcess(loopback_config(port, upstream.port), tmp_path) as envoy,
            aiohttp.ClientSession() as http,
        ):
            await envoy.wait_cluster_healthy("kvguard")
            slow = asyncio.create_task(
                _post(http, envoy.url, {"x-tenant-id": "acme", "x-test-delay": "3"})
            )
            await upstream.wait_for_requests(1, timeout=10)
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while await health(port) != NOT_SERVING:
                assert time.monotonic() < deadline, "readiness did not turn NOT_SERVING"
                await asyncio.sleep(0.02)
            assert await health(port, "liveness") == SERVING
            assert await slow == 200  # the stream in flight finished within the grace period
            assert await asyncio.wait_for(process.wait(), 30) == 0
        text = log_path.read_text()
        assert "drained; 0 leases still open were released" in text
        assert "kvguard stopped" in text
        records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
        (decision,) = [r for r in records if r["message"] == "decision"]
        assert decision["tenant"] == "acme" and decision["outcome"] == "admitted"
        assert decision["request_id"]  # Envoy's x-request-id
        assert PROMPT not in text
    finally:
        await upstream.stop()


async def _post(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int:
    async with http.post(
        url + "/v1/completions", json={"model": "qwen", "prompt": PROMPT}, headers=headers
    ) as response:
        await response.read()
        return response.status


async def test_a_second_process_on_a_taken_port_fails_to_start(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port))
    async with kvguard_serve(path, port, tmp_path / "first.log"):
        code, _, err = await run("serve", "--config", str(path))
        assert code == 1
        assert f"error: {path}: cannot listen on 127.0.0.1:{port}" in err
