"""The command line as users run it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

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


async def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *kvguard(*args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
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


def _bad_config(folder: Path, case: str) -> tuple[Path, dict[str, str]]:
    """A configuration file (and environment) that `case` makes unusable."""
    data = kvguard_config()
    env: dict[str, str] = {}
    text = None
    if case == "not_utf8":
        text = yaml.safe_dump(data).encode() + b"shadow: \xff\n"
    elif case == "duplicate_key":
        text = (yaml.safe_dump(data, sort_keys=False) + "shadow: true\n").encode()
    elif case == "env_not_yaml":
        env["KVGUARD_SERVER_GRPC_LISTEN"] = "*:50051"
    elif case == "max_body_bytes":
        data["server"]["max_body_bytes"] = 2**30
    elif case == "metrics_port":
        data["server"]["metrics_listen"] = "127.0.0.1:99999"
    elif case == "metrics_address":
        data["server"]["metrics_listen"] = "nonsense"
    elif case == "redis_port":
        data["ledger"]["url"] = "redis://127.0.0.1:notaport/0"
    path = write_config(folder, data)
    if text is not None:
        path.write_bytes(text)
    return path, env


BAD_INPUT = {
    "not_utf8": "not UTF-8 text (byte 0xff at offset {offset})",
    "duplicate_key": "line {line}: duplicate key 'shadow'",
    "env_not_yaml": (
        "server.grpc_listen: '*:50051' is not host:port (set by KVGUARD_SERVER_GRPC_LISTEN)"
    ),
    "max_body_bytes": (
        "server.max_body_bytes: at most 1073741823 (gRPC's message limit, twice this, must fit "
        "in 32 bits)"
    ),
    "metrics_port": "server.metrics_listen: '127.0.0.1:99999': the port must be from 0 to 65535",
    "metrics_address": "server.metrics_listen: 'nonsense' is not host:port or :port",
    "redis_port": (
        "ledger.url: the port must be a number from 1 to 65535 (in a password, '/', '?' and '#' "
        "must be percent-encoded)"
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
async def test_every_command_refuses_bad_input_in_one_line(tmp_path: Path, case: str) -> None:
    path, env = _bad_config(tmp_path, case)
    raw = path.read_bytes()
    expected = BAD_INPUT[case].format(
        offset=raw.find(b"\xff"), line=raw.decode(errors="replace").count("\n")
    )
    commands = [("check-config", str(path)), ("serve", "--config", str(path))]
    commands.append(("ledger", "status", "--config", str(path)))
    for code, _, err in await asyncio.gather(*(run(*c, env=env) for c in commands)):
        assert (code, err) == (1, f"error: {path}: {expected}\n")


async def test_ledger_status_reports_a_url_the_redis_client_refuses(tmp_path: Path) -> None:
    data = kvguard_config()
    data["ledger"]["url"] = "redis://127.0.0.1:6379/0?socket_timeout=soon"
    path = write_config(tmp_path, data)
    code, _, err = await run("ledger", "status", "--config", str(path))
    assert (code, err) == (
        1,
        f"error: {path}: ledger.url: Invalid value for 'socket_timeout' in connection URL.\n",
    )


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
