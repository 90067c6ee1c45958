"""kvguard.v1.AdminService: read the ledger a running kvguard admits against; release a lease.

Served on the gRPC port when `server.admin` is true. It is an operator's tool: put it behind
the same network policy as the port itself (kvguard listens on localhost by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from kvguard.admission.capacity import Capacities
from kvguard.admission.leases import LeaseKeeper
from kvguard.admission.policy import Policy
from kvguard.ledger import Ledger
from kvguard.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        policy: Callable[[], Policy],
        ledger: Ledger,
        capacities: Capacities,
        keeper: LeaseKeeper,
        on_released: Callable[[str], None] = lambda _pool: None,
    ) -> None:
        self._policy = policy
        self._ledger = ledger
        self._capacities = capacities
        self._keeper = keeper
        self._on_released = on_released  # blocks were freed: the pool's queue may go on

    def add_to(self, server: grpc.aio.Server) -> None:
        """Serve this API on `server` (beside ext_proc, on the same port)."""
        admin_pb2_grpc.add_AdminServiceServicer_to_server(self, server)  # type: ignore[no-untyped-call]

    async def GetUsage(
        self, request: admin_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetUsageResponse:
        pools = []
        for name in self._policy().pools:
            usage = await self._ledger.usage(name)
            capacity = self._capacities.get(name)
            blocks = capacity.blocks if capacity else 0
            pools.append(
                admin_pb2.PoolUsage(
                    pool=name,
                    capacity_blocks=blocks,
                    block_size=capacity.block_size if capacity else 0,
                    reserved_blocks=usage.reserved,
                    free_blocks=max(blocks - usage.reserved, 0),
                    reserved_blocks_by_tenant=usage.tenants,
                    leases=usage.leases,
                    reserved_blocks_by_pod=usage.pods,
                )
            )
        return admin_pb2.GetUsageResponse(pools=pools)

    async def ListLeases(
        self, request: admin_pb2.ListLeasesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListLeasesResponse:
        await self._known_pool(request.pool, context)
        leases = [
            admin_pb2.Lease(
                lease_id=info.lease.lease_id,
                pool=info.lease.pool,
                tenant=info.lease.tenant,
                blocks=info.lease.blocks,
                expires_in_seconds=info.expires_in_s,
                pod=info.lease.pod,
            )
            for info in await self._ledger.leases(request.pool)
        ]
        return admin_pb2.ListLeasesResponse(leases=leases)

    async def ReleaseLease(
        self, request: admin_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReleaseLeaseResponse:
        await self._known_pool(request.pool, context)
        held = {i.lease.lease_id: i.lease for i in await self._ledger.leases(request.pool)}
        lease = held.get(request.lease_id)
        if lease is not None:
            # Held by an open stream of this process: its renewals would record it again.
            self._keeper.forget(lease.lease_id)
            await self._ledger.release(lease)
            self._on_released(lease.pool)
            log.warning(
                "admin released lease %s in pool %s (%d blocks of tenant %s)",
                lease.lease_id,
                lease.pool,
                lease.blocks,
                lease.tenant,
            )
        return admin_pb2.ReleaseLeaseResponse(released=lease is not None)

    async def _known_pool(self, pool: str, context: grpc.aio.ServicerContext) -> None:
        if pool not in self._policy().pools:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool {pool!r}")


async def read_usage(address: str, timeout_s: float = 5.0) -> list[admin_pb2.PoolUsage]:
    """GetUsage from the kvguard at `address` (for `kvguard ledger status`); raises OSError."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            answer = await stub.GetUsage(admin_pb2.GetUsageRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise OSError(f"{exc.code().name}: {exc.details()}") from None
    return list(answer.pools)
