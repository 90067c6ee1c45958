"""kvguard.v1.AdminService: read the ledger a running kvguard admits against; release a lease.

Served on the gRPC port when `server.admin` is true. It is an operator's tool: put it behind
the same network policy as the port itself (kvguard listens on localhost by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from kvguard.capacity import Capacities
from kvguard.ledger import Lease, Ledger
from kvguard.policy import Policy
from kvguard.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self, policy: Callable[[], Policy], ledger: Ledger, capacities: Capacities
    ) -> None:
        self._policy = policy
        self._ledger = ledger
        self._capacities = capacities

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
                )
            )
        return admin_pb2.GetUsageResponse(pools=pools)

    async def ReleaseLease(
        self, request: admin_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReleaseLeaseResponse:
        if request.pool not in self._policy().pools:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool {request.pool!r}")
        before = (await self._ledger.usage(request.pool)).leases
        await self._ledger.release(Lease(request.lease_id, request.pool, "", 0))
        released = (await self._ledger.usage(request.pool)).leases < before
        log.warning("admin released lease %s in pool %s", request.lease_id, request.pool)
        return admin_pb2.ReleaseLeaseResponse(released=released)
