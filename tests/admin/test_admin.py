"""kvguard.v1.AdminService on the gRPC port: usage per pool and tenant, releasing a lease."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvguard.testing.wait import wait_until
from kvguard.v1 import admin_pb2, admin_pb2_grpc
from tests.extproc.harness import body, exchange, headers, reserved, running, set_headers

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}]}


async def test_usage_and_release_through_the_admin_api(tmp_path: Path) -> None:
    async with running(tmp_path, admin=True) as (service, stub):
        # Both streams stay open (their calls referenced) while the lease is released.
        first_call, (_, first) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        second_call, (_, second) = await exchange(
            stub, headers("/v1/chat/completions", tenant="other"), body(CHAT)
        )
        lease_id = set_headers(first.request_body.response)["x-kvguard-lease"]
        blocks = int(set_headers(first.request_body.response)["x-kvguard-blocks"])
        others = int(set_headers(second.request_body.response)["x-kvguard-blocks"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}") as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            (pool,) = (await admin.GetUsage(admin_pb2.GetUsageRequest())).pools
            assert (pool.pool, pool.capacity_blocks, pool.block_size) == ("qwen", 1000, 16)
            assert dict(pool.reserved_blocks_by_tenant) == {"acme": blocks, "other": others}
            assert pool.reserved_blocks == blocks + others
            assert pool.free_blocks == 1000 - blocks - others
            assert pool.leases == 2
            listed = await admin.ListLeases(admin_pb2.ListLeasesRequest(pool="qwen"))
            mine = {lease.lease_id: lease for lease in listed.leases}[lease_id]
            assert (mine.tenant, mine.blocks) == ("acme", blocks)
            assert 0 < mine.expires_in_seconds <= 60

            answer = await admin.ReleaseLease(
                admin_pb2.ReleaseLeaseRequest(pool="qwen", lease_id=lease_id)
            )
            assert answer.released
            assert await reserved(service) == others
            await service.keeper.renew_all()  # its stream's renewal does not bring it back
            assert await reserved(service) == others
            again = await admin.ReleaseLease(
                admin_pb2.ReleaseLeaseRequest(pool="qwen", lease_id=lease_id)
            )
            assert not again.released
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin.ReleaseLease(admin_pb2.ReleaseLeaseRequest(pool="nope", lease_id="x"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        del first_call, second_call


async def test_admin_api_is_off_unless_enabled(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, _):
        address = f"127.0.0.1:{service.grpc.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin.GetUsage(admin_pb2.GetUsageRequest())
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_lease_released_by_an_operator_admits_a_queued_request(tmp_path: Path) -> None:
    queue = {"queue": {"max_wait_seconds": 20}}
    async with running(tmp_path, admin=True, blocks=100, watermark=0.5, pool=queue) as (
        service,
        stub,
    ):
        calls, leases = [], []
        for i in range(16):  # 48 of the pool's limit of 50 blocks, 3 a request
            call, (_, answer) = await exchange(
                stub, headers("/v1/chat/completions", tenant=f"t{i % 2}"), body(CHAT)
            )
            calls.append(call)
            leases.append(set_headers(answer.request_body.response)["x-kvguard-lease"])
        waiting = asyncio.ensure_future(
            exchange(stub, headers("/v1/chat/completions", tenant="u"), body({**CHAT, "user": "u"}))
        )
        await wait_until(lambda: service.queue.queued("qwen") == 1, "the request to queue")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}") as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            request = admin_pb2.ReleaseLeaseRequest(pool="qwen", lease_id=leases[0])
            assert (await admin.ReleaseLease(request)).released
        call, (_, answer) = await asyncio.wait_for(waiting, 10)
        assert answer.WhichOneof("response") == "request_body"
        for each in [*calls, call]:
            await each.done_writing()
