"""`on_unavailable: local` in a running kvguard, through its ext_proc port: the pool is shared
by the replicas counted at runtime (the processes registered in a real redis-server, the
gateway Service's ready pods in a DNS the test controls), and a process that never knew a count
answers 503."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.app import Service
from kvguard.ops import replica_service
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers, refusal
from tests.ops.fakes import Dns

pytestmark = [pytest.mark.integration, pytest.mark.redis]

# max_tokens 512 (acme's tier cap): about 33 blocks of 16 tokens a request.
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 512}
QUOTA = 400  # acme's tier, tests.conftest


def local_config(tmp_path: Path, redis_url: str) -> configs.Config:
    data = kvguard_config()
    data["ledger"] = {
        "url": redis_url,
        "lease_seconds": 60,
        "on_unavailable": "local",
        "replica_service": "kvguard-gateway-pods",
    }
    return configs.load(write_config(tmp_path, data), environ={})


@asynccontextmanager
async def serving(
    config: configs.Config, dns: Dns
) -> AsyncIterator[tuple[Service, Callable[[], Awaitable[Any]]]]:
    """A started Service resolving through `dns`, and `ask()`: one chat request for acme, left
    open (its lease held), returning kvguard's answer."""
    service = Service(config, resolver=dns)
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    calls: list[Any] = []

    async def ask() -> Any:
        call, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        calls.append(call)
        return answer

    try:
        yield service, ask
    finally:
        for call in calls:
            call.cancel()
        await channel.close()
        await service.stop(0)


async def test_an_outage_shares_the_pool_by_the_pods_dns_counts(tmp_path: Path) -> None:
    dns = Dns("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
    with RedisServer(tmp_path / "redis") as redis:
        async with serving(local_config(tmp_path, redis.url), dns) as (service, ask):
            # Redis counts this one process; DNS 4 ready pods of 1 worker: the larger counts.
            await wait_until(lambda: service.replicas.count == 4, "a count of 4 processes")
            assert ("kvguard-gateway-pods", 0) in dns.asked
            # kvguard_ledger_replicas reports it.
            await wait_until(lambda: service.metrics.view.replicas == 4, "the gauge's view")
            answer = await ask()
            assert answer.WhichOneof("response") == "request_body"
            redis.stop()
            await wait_until(lambda: not service.ledger.reachable, "the outage to be seen")
            while (answer := await ask()).WhichOneof("response") == "request_body":
                pass
            status, hdrs, _ = refusal(answer)
            assert (status, hdrs["x-kvguard-reason"]) == (429, "tenant_block_quota_exceeded")
            # Admitted up to acme's local share, QUOTA // 4 blocks, and not one more request.
            held = [lease.blocks for lease in service.keeper.snapshot()]
            assert sum(held) <= QUOTA // 4 < sum(held) + held[-1]


async def test_a_process_that_never_knew_a_count_answers_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_service, "REFRESH_S", 0.05)
    never_started = RedisServer(tmp_path / "redis")  # its port refuses connections
    dns = Dns("127.0.0.2", "127.0.0.3")
    dns.failing = True
    async with serving(local_config(tmp_path, never_started.url), dns) as (service, ask):
        await wait_until(lambda: len(dns.asked) >= 1, "a first lookup (failing)")
        status, hdrs, error = refusal(await ask())
        assert (status, hdrs["x-kvguard-reason"]) == (503, "ledger_unavailable")
        assert error["error"]["code"] == "ledger_unavailable"
        dns.failing = False  # the next lookup counts 2 processes
        await wait_until(lambda: service.replicas.count == 2, "a count from DNS")
        answer = await ask()
        assert answer.WhichOneof("response") == "request_body"
