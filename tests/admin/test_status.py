"""`kvguard ledger status` as users run it: a real process reading a real redis-server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.app import Service
from kvguard.ledger import Claim, Outcome, PodLimit
from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.testing import free_port
from kvguard.testing.redis import RedisServer
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers

pytestmark = pytest.mark.integration


async def status(config: Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvguard", "ledger", "status", "--config", str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def redis_config(tmp_path: Path, url: str) -> Path:
    data = kvguard_config(blocks=1000, watermark=0.15)
    data["ledger"] = {"url": url}
    return write_config(tmp_path, data)


async def admit(url: str, claims: list[Claim]) -> None:
    """Reserve each of `claims` in the Redis at `url`; each must be admitted."""
    ledger = RedisLedger.from_url(url)
    try:
        for claim in claims:
            assert (await ledger.reserve(claim)).outcome is Outcome.ADMITTED
    finally:
        await ledger.close()


@pytest.mark.redis
async def test_status_reads_pools_and_tenants_from_redis(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        await admit(
            redis.url,
            [
                Claim(lease_id, "qwen", tenant, blocks, 850, 400, 60)
                for lease_id, tenant, blocks in (
                    ("1", "acme", 120),
                    ("2", "acme", 30),
                    ("3", "b", 7),
                )
            ],
        )
        code, out, err = await status(redis_config(tmp_path, redis.url))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"ledger {redis.url}"
    assert lines[1].split() == ["pool", "capacity", "limit", "reserved", "free", "leases"]
    assert lines[2].split() == ["qwen", "1000", "850", "157", "843", "3"]
    assert lines[3] == "pool qwen, reserved blocks per tenant:"
    assert [line.split() for line in lines[4:]] == [["acme", "150"], ["b", "7"]]


@pytest.mark.redis
async def test_status_shows_the_blocks_reserved_on_each_pod(tmp_path: Path) -> None:
    pods = (PodLimit("10.0.0.2:8000", 500), PodLimit("10.0.0.1:8000", 500))
    with RedisServer(tmp_path / "redis") as redis:
        await admit(
            redis.url,
            [
                Claim(i, "qwen", "acme", blocks, 850, 400, 60, pods=pods)
                for i, blocks in (("1", 120), ("2", 30))
            ],
        )
        code, out, err = await status(redis_config(tmp_path, redis.url))
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index("pool qwen, reserved blocks per pod:")
    # The first on the first pod of a tie (10.0.0.2), the second where more stays free; listed
    # by address.
    assert [line.split() for line in lines[at + 1 :]] == [
        ["10.0.0.1:8000", "30"],
        ["10.0.0.2:8000", "120"],
    ]


@pytest.mark.redis  # its server is never started, but RedisServer needs the binary
async def test_status_says_when_redis_cannot_be_reached(tmp_path: Path) -> None:
    gone = RedisServer(tmp_path / "gone")  # never started
    url = f"redis://:secret@127.0.0.1:{gone.port}/0"
    code, out, err = await status(redis_config(tmp_path, url))
    assert code == 1 and out == ""
    assert f"redis://:***@127.0.0.1:{gone.port}/0" in err and "secret" not in err
    assert "ConnectionError" in err


async def test_status_of_a_memory_ledger_reads_the_running_kvguard(tmp_path: Path) -> None:
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port, admin=True))
    service = Service(configs.load(path, environ={}))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            chat = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
            call, _ = await exchange(stub, headers("/v1/chat/completions"), body(chat))
            blocks = (await service.ledger.usage("qwen")).reserved
            code, out, err = await status(path)
            await call.done_writing()
    finally:
        await service.stop(0)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "ledger memory://"
    assert lines[2].split() == ["qwen", "1000", "850", str(blocks), str(1000 - blocks), "1"]
    assert [line.split() for line in lines[4:]] == [["acme", str(blocks)]]


async def test_status_of_a_memory_ledger_needs_the_admin_api(tmp_path: Path) -> None:
    code, out, err = await status(write_config(tmp_path, kvguard_config(grpc_port=free_port())))
    assert code == 1 and out == ""
    assert "server.admin: true" in err
