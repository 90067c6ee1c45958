"""No secret is ever shown: a Redis password (in the URL's userinfo or query string), an API key
of `tenancy.api_keys` and an endpoint's password are planted, every command runs on good and on
bad files that hold them (a raw key pasted into `api_keys`, a YAML error on a password's line),
a real `kvguard serve` takes traffic through the real Envoy (and a Redis outage, a failing
capacity discovery, a rejected reload), and its output, its logs and its /metrics are searched
for them."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import signal
from pathlib import Path

import pytest

from kvguard.testing import free_port
from kvguard.testing.redis import RedisServer
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.cli import TRACE, run
from tests.conftest import kvguard_config, write_config
from tests.processes import kvguard_behind_envoy

pytestmark = [pytest.mark.integration, pytest.mark.redis]

PASSWORD = f"pw-{secrets.token_hex(12)}"
WRONG_PASSWORD = f"pw-{secrets.token_hex(12)}"
API_KEY = f"sk-{secrets.token_hex(16)}"
UNKNOWN_KEY = f"sk-{secrets.token_hex(16)}"  # what a client sent is a secret too
ENDPOINT_PASSWORD = f"pw-{secrets.token_hex(12)}"
# Short enough to fit in the 36 characters after the mark of PyYAML's own messages.
YAML_PASSWORD = secrets.token_hex(8)
PLANTED = (PASSWORD, WRONG_PASSWORD, API_KEY, UNKNOWN_KEY, ENDPOINT_PASSWORD, YAML_PASSWORD)
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]}


def secret_config(folder: Path, url: str, *, endpoint: str | None = None, **server: object) -> Path:
    """The planted secrets' configuration; with `endpoint`, a second pool discovers its
    capacity from there, as user `vllm` with ENDPOINT_PASSWORD."""
    data = kvguard_config(log_level="debug", default_tier=None, **server)
    data["ledger"]["url"] = url
    data["tenancy"].update(
        identity="api_key", api_keys={hashlib.sha256(API_KEY.encode()).hexdigest(): "acme"}
    )
    if endpoint is not None:
        discovered = {**data["pools"][0], "name": "discovered", "models": ["discovered"]}
        host = endpoint.removeprefix("http://")
        discovered["capacity"] = {"endpoints": [f"http://vllm:{ENDPOINT_PASSWORD}@{host}"]}
        data["pools"].append(discovered)
    folder.mkdir(exist_ok=True)
    return write_config(folder, data)


def with_text(path: Path, old: str, new: str) -> Path:
    """A copy of the configuration at `path` beside it, with `old` replaced by `new`."""
    copy = path.with_name(f"{secrets.token_hex(4)}.yaml")
    text = path.read_text()
    assert old in text
    copy.write_text(text.replace(old, new))
    return copy


async def commands(tmp_path: Path, redis: RedisServer) -> list[str]:
    """What each command prints, on good and on bad input that holds the secrets."""
    path = secret_config(tmp_path / "good", redis.url)
    wrong = secret_config(tmp_path / "wrong", redis.url.replace(PASSWORD, WRONG_PASSWORD))
    in_query = f"redis://127.0.0.1:{redis.port}/0?password={PASSWORD}"  # redis-py reads it
    query = secret_config(tmp_path / "query", in_query)
    username_only = with_text(path, f":{PASSWORD}@", f"{PASSWORD}@")
    unclosed_quote = with_text(
        path, f"url: redis://:{PASSWORD}@", f'url: "redis://:{YAML_PASSWORD}@'
    )
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    raw_key = with_text(path, digest, API_KEY)  # the key pasted instead of its sha256
    discovered = secret_config(tmp_path / "discovered", redis.url, endpoint="http://vllm-0:8000")
    bad_port = {"KVGUARD_LEDGER_URL": f"redis://:{PASSWORD}@127.0.0.1:notaport/0"}
    bad_scheme = {"KVGUARD_LEDGER_URL": f"http://:{PASSWORD}@127.0.0.1:1/0"}
    runs = [
        await run("check-config", str(path)),
        await run("ledger", "status", "--config", str(path)),
        await run("ledger", "status", "--config", str(wrong)),
        await run("check-config", str(path), env=bad_port),
        await run("serve", "--config", str(path), env=bad_port),
        await run("simulate", "--trace", str(TRACE), "--config", str(path), "--limit", "5"),
        await run("check-config", str(query)),
        await run("ledger", "status", "--config", str(query)),
        await run("check-config", str(username_only)),
        await run("check-config", str(discovered)),
        await run("check-config", str(unclosed_quote)),
        await run("serve", "--config", str(unclosed_quote)),
        await run("check-config", str(raw_key)),
        await run("check-config", str(path), env=bad_scheme),
    ]
    codes = [code for code, _, _ in runs]
    assert codes == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1], runs
    assert f"ledger: redis://:***@127.0.0.1:{redis.port}/0" in runs[0][1]
    assert f"ledger: redis://127.0.0.1:{redis.port}/0?password=***" in runs[6][1]
    assert f"ledger redis://127.0.0.1:{redis.port}/0?password=***" in runs[7][1]
    assert f"ledger: redis://***@127.0.0.1:{redis.port}/0" in runs[8][1]
    assert "discovered from http://vllm:***@vllm-0:8000" in runs[9][1]
    assert "while scanning a quoted scalar" in runs[10][2]
    assert runs[11][2] == runs[10][2]  # serve says what check-config says
    assert "tenancy.api_keys[sk-" in runs[12][2] and "(set by KVGUARD_LEDGER_URL)" in runs[13][2]
    return [out + err for _, out, err in runs]


async def serving(tmp_path: Path, redis: RedisServer) -> list[str]:
    """A real serve's /metrics and log, after admitted and refused requests and an outage."""
    port, metrics_port = free_port(), free_port()
    upstream = RecordingUpstream()
    await upstream.start()
    path = secret_config(
        tmp_path / "serve",
        redis.url,
        endpoint=f"http://127.0.0.1:{upstream.port}",  # its /metrics has no cache gauge
        grpc_port=port,
        metrics_listen=f"127.0.0.1:{metrics_port}",
    )
    log_path = tmp_path / "serve" / "kvguard.log"
    try:
        async with kvguard_behind_envoy(path, port, upstream, log_path, tmp_path) as served:

            async def post(key: str, payload: object) -> int:
                async with served.http.post(
                    served.url + "/v1/chat/completions",
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
            async with served.http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                metrics = await response.text()
            assert "kvguard_admissions_total" in metrics
            # A change that is not YAML, on the password's line: rejected, and logged.
            text = path.read_text()
            assert f"url: {redis.url}\n" in text
            unclosed = f'url: "{redis.url.replace(PASSWORD, YAML_PASSWORD)}'
            path.write_text(text.replace(f"url: {redis.url}", unclosed))
            await logged(log_path, "configuration change rejected")
            await logged(log_path, "capacity discovery from http://vllm:***@127.0.0.1")
            served.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(served.process.wait(), 30) == 0
    finally:
        await upstream.stop()
    log = log_path.read_text()
    assert "Redis unreachable" in log and '"level": "DEBUG"' in log  # the outage, debug lines
    return [metrics, log]


async def logged(path: Path, text: str) -> None:
    """Wait until the log at `path` holds `text`."""
    await wait_until(
        lambda: text in path.read_text(), f"the log to say {text!r}", timeout_s=30, poll_s=0.1
    )


async def test_no_command_log_or_metric_shows_a_secret(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", password=PASSWORD) as redis:
        outputs = await commands(tmp_path, redis)
        outputs += await serving(tmp_path, redis)
    for text in outputs:
        for secret in PLANTED:
            assert secret not in text
