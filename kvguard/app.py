"""`kvguard serve`: assemble the process and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from pathlib import Path

from kvguard import config as configs
from kvguard.admin.service import AdminService
from kvguard.admission import policy as policies
from kvguard.admission.admit import Admission, AdmissionSettings
from kvguard.admission.calibration import Calibration
from kvguard.admission.capacity import Capacities
from kvguard.admission.leases import LeaseKeeper
from kvguard.admission.outputs import OutputLengths
from kvguard.admission.queue import AdmissionQueue
from kvguard.config.reload import PolicyWatcher
from kvguard.config.schema import Config
from kvguard.extproc.server import GrpcServer, load_tls
from kvguard.extproc.service import ExternalProcessor
from kvguard.ledger.replicas import ReplicaCount
from kvguard.ledger.url import from_url
from kvguard.ops import replica_service, telemetry
from kvguard.ops.discovery import Discovery
from kvguard.ops.dns import Resolver, resolve
from kvguard.ops.health import Health
from kvguard.ops.metrics import Metrics
from kvguard.tasks import cancel_and_wait
from kvguard.tokens.counting import PromptCounter

log = logging.getLogger(__name__)

# Envoy may buffer up to its own limit, above max_body_bytes, so that kvguard answers 413.
MIN_GRPC_MESSAGE_BYTES = 64 * 1024 * 1024
# A policy change applies within this (docs/operations.md, "Hot reload").
RELOAD_INTERVAL_S = 1.0
# On drain, how long readiness reads NOT_SERVING before new streams are refused (Envoy's health
# check interval in envoy/envoy.yaml is 1 s).
DRAIN_NOTICE_S = 1.0
# How often the gauges' view of the shared ledger is refreshed.
VIEW_REFRESH_S = 1.0


class Service:
    """One kvguard process: policy, ledger, admission and the gRPC server around them.

    `config_path`, when given, is watched for policy changes (hot reload).
    """

    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        providers: telemetry.Providers | None = None,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        response_sample: float | None = None,
        resolver: Resolver = resolve,
    ) -> None:
        self.config = config
        self._resolve = resolver  # DNS: discovery's vLLM Services and the replica_service
        self._started = False  # from start() on, each policy's pools are subscribed to
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.providers = providers or telemetry.setup(config.server)
        self.metrics = Metrics(self.providers.meter_provider)
        self.telemetry = telemetry.Telemetry(self.metrics, self.providers.tracer_provider)
        self.health = Health(ledger_required=config.ledger.on_unavailable == "reject")
        self.capacities = Capacities()
        # Requests that wait for blocks, in pools with a queue; woken by what frees blocks:
        # releases (the keeper's and, through Redis, the other replicas'), capacity readings
        # and policy changes. It reads the keeper late: the keeper needs the ledger, which wakes
        # this queue, and so comes after both.
        self.queue = AdmissionQueue(
            lambda pool, tenant: self.keeper.held_blocks(pool, tenant),
            lambda lease: self.keeper.give_back(lease),
            on_outcome=self.metrics.record_queued,
        )
        self.capacities.subscribe(self.queue.notify)
        self.capacities.subscribe(lambda: self.health.set("capacity", self.capacities.any_known()))

        self._tokenizers: policies.TokenizerCache = {}
        self.publish(policies.build(config, self._tokenizers))
        self.health.set("tokenizers", True)
        self._watcher = None
        if config_path is not None:
            self._watcher = PolicyWatcher(
                config_path,
                self._load,
                self.publish,
                self.metrics.record_reload,
                reload_interval_s,
            )

        # Pools with capacity.endpoints or .service: read from vLLM's /metrics, refreshed (see
        # start()), which also teaches what their requests produce.
        self.outputs = OutputLengths()
        # What calibrated reservations read: learnt from vLLM's histograms and the completions
        # kvguard reads.
        self.calibration = Calibration(self.outputs)
        self.discovery = Discovery(
            lambda: self.policy,
            self.capacities,
            calibration=self.calibration,
            on_read=self.queue.notify,
            resolver=resolver,
        )

        self.health.set("ledger", True)  # until a Redis ledger finds Redis unreachable
        replicas = config.ledger.replicas
        # What `on_unavailable: local` divides the pool by: Redis's heartbeats and the
        # replica_service's pods add to it at runtime; a fixed count is a floor.
        self.replicas = ReplicaCount(
            replicas if isinstance(replicas, int) else None, own=config.server.workers
        )
        self.ledger = from_url(
            config.ledger.url,
            cluster=config.ledger.cluster,
            on_unavailable=config.ledger.on_unavailable,
            replicas=self.replicas,
            lease_seconds=config.ledger.lease_seconds,
            on_reachability=lambda reachable: self.health.set("ledger", reachable),
            # The keeper's, read late: it is built next, on this ledger (a real cycle).
            open_leases=lambda: self.keeper.snapshot(),
            on_error=self.metrics.record_ledger_error,
            # Releases by the other replicas, through Redis (this process's come from the keeper).
            on_freed=self.queue.notify,
        )
        self.keeper = LeaseKeeper(
            self.ledger,
            config.ledger.lease_seconds,
            decode_rate=self.discovery.decode_rate,
            trust=self.calibration.engine.trust,
            on_released=self.queue.notify,
        )

        self.counter = PromptCounter()
        self.admission = Admission(
            self.ledger,
            self.counter,
            self.capacities,
            AdmissionSettings(
                config.server.max_body_bytes,
                config.ledger.lease_seconds,
                config.ledger.on_unavailable,
            ),
            self.calibration,
            decode_rate=self.discovery.decode_rate,
            queue=self.queue,
        )
        # The share of guarded exchanges whose response is read: the configuration's, unless the
        # caller gives another.
        if response_sample is None:
            response_sample = config.server.response_sample
        processor = self.processor = ExternalProcessor(
            lambda: self.policy,
            self.admission,
            self.keeper,
            self.telemetry,
            sample=response_sample,
            on_completion=lambda done: self.calibration.learn(
                self.policy.pool_config(done.pool), done, time.monotonic()
            ),
        )
        admin = AdminService(
            lambda: self.policy, self.ledger, self.capacities, self.keeper, self.queue.notify
        )
        tls = config.server.tls
        self.grpc = GrpcServer(
            config.server.grpc_listen,
            processor,
            self.health,
            max(MIN_GRPC_MESSAGE_BYTES, 2 * config.server.max_body_bytes),
            [admin.add_to] if config.server.admin else [],
            reuse_port=config.server.workers > 1,
            tls=None if tls is None else load_tls(tls.certificate_file, tls.key_file),
        )

    def publish(self, policy: policies.Policy) -> None:
        """Make `policy` the one new requests read; requests in flight keep theirs."""
        self.policy = policy
        self.health.set("policy", True)
        self.capacities.retain(set(policy.pools))
        for pool in policy.pools.values():
            if pool.static_capacity is not None:
                self.capacities.set(pool.name, pool.static_capacity)
        self.queue.notify()  # a quota or a limit may have grown
        if self._started:
            self.ledger.subscribe(policy.pools)  # its pools may differ

    def _load(self, path: Path) -> policies.Policy:
        """Read and build a changed configuration (in a worker thread)."""
        config = configs.load(path)
        for section in ("server", "ledger"):
            if getattr(config, section) != getattr(self.config, section):
                log.warning("%s: the %s section changed; a restart applies it", path, section)
        for warning in policies.warnings(config):
            log.warning("%s: %s", path, warning)
        return policies.build(config, self._tokenizers)

    async def start(self) -> None:
        await self.ledger.start()  # Redis: registers the scripts; unreachable: not ready
        self.ledger.subscribe(self.policy.pools)
        self._started = True
        await self.grpc.start()
        host = self.config.server.grpc_listen.rsplit(":", 1)[0]
        log.info(
            "kvguard serving ext_proc and health on %s:%d (allocator: %s)",
            host,
            self.grpc.port,
            allocator(),
        )
        jobs = [
            self.keeper.renew_forever(),
            self.keeper.grow_forever(),
            self._refresh_view(),
            self.discovery.run(),
        ]
        if self._watcher is not None:
            jobs.append(self._watcher.run())
        ledger = self.config.ledger
        if ledger.replica_service is not None and self.ledger.shared:
            jobs.append(
                replica_service.watch(
                    ledger.replica_service,
                    self.config.server.workers,
                    self.replicas.resolved,
                    resolver=self._resolve,
                )
            )
        self._tasks = [asyncio.create_task(job) for job in jobs]

    async def stop(self, grace_s: float) -> None:
        """Turn unready at once, give open streams `grace_s`, cut and count the rest, release
        every lease, close."""
        if self._stopping:
            return
        self._stopping = True
        self.health.set("draining", True)
        cut: int | None = None
        try:
            # Keep answering a moment, NOT_SERVING, so health checks see it before refusals.
            await asyncio.sleep(min(DRAIN_NOTICE_S, grace_s))
            cut = await self.grpc.stop(max(grace_s - DRAIN_NOTICE_S, 0))
        finally:
            # Renewals end first: one in flight could record again a lease released below.
            await cancel_and_wait(self._tasks)
            await self.keeper.release_all()
            if cut is not None:  # None: the server's stop failed (its error goes up)
                # Their clients see the response end unfinished (docs/operations.md, "Drain").
                self.metrics.record_drain_cut(cut)
                log.log(
                    logging.WARNING if cut else logging.INFO,
                    "drained: %d streams still open at drain_seconds were cut "
                    "(their leases released)",
                    cut,
                )
            self.counter.close()
            await self.ledger.close()
            # Off the loop: the final export may wait on the network.
            await asyncio.to_thread(self.providers.shutdown)

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await stop.wait()
        log.info("draining: not ready, open streams get %ss", self.config.server.drain_seconds)
        await self.stop(self.config.server.drain_seconds)
        log.info("kvguard stopped")

    async def _refresh_view(self) -> None:
        """Keep the gauges' view of the ledger and capacities current (the ledger is shared)."""
        view = self.metrics.view
        while True:
            # Built anew each round: a pool that left the policy, a capacity no longer known and
            # a ledger that could not be read show no value rather than their last one.
            capacity, reserved, tenants, promised = {}, {}, {}, {}
            capacity_known: dict[str, int] = {}
            pods: dict[str, dict[str, int]] = {}
            for name in list(self.policy.pools):
                known = self.capacities.get(name)
                capacity_known[name] = int(known is not None)
                if known is not None:
                    capacity[name] = known.blocks
                try:
                    usage = await self.ledger.usage(name)
                except Exception:
                    self.metrics.record_ledger_error()
                    continue
                reserved[name] = usage.reserved
                promised[name] = usage.promised
                self.calibration.engine.reserved(name, usage.reserved)
                tenants[name] = usage.tenants
                if known is not None and known.pods and self.policy.pools[name].config.picks:
                    # Every discovered pod has a series (0 when it holds nothing): no other.
                    pods[name] = {p.address: usage.pods.get(p.address, 0) for p in known.pods}
            view.capacity, view.reserved, view.tenants = capacity, reserved, tenants
            view.pods = pods
            view.capacity_known = capacity_known
            view.ledger_available = int(self.health.snapshot()["ledger"])
            # Only a shared ledger has replicas to count (memory:// is one process).
            view.replicas = self.replicas.count if self.ledger.shared else None
            view.promised, view.queued = promised, self.queue.lengths()
            view.capacity_age_s = self.discovery.ages()
            view.used = self.discovery.used_blocks()
            view.preemptions = self.discovery.preemptions_total()
            view.waiting = self.discovery.waiting()
            view.trust = self.discovery.trust()
            await asyncio.sleep(VIEW_REFRESH_S)


def allocator() -> str:
    """'jemalloc' when it was preloaded (the image does: counting tokens allocates a lot, and
    takes markedly more CPU under glibc's malloc), else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "jemalloc" if "libjemalloc" in maps else "system"


async def serve(config: Config, config_path: Path, report_fd: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT. `report_fd`: in a worker of server.workers > 1 serving
    metrics, the pipe its supervisor reads the exposition's port from (kvguard.ops.workers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    providers = telemetry.setup(config.server, report_fd)
    service = Service(config, config_path=config_path, providers=providers)
    # What is loaded by now (modules, tokenizers, templates) lives as long as the process. Out
    # of the collector's sight, it adds nothing to the full collections that every request in
    # flight waits for.
    gc.freeze()
    await service.run(stop)
