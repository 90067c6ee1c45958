"""`kvguard serve`: assemble the process and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from kvguard import policy as policies
from kvguard.admission import Admission, AdmissionSettings
from kvguard.capacity import Capacities
from kvguard.config import Config
from kvguard.counting import PromptCounter
from kvguard.extproc.server import GrpcServer
from kvguard.extproc.service import ExternalProcessor
from kvguard.health import Health
from kvguard.leases import LeaseKeeper
from kvguard.ledger.url import from_url

log = logging.getLogger(__name__)

# Envoy may buffer up to its own limit, above max_body_bytes, so that kvguard answers 413.
MIN_GRPC_MESSAGE_BYTES = 64 * 1024 * 1024


class Service:
    """One kvguard process: policy, ledger, admission and the gRPC server around them."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.health = Health(ledger_required=config.ledger.on_unavailable == "reject")
        self.policy = policies.build(config)
        self.health.set("policy", True)
        self.health.set("tokenizers", True)
        self.capacities = Capacities()
        self.capacities.subscribe(lambda: self.health.set("capacity", self.capacities.any_known()))
        for pool in self.policy.pools.values():
            if pool.static_capacity is not None:
                self.capacities.set(pool.name, pool.static_capacity)
        self.ledger = from_url(config.ledger.url)
        self.health.set("ledger", True)
        self.counter = PromptCounter()
        self.keeper = LeaseKeeper(self.ledger, config.ledger.lease_seconds)
        self.admission = Admission(
            self.ledger,
            self.counter,
            self.capacities,
            AdmissionSettings(
                config.server.max_body_bytes,
                config.ledger.lease_seconds,
                config.ledger.on_unavailable,
            ),
        )
        processor = ExternalProcessor(lambda: self.policy, self.admission, self.keeper)
        self.grpc = GrpcServer(
            config.server.grpc_listen,
            processor,
            self.health,
            max(MIN_GRPC_MESSAGE_BYTES, 2 * config.server.max_body_bytes),
        )

    async def run(self, stop: asyncio.Event) -> None:
        await self.grpc.start()
        host = self.config.server.grpc_listen.rsplit(":", 1)[0]
        log.info("kvguard serving ext_proc and health on %s:%d", host, self.grpc.port)
        renewals = asyncio.create_task(self.keeper.renew_forever())
        try:
            await stop.wait()
            log.info("draining: not ready, open streams get %ss", self.config.server.drain_seconds)
            self.health.set("draining", True)
            await self.grpc.stop(self.config.server.drain_seconds)
            await self.keeper.release_all()
        finally:
            renewals.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewals
            self.counter.close()
            await self.ledger.close()
        log.info("kvguard stopped")


async def serve(config: Config) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Service(config).run(stop)
