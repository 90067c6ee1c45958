"""Capacity discovery: a pool's KV-cache size, read from its vLLM endpoints' /metrics.

A pool's capacity is sum(num_gpu_blocks - 1) over its endpoints (`ops.vllm_metrics` reads each
one's), and every endpoint must report the same block size.

Each pool is refreshed every `capacity.refresh_seconds`. An endpoint that cannot be read keeps
its last good reading for STALE_AFTER_REFRESHES refresh intervals; after that it counts for
nothing, and a pool with no endpoint left has unknown capacity (its requests get 503
capacity_unknown; the other pools are untouched). Every change of state is logged once, each
endpoint's URL with its credentials masked.

The same scrape teaches what requests produce: the deltas of vLLM's own histogram
`vllm:request_generation_tokens` between two readings (a counter that went down is a restarted
server, whose counts start again), summed over a pool's endpoints, go to
`admission.outputs.OutputLengths`; `vllm:kv_cache_usage_perc` gives the blocks vLLM holds. Both
come from the text already parsed for the capacity.

It also feeds the engine's feedback (`admission.engine`, the loop of calibrated reservations):
each round that read an endpoint gives it the blocks vLLM holds, the preemptions vLLM counted
since the last round (`vllm:num_preemptions_total`, its deltas summed over the pool's
endpoints; a counter that went down is a restart, whose whole count is new) and the intervals
between a sequence's consecutive tokens that vLLM observed since
(`vllm:inter_token_latency_seconds`, or `vllm:time_per_output_token_seconds` on an older vLLM),
from which it keeps the decode rate.
An endpoint's first reading is the baseline and counts no preemption: what happened before
kvguard watched says nothing of its reservations; its intervals count what the server observed
since it started. A change of the trust is logged. The requests waiting in vLLM's queues
(`vllm:num_requests_waiting`) are summed as the blocks it holds are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from kvguard.admission.calibration import Calibration, calibrated
from kvguard.admission.capacity import Capacities, PodCapacity, PoolCapacity
from kvguard.admission.engine import EngineFeedback
from kvguard.admission.outputs import Observed, OutputLengths
from kvguard.admission.policy import Policy
from kvguard.config.redact import redact
from kvguard.config.schema import CapacityConfig
from kvguard.ops.dns import Resolver, resolve, service_urls
from kvguard.ops.readings import Endpoint, Learnt, learn, total
from kvguard.ops.scrape import fetch, read_credential, why
from kvguard.ops.vllm_metrics import DiscoveryError, EndpointCache, EndpointReading

log = logging.getLogger(__name__)

# An endpoint's last good reading is used for this many refresh intervals after it was read.
STALE_AFTER_REFRESHES = 3
# A refresh never waits longer than this for one endpoint.
MAX_FETCH_SECONDS = 5.0
# How often the loop looks at the policy for added or removed pools, at most.
_IDLE_S = 1.0


def combine(
    readings: Mapping[str, EndpointCache],
    waiting: Mapping[str, int | None] | None = None,
    failing: Collection[str] = (),
) -> PoolCapacity:
    """A pool's capacity from its endpoints' readings (by URL), each endpoint a pod of it with
    its vLLM queue (`waiting`, by URL); block sizes must agree. An endpoint whose last read
    failed (`failing`) counts in the sum while its reading lasts, but is not a pod to pick:
    requests are sent only where the last read answered."""
    if not readings:
        raise DiscoveryError("no endpoint has reported its cache")
    sizes = {url: r.block_size for url, r in readings.items()}
    if len(set(sizes.values())) != 1:
        described = ", ".join(f"{redact(url)}: {size}" for url, size in sorted(sizes.items()))
        raise DiscoveryError(f"endpoints disagree on block_size ({described})")
    queues = waiting or {}
    pods = [
        PodCapacity(pod_address(url), r.usable_blocks, queues.get(url))
        for url, r in readings.items()
        if url not in failing
    ]
    pods.sort(key=lambda pod: pod.address)
    return PoolCapacity(
        sum(r.usable_blocks for r in readings.values()), next(iter(sizes.values())), tuple(pods)
    )


def pod_address(url: str) -> str:
    """The host:port an endpoint's URL reaches (its scheme's port when it names none), as the
    endpoint picker names a pod: `http://user:pw@10.0.0.7:8000/metrics` -> `10.0.0.7:8000`."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    if parts.port is None:
        host = f"{host}:{443 if parts.scheme == 'https' else 80}"
    return host


@dataclass
class _Pool:
    refresh_seconds: float
    urls: frozenset[str] = frozenset()  # the endpoints the policy names now (or DNS gave)
    service: str | None = None  # the Service they come from, when they do
    next_due: float = 0.0
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    capacity: PoolCapacity | None = None
    published: bool = False
    error: str | None = None  # why the capacity is unknown, while it is
    used: int | None = None  # blocks vLLM reports in use, summed over the endpoints
    waiting: int | None = None  # requests waiting in vLLM's queues, summed likewise


