"""The command line as users run it: real processes, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvguard import __version__ as kvguard_version
from kvguard.ops.vllm_metrics import EndpointCache, parse_cache_config
from kvguard.testing import free_port
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.cli import TRACE, kvguard, line_of, run
from tests.conftest import kvguard_config, write_config
from tests.processes import (
    NOT_SERVING,
    SERVING,
    health,
    kvguard_behind_envoy,
    kvguard_serve,
)

pytestmark = pytest.mark.integration

PROMPT = "The quartermaster's private memo"


async def test_check_config_summarises_a_good_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, kvguard_config())
    code, out, _ = await run("check-config", str(path))
    assert code == 0
    assert f"{path}: ok" in out
    assert "pool qwen: models qwen; 1000 blocks of 16 tokens, admits up to 850" in out


async def test_check_config_says_what_the_local_fallback_divides_by(tmp_path: Path) -> None:
    data = kvguard_config()
    data["ledger"] = {
        "url": "redis://127.0.0.1:6379/0",
        "on_unavailable": "local",
        "replica_service": "kvguard-gateway-pods",
    }
    code, out, _ = await run("check-config", str(write_config(tmp_path, data)))
    assert code == 0
    assert (
        "local shares: pool / the largest of the processes alive in Redis, the ready pods of "
        "Service kvguard-gateway-pods x server.workers" in out
    )


async def test_check_config_names_the_file_and_key(tmp_path: Path) -> None:
    data = kvguard_config()
    data["pools"][0]["capacity"]["blocks"] = 0
    path = write_config(tmp_path, data)
    code, _, err = await run("check-config", str(path))
    assert code == 1
    line = line_of(path, "blocks: 0")
    assert err == (
        f"error: {path}: pools[0].capacity.blocks: Input should be greater than 0 (line {line})\n"
    )


async def test_every_error_of_a_file_is_shown_each_on_its_line(tmp_path: Path) -> None:
    data = kvguard_config()
    data["tenancy"]["tiers"]["free"] = {"max_tokens_cap": 64, "default_max_tokens": 32,
                                        "max_blokcs": 40}  # fmt: skip
    data["pools"][0]["watermark"] = 2
    path = write_config(tmp_path, data)
    tier, misspelt = line_of(path, "free:"), line_of(path, "max_blokcs")
    expected = (
        f"error: {path}: tenancy.tiers.free.max_blocks: Field required (line {tier})\n"
        f"error: {path}: tenancy.tiers.free.max_blokcs: Extra inputs are not permitted; did you "
        f"mean 'max_blocks'? (line {misspelt})\n"
        f"error: {path}: pools[0].watermark: Input should be less than 1 "
        f"(line {line_of(path, 'watermark: 2')})\n"
    )
    for command in (("check-config", str(path)), ("serve", "--config", str(path))):
        assert await run(*command) == (1, "", expected)


async def test_check_config_warns_of_settings_that_can_never_admit(tmp_path: Path) -> None:
    tiers = {
        # 1 + 1024 tokens need 65 blocks of 16: more than the quota of 40.
        "free": {"max_tokens_cap": 1024, "default_max_tokens": 1024, "max_blocks": 40},
        "pro": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 400},
    }
    path = write_config(tmp_path, kvguard_config(tiers=tiers))
    code, out, err = await run("check-config", str(path))
    assert (code, err) == (
        0,
        f"warning: {path}: tenancy.tiers.free.default_max_tokens: in pool qwen, a request "
        "without max_tokens gets 1024 and needs at least 65 blocks, more than this tier's "
        "max_blocks (40): every such request is refused (400 request_exceeds_capacity)\n",
    )
    assert f"{path}: ok" in out


async def test_the_configuration_file_may_be_given_as_config_or_as_an_argument(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, kvguard_config())
    for command in (("check-config", "--config", str(path)), ("check-config", str(path))):
        code, out, _ = await run(*command)
        assert code == 0 and f"{path}: ok" in out
    (tmp_path / "bad.yaml").write_text("colour: blue\n")
    bad = str(tmp_path / "bad.yaml")
    expected = f"error: {bad}: pools: Field required\n"
    expected += f"error: {bad}: colour: Extra inputs are not permitted (line 1)\n"
    assert await run("serve", bad) == (1, "", expected)  # serve takes it as an argument too
    for command in ("check-config", "serve"):
        code, _, err = await run(command, str(path), "--config", str(path))
        assert code == 2
        assert err.endswith(
            f"kvguard {command}: error: give the configuration file once: --config FILE or "
            "FILE, not both\n"
        )
        code, _, err = await run(command)
        assert code == 2
        assert err.endswith(
            f"kvguard {command}: error: the configuration file is required: --config FILE "
            "(or FILE)\n"
        )


async def test_version() -> None:
    assert await run("--version") == (0, f"kvguard {kvguard_version}\n", "")


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
    elif case == "local_replicas":
        data["server"]["workers"] = 2
        data["ledger"].update(url="redis://127.0.0.1:6379/0", on_unavailable="local", replicas=1)
    path = write_config(folder, data)
    if text is not None:
        path.write_bytes(text)
    return path, env


# The message, and the text of the line it names ({line}).
BAD_INPUT = {
    "not_utf8": ("not UTF-8 text (byte 0xff at offset {offset})", ""),
    "duplicate_key": ("line {line}: duplicate key 'shadow'", "shadow: true"),
    "env_not_yaml": (
        "server.grpc_listen: '*:50051' is not host:port (set by KVGUARD_SERVER_GRPC_LISTEN)",
        "",
    ),
    "max_body_bytes": (
        "server.max_body_bytes: at most 1073741823 (gRPC's message limit, twice this, must fit "
        "in 32 bits) (line {line})",
        "max_body_bytes:",
    ),
    "metrics_port": (
        "server.metrics_listen: '127.0.0.1:99999': the port must be from 0 to 65535 (line {line})",
        "metrics_listen:",
    ),
    "metrics_address": (
        "server.metrics_listen: 'nonsense' is not host:port or :port (line {line})",
        "metrics_listen:",
    ),
    "redis_port": (
        "ledger.url: the port must be a number from 1 to 65535 (in a password, '/', '?' and '#' "
        "must be percent-encoded) (line {line})",
        "url:",
    ),
    "local_replicas": (
        "ledger.replicas: 1 is below server.workers (2); on_unavailable: local admits "
        "capacity/replicas in each process, so count every process: replicas = pods x workers "
        "(line {line})",
        "replicas:",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
async def test_every_command_refuses_bad_input_in_one_line(tmp_path: Path, case: str) -> None:
    path, env = _bad_config(tmp_path, case)
    message, text = BAD_INPUT[case]
    expected = message.format(
        offset=path.read_bytes().find(b"\xff"), line=line_of(path, text) if text else 0
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


async def test_serve_admits_through_envoy_and_exits_0_on_sigterm(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, drain_seconds=5))
    log_path = tmp_path / "kvguard.log"
    async with kvguard_behind_envoy(path, port, upstream, log_path, tmp_path) as served:
        async with served.http.post(
            served.url + "/v1/completions",
            json={"model": "qwen", "prompt": "Hi"},
            headers={"x-tenant-id": "acme"},
        ) as response:
            assert response.status == 200
        assert upstream.requests[0].json()["max_tokens"] == 128
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.process.wait(), 15) == 0
    assert "kvguard stopped" in log_path.read_text()


async def test_sigterm_drains_open_streams_then_exits_0(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, drain_seconds=20))
    log_path = tmp_path / "kvguard.log"
    async with kvguard_behind_envoy(path, port, upstream, log_path, tmp_path) as served:
        slow = asyncio.create_task(
            _post(served.http, served.url, {"x-tenant-id": "acme", "x-test-delay": "3"})
        )
        await upstream.wait_for_requests(1, timeout=10)
        served.process.send_signal(signal.SIGTERM)

        async def not_serving() -> bool:
            return await health(port) == NOT_SERVING

        await wait_until(not_serving, "readiness to turn NOT_SERVING", timeout_s=5, poll_s=0.02)
        assert await health(port, "liveness") == SERVING
        assert await slow == 200  # the stream in flight finished within the grace period
        assert await asyncio.wait_for(served.process.wait(), 30) == 0
    text = log_path.read_text()
    drained = "drained: 0 streams still open at drain_seconds were cut (their leases released)"
    assert drained in text
    assert "kvguard stopped" in text
    records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    (decision,) = [r for r in records if r["message"] == "decision"]
    assert decision["tenant"] == "acme" and decision["outcome"] == "admitted"
    assert decision["request_id"]  # Envoy's x-request-id
    assert PROMPT not in text


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


@pytest.mark.parametrize("command", ["version", "check-config", "simulate"])
async def test_output_to_a_reader_that_left_ends_quietly(tmp_path: Path, command: str) -> None:
    """`kvguard ... | head` where head has already exited: no BrokenPipe traceback."""
    path = write_config(tmp_path, kvguard_config())
    args = {
        "version": ["--version"],
        "check-config": ["check-config", str(path)],
        "simulate": ["simulate", "--trace", str(TRACE), "--config", str(path), "--limit", "5"],
    }[command]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        process = await asyncio.create_subprocess_exec(
            *kvguard(*args), stdout=write, stderr=asyncio.subprocess.PIPE
        )
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(process.communicate(), 120)
    # argparse drops a --version that cannot be written itself, and exits 0.
    assert (process.returncode, err.decode()) == (0 if command == "version" else 1, "")


async def test_sim_server_is_an_openai_upstream_with_the_cache_asked_for() -> None:
    process = await asyncio.create_subprocess_exec(
        *kvguard("sim-server", "--listen", "127.0.0.1:0", "--blocks", "96", "--block-size", "32"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        banner = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        address = re.search(r"http://127\.0\.0\.1:[0-9]+", banner)
        assert address, banner
        url = address.group(0)
        assert banner == (
            f"vLLM simulator on {url}: 96 KV blocks of 32 tokens (95 usable), max_num_seqs 128, "
            "max_model_len 3040, model qwen\n"
        )
        async with aiohttp.ClientSession() as http:
            metrics = ""

            async def metrics_answered() -> bool:
                nonlocal metrics
                try:
                    async with http.get(url + "/metrics") as response:
                        if response.status == 200:
                            metrics = await response.text()
                            return True
                except aiohttp.ClientConnectionError:
                    pass
                return False

            await wait_until(metrics_answered, "/metrics to answer", timeout_s=10, poll_s=0.05)
            # What kvguard's capacity discovery reads: vLLM keeps one block back.
            assert parse_cache_config(metrics) == EndpointCache(usable_blocks=95, block_size=32)
            chat = {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]}
            async with http.post(
                url + "/v1/chat/completions", json={**chat, "max_tokens": 5}
            ) as response:
                assert response.status == 200
                answer = await response.json()
        assert answer["object"] == "chat.completion" and answer["model"] == "qwen"
        (choice,) = answer["choices"]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        usage = answer["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 5
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_logs_the_warnings_of_check_config(tmp_path: Path) -> None:
    port = free_port()
    tiers = {
        "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 40},
        "pro": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 850},
    }
    path = write_config(tmp_path, kvguard_config(grpc_port=port, tiers=tiers))
    log_path = tmp_path / "kvguard.log"
    async with kvguard_serve(path, port, log_path) as process:
        process.send_signal(signal.SIGTERM)  # the log is whole once the process has ended
        assert await asyncio.wait_for(process.wait(), 15) == 0
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    (warning,) = [r for r in records if r["level"] == "WARNING"]
    assert warning["message"] == (
        f"{path}: tenancy.tiers.pro.max_blocks: 850 is not below any pool's limit (at most 850 "
        "blocks, pool qwen): this quota never binds, so one tenant of this tier may take a whole "
        "pool"
    )
