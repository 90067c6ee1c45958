"""No secret is ever shown: a Redis password and an API key of `tenancy.api_keys` are planted,
every command runs, a real `kvguard serve` takes traffic through the real Envoy (and a Redis
outage), and its output, its logs and its /metrics are searched for them."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import signal
from pathlib import Path

import aiohttp
import pytest

from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.redis import RedisServer
from kvguard.testing.upstream import RecordingUpstream
from tests.conftest import kvguard_config, write_config
from tests.integration.processes import kvguard_serve
from tests.integration.test_cli import TRACE, run

pytestmark = pytest.mark.integration

PASSWORD = f"pw-{secrets.token_hex(12)}"
WRONG_PASSWORD = f"pw-{secrets.token_hex(12)}"
API_KEY = f"sk-{secrets.token_hex(16)}"
UNKNOWN_KEY = f"sk-{secrets.token_hex(16)}"  # what a client sent is a secret too
PLANTED = (PASSWORD, WRONG_PASSWORD, API_KEY, UNKNOWN_KEY)
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]}


def secret_config(folder: Path, url: str, **server: object) -> Path:
    data = kvguard_config(log_level="debug", default_tier=None, **server)
    data["ledger"]["url"] = url
    data["tenancy"].update(
        identity="api_key", api_keys={hashlib.sha256(API_KEY.encode()).hexdigest(): "acme"}
    )
    folder.mkdir(exist_ok=True)
    return write_config(folder, data)


async def commands(tmp_path: Path, redis: RedisServer) -> list[str]:
    """What each command prints, on good and on bad input that holds the secrets."""
    path = secret_config(tmp_path / "good", redis.url)
    wrong = secret_config(tmp_path / "wrong", redis.url.replace(PASSWORD, WRONG_PASSWORD))
    bad_port = {"KVGUARD_LEDGER_URL": f"redis://:{PASSWORD}@127.0.0.1:notaport/0"}
    runs = [
        await run("check-config", str(path)),
        await run("ledger", "status", "--config", str(path)),
        await run("ledger", "status", "--config", str(wrong)),
        await run("check-config", str(path), env=bad_port),
        await run("serve", "--config", str(path), env=bad_port),
        await run("simulate", "--trace", str(TRACE), "--config", str(path), "--limit", "5"),
    ]
    codes = [code for code, _, _ in runs]
    assert codes == [0, 0, 1, 1, 1, 0], runs
    assert f"ledger: redis://:***@127.0.0.1:{redis.port}/0" in runs[0][1]
    return [out + err for _, out, err in runs]


async def serving(tmp_path: Path, redis: RedisServer) -> list[str]:
    """A real serve's /metrics and log, after admitted and refused requests and an outage."""
    port, metrics_port = free_port(), free_port()
    path = secret_config(
        tmp_path / "serve", redis.url, grpc_port=port, metrics_listen=f"127.0.0.1:{metrics_port}"
    )
    log_path = tmp_path / "serve" / "kvguard.log"
    upstream = RecordingUpstream()
    await upstream.start()
    try:
        async with (
            kvguard_serve(path, port, log_path) as process,
            EnvoyProcess(loopback_config(port, upstream.port), tmp_path) as envoy,
            aiohttp.ClientSession() as http,
        ):
            await envoy.wait_cluster_healthy("kvguard")

            async def post(key: str, payload: object) -> int:
                async with http.post(
                    envoy.url + "/v1/chat/completions",
                    json=payload,
                    headers={"authorization": f"Bearer {key}"},
                ) as response:
                    await response.read()
                    return response.status

            assert await post(API_KEY, CHAT) == 200
            assert await post(UNKNOWN_KEY, CHAT) == 401
            assert await post(API_KEY, {"model": "qwen", "messages": "not a list"}) == 400
            redis.stop()  # an outage: logged once, as an error that names the ledger
            assert await post(API_KEY, CHAT) == 503
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                metrics = await response.text()
            assert "kvguard_admissions_total" in metrics
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        await upstream.stop()
    log = log_path.read_text()
    assert "Redis unreachable" in log and '"level": "DEBUG"' in log  # the outage, debug lines
    return [metrics, log]


async def test_no_command_log_or_metric_shows_a_secret(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", password=PASSWORD) as redis:
        outputs = await commands(tmp_path, redis)
        outputs += await serving(tmp_path, redis)
    for text in outputs:
        for secret in PLANTED:
            assert secret not in text