class Discovery:
    """Keeps `capacities` current for every pool of the policy configured with endpoints.

    `policy` is read on every round, so a reload that adds, drops or changes a discovered pool
    takes effect within a second. Static capacities are set by whoever publishes the policy
    (Service.publish); a reading that was in flight across a reload is published only if the
    pool still discovers from the same endpoints, so it never overwrites them.

    With a `calibration`, the output lengths learnt go to its `outputs` and each round's engine
    signals to its `engine` feedback; with `outputs` alone, the output lengths only. Without a
    calibration, the signals go to a feedback of discovery's own (for the decode rate and the
    preemptions; its trust is read by no one).
    """

    def __init__(
        self,
        policy: Callable[[], Policy],
        capacities: Capacities,
        *,
        calibration: Calibration | None = None,
        outputs: OutputLengths | None = None,
        clock: Callable[[], float] = time.monotonic,
        resolver: Resolver = resolve,
        on_read: Callable[[str], None] = lambda _pool: None,
    ) -> None:
        if calibration is not None and outputs not in (None, calibration.outputs):
            raise ValueError("a calibration brings its own outputs: pass one or the other")
        self._policy = policy
        self._capacities = capacities
        self._calibration = calibration
        self._outputs = calibration.outputs if calibration is not None else outputs
        self._engine = calibration.engine if calibration is not None else EngineFeedback()
        self._clock = clock
        self._resolve = resolver  # a Service's name to its pods' addresses
        # A pool was read: its capacity, vLLM's unaccounted blocks or the trust of its estimate
        # may have moved, and with them what its queue's waiters can get.
        self._on_read = on_read
        self._pools: dict[str, _Pool] = {}

    def unknown(self) -> dict[str, str]:
        """Discovered pools whose capacity is unknown after a refresh, with the reason."""
        return {name: s.error for name, s in self._pools.items() if s.error is not None}

    def ages(self) -> dict[str, float]:
        """Discovered pools with a known capacity -> seconds since the oldest reading it sums."""
        now = self._clock()
        return {
            name: max(
                (now - e.read_at for e in state.endpoints.values() if e.reading is not None),
                default=0.0,
            )
            for name, state in self._pools.items()
            if state.capacity is not None
        }

    def used_blocks(self) -> dict[str, int]:
        """Discovered pools -> the KV blocks their vLLM servers report in use (held by running
        and waiting requests), where every endpoint in use reports its KV-cache usage."""
        return {name: s.used for name, s in self._pools.items() if s.used is not None}

    def waiting(self) -> dict[str, int]:
        """Discovered pools -> the requests waiting in their vLLM servers' queues, where every
        endpoint in use reports them."""
        return {name: s.waiting for name, s in self._pools.items() if s.waiting is not None}

    def preemptions_total(self) -> dict[str, int]:
        """Discovered pools -> the preemptions their vLLM servers counted since kvguard started
        reading them (each endpoint's first reading is its baseline)."""
        totals = {name: self._engine.preemptions(name) for name in self._pools}
        return {name: total for name, total in totals.items() if total is not None}

    def decode_rate(self, pool: str) -> float | None:
        """The pool's decode rate in tokens per second per sequence, as last observed; None
        until its servers observed an interval between two tokens."""
        return self._engine.decode_rate(pool) if pool in self._pools else None

    def trust(self) -> dict[str, float]:
        """Discovered pools -> how far their calibrated reservations trust the estimate (1: the
        estimate; 0: the worst case); empty without a calibration."""
        if self._calibration is None:
            return {}
        return {name: self._engine.trust(name) for name in self._pools}

    def _discovered(self) -> dict[str, CapacityConfig]:
        """Pool name -> its capacity's settings, for the pools discovered now."""
        return {
            pool.name: pool.config.capacity
            for pool in self._policy().pools.values()
            if pool.config.capacity.discovered
        }

    async def refresh(self, session: aiohttp.ClientSession, *, only_due: bool = False) -> None:
        """Read every discovered pool's endpoints (with `only_due`, the pools whose time has
        come) and publish the capacities. A pool discovered from a Service resolves it first,
        so that its endpoints follow the pods that come and go."""
        wanted = self._discovered()
        for gone in [name for name in self._pools if name not in wanted]:
            del self._pools[gone]  # the policy dropped it or made it static
        if self._outputs is not None:
            self._outputs.retain(set(wanted))
        self._engine.retain(set(wanted))
        now = self._clock()
        rounds = []
        for name, capacity in wanted.items():
            refresh_seconds = capacity.refresh_seconds
            state = self._pools.get(name)
            if state is None:
                state = self._pools[name] = _Pool(refresh_seconds)
            elif state.refresh_seconds != refresh_seconds:
                state.refresh_seconds, state.next_due = refresh_seconds, 0.0
            if state.service != capacity.service:
                state.service, state.next_due = capacity.service, 0.0
            if capacity.service is not None:
                if only_due and now < state.next_due:
                    continue
                endpoints = await self._resolved(name, state, capacity.service)
            else:
                endpoints = list(capacity.endpoints or [])
            if state.urls != frozenset(endpoints):
                state.urls, state.next_due = frozenset(endpoints), 0.0
            for url in [u for u in state.endpoints if u not in endpoints]:
                del state.endpoints[url]
            if only_due and now < state.next_due:
                continue
            state.next_due = now + refresh_seconds
            rounds.append(
                self._refresh_pool(session, name, state, endpoints, capacity.api_key_file)
            )
        await asyncio.gather(*rounds)

    async def _resolved(self, name: str, state: _Pool, service: str) -> list[str]:
        """The endpoints of `service` now; the last ones known when DNS cannot answer (a name
        without records is a Service without ready pods: no endpoints)."""
        host, _, port = service.rpartition(":")
        timeout = min(MAX_FETCH_SECONDS, state.refresh_seconds)
        try:
            addresses = await asyncio.wait_for(self._resolve(host.strip("[]"), int(port)), timeout)
        except (OSError, TimeoutError) as exc:
            log.warning(
                "pool %s: resolving %s failed (%s: %s); its last %d endpoint(s) are kept",
                name,
                service,
                type(exc).__name__,
                exc,
                len(state.urls),
            )
            return sorted(state.urls)
        urls = service_urls(addresses, int(port))
        if frozenset(urls) != state.urls:
            log.info("pool %s: %s resolves to %d endpoint(s)", name, service, len(urls))
        return urls

    async def _refresh_pool(
        self,
        session: aiohttp.ClientSession,
        name: str,
        state: _Pool,
        endpoints: Iterable[str],
        api_key_file: str | None,
    ) -> None:
        urls = list(endpoints)
        timeout = min(MAX_FETCH_SECONDS, state.refresh_seconds)
        credential = read_credential(api_key_file)
        # An endpoint that fails in a way no one foresaw is one more error, never a round that
        # stops short of publishing (which would keep the other endpoints' readings forever).
        results = await asyncio.gather(
            *(fetch(session, url, timeout, credential) for url in urls), return_exceptions=True
        )
        if not self._still_discovers(name, state, urls):
            log.info("pool %s: a capacity reading from before a reload is dropped", name)
            return
        now = self._clock()
        learnt: list[Learnt] = []
        for url, outcome in zip(urls, results, strict=True):
            result = why(outcome) if isinstance(outcome, BaseException) else outcome
            endpoint = state.endpoints.setdefault(url, Endpoint())
            if isinstance(result, EndpointReading):
                if endpoint.error is not None:
                    log.info("pool %s: capacity discovery from %s recovered", name, redact(url))
                endpoint.reading, endpoint.read_at, endpoint.error = result, now, None
                learnt.append(learn(endpoint, result))
            else:
                if endpoint.error is None:
                    kept = (
                        f"keeping its last reading for up to "
                        f"{STALE_AFTER_REFRESHES * state.refresh_seconds:g}s"
                        if endpoint.reading is not None
                        else "no reading yet"
                    )
                    log.warning(
                        "pool %s: capacity discovery from %s failed (%s); %s",
                        name,
                        redact(url),
                        result,
                        kept,
                    )
                endpoint.error = result
        self._publish(name, state, now)
        self._feed(name, now, learnt)
        if learnt:
            self._follow(name, state, learnt, now)

    def _feed(self, name: str, now: float, learnt: list[Learnt]) -> None:
        """Add the deltas this round read from the pool's endpoints, summed, to the outputs."""
        if self._outputs is None:
            return
        generated = total(x.generated for x in learnt)
        if generated is not None:
            pool = self._policy().pools.get(name)
            window_s = pool.config.reservation.window_seconds if pool is not None else None
            self._outputs.add(name, Observed(now, generated), window_s)

    def _follow(self, name: str, state: _Pool, learnt: list[Learnt], now: float) -> None:
        """The engine's signals of a round that read at least one endpoint, summed over the
        pool's endpoints, to the engine's feedback: the blocks in use, the preemptions since
        the last round and the intervals between tokens. A change of the trust is logged."""
        counted = [x.preemptions for x in learnt if x.preemptions is not None]
        preempted = sum(counted)
        intervals = [x.intervals for x in learnt if x.intervals is not None]
        capacity = state.capacity.blocks if state.capacity is not None else 0
        moved = self._engine.read(
            name,
            now,
            capacity_blocks=capacity,
            used=state.used,
            preempted=preempted if counted else None,
            intervals=sum(i.count for i in intervals),
            interval_s=sum(i.seconds for i in intervals),
        )
        if moved is None or self._calibration is None:
            return
        before, after = moved.before, moved.after
        if not self._calibrated(name):
            # Nothing reserves by the estimate here: the trust is kept, quietly, for a reload.
            log.debug("pool %s: reservation trust %.3g (was %.3g)", name, after, before)
        elif after < before:
            log.warning(
                "pool %s: %d preemptions since the last reading%s; calibrated reservations fall "
                "back towards worst case: trust %.3g (was %.3g)",
                name,
                preempted,
                f", KV cache {state.used} of {capacity} blocks in use" if moved.full else "",
                after,
                before,
            )
        else:
            log.info(
                "pool %s: no preemptions since the last reading; calibrated reservations move "
                "back towards their estimate: trust %.3g (was %.3g)",
                name,
                after,
                before,
            )

    def _calibrated(self, name: str) -> bool:
        """Whether some tier reserves by the estimate in pool `name` (its mode or its own)."""
        policy = self._policy()
        pool = policy.pools.get(name)
        return pool is not None and calibrated(pool.config, policy.tenancy.tiers.values())

    def _still_discovers(self, name: str, state: _Pool, urls: list[str]) -> bool:
        """Whether the pool, in the policy of now, still discovers from exactly `urls` (a
        reload during the fetch may have made it static, dropped it or changed its endpoints).
        """
        pool = self._policy().pools.get(name)
        if pool is None or self._pools.get(name) is not state:
            return False
        capacity = pool.config.capacity
        if capacity.service is not None:  # its endpoints are what DNS gave this round
            return capacity.service == state.service and state.urls == frozenset(urls)
        return set(capacity.endpoints or []) == set(urls)

    def _publish(self, name: str, state: _Pool, now: float) -> None:
        max_age = STALE_AFTER_REFRESHES * state.refresh_seconds
        readings = {}
        used: list[int | None] = []
        waiting: list[int | None] = []
        for url, endpoint in state.endpoints.items():
            if endpoint.reading is not None and now - endpoint.read_at > max_age:
                log.error(
                    "pool %s: the last reading from %s is older than %gs: it no longer counts",
                    name,
                    redact(url),
                    max_age,
                )
                endpoint.reading = None
            if endpoint.reading is not None:
                readings[url] = endpoint.reading.cache
                used.append(endpoint.reading.used_blocks)
                waiting.append(endpoint.reading.waiting)
        capacity: PoolCapacity | None = None
        error = None
        try:
            failing = {url for url, e in state.endpoints.items() if e.error is not None}
            capacity = combine(readings, dict(zip(readings, waiting, strict=True)), failing)
        except DiscoveryError as exc:
            failures = "; ".join(
                f"{redact(u)}: {e.error}" for u, e in state.endpoints.items() if e.error
            )
            error = f"{exc}" + (f" ({failures})" if failures and not readings else "")
        if capacity is not None and _shape(capacity) != _shape(state.capacity):
            log.info(
                "pool %s: capacity %d blocks of %d tokens from %d endpoint(s)",
                name,
                capacity.blocks,
                capacity.block_size,
                len(readings),
            )
        elif capacity is None and (state.capacity is not None or not state.published):
            log.error(
                "pool %s: capacity unknown: %s; its requests get 503 capacity_unknown",
                name,
                error,
            )
        state.capacity, state.published, state.error = capacity, True, error
        # Blocks vLLM holds and requests it queues, where every endpoint in use reports them.
        state.used = _sum_known(used)
        state.waiting = _sum_known(waiting)
        if self._capacities.get(name) != capacity:
            self._capacities.set(name, capacity)
        self._on_read(name)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Refresh each pool when it is due, until `stop` is set (or the task is cancelled)."""
        stop = stop or asyncio.Event()
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    await self.refresh(session, only_due=True)
                except Exception:  # a bug here must not end discovery for good
                    log.exception("capacity discovery round failed")
                due = [state.next_due for state in self._pools.values()]
                wait = min([_IDLE_S, *(d - self._clock() for d in due)])
                # A periodic timer, not a synchronisation: stop ends the wait at once.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(wait, 0.01))


def _shape(capacity: PoolCapacity | None) -> object:
    """What an operator is told of when it changes: the blocks and the pods, not their queues."""
    if capacity is None:
        return None
    return capacity.blocks, capacity.block_size, [(p.address, p.blocks) for p in capacity.pods]


def _sum_known(values: list[int | None]) -> int | None:
    """The sum, when there is at least one value and every one is known; else None."""
    if not values or None in values:
        return None
    return sum(v for v in values if v is not None)
