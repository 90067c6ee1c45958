"""Capacity discovery: a pool's KV-cache size, read from its vLLM endpoints' /metrics.

vLLM publishes its cache configuration as the labels of one gauge sample,
``vllm:cache_config_info{block_size="128",num_gpu_blocks="64",...} 1.0``. A pool's capacity is
sum(num_gpu_blocks - 1) over its endpoints (vLLM keeps one block back: its null block), and
every endpoint must report the same block size (nothing assumes 16: the CPU backend uses 128).

Each pool is refreshed every `capacity.refresh_seconds`. An endpoint that cannot be read keeps
its last good reading for STALE_AFTER_REFRESHES refresh intervals; after that it counts for
nothing, and a pool with no endpoint left has unknown capacity (its requests get 503
capacity_unknown; the other pools are untouched). Every change of state is logged once, each
endpoint's URL with its credentials masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvguard.admission.capacity import Capacities, PoolCapacity
from kvguard.admission.policy import Policy
from kvguard.config.redact import redact

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
# An endpoint's last good reading is used for this many refresh intervals after it was read.
STALE_AFTER_REFRESHES = 3
# A refresh never waits longer than this for one endpoint.
MAX_FETCH_SECONDS = 5.0
# How often the loop looks at the policy for added or removed pools, at most.
_IDLE_S = 1.0


class DiscoveryError(Exception):
    """An endpoint's /metrics (or a pool's endpoints together) cannot give a capacity."""


@dataclass(frozen=True, slots=True)
class EndpointCache:
    """What one endpoint reports: usable blocks (null blocks taken off) and the block size."""

    usable_blocks: int
    block_size: int


def parse_cache_config(text: str) -> EndpointCache:
    """The cache configuration in Prometheus exposition `text` from a vLLM /metrics.

    One sample per engine (a data-parallel server has several, each with its own cache and its
    own null block); their usable blocks add up. Raises DiscoveryError when the gauge is missing
    or its labels are not usable.
    """
    try:
        samples = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == CACHE_CONFIG_INFO
        ]
    except ValueError as exc:
        raise DiscoveryError(f"the /metrics text does not parse: {exc}") from None
    if not samples:
        raise DiscoveryError(f"no {CACHE_CONFIG_INFO} in /metrics (is this a vLLM server?)")
    usable = 0
    block_sizes: set[int] = set()
    for sample in samples:
        blocks = _label_int(sample.labels, "num_gpu_blocks")
        if blocks < 2:
            raise DiscoveryError(f"{CACHE_CONFIG_INFO}: num_gpu_blocks={blocks} leaves no block")
        usable += blocks - 1
        block_sizes.add(_label_int(sample.labels, "block_size"))
    if len(block_sizes) != 1:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: engines disagree on block_size {block_sizes}")
    return EndpointCache(usable, block_sizes.pop())


def _label_int(labels: Mapping[str, str], name: str) -> int:
    value = labels.get(name)
    if value is None:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO} has no {name} label")
    try:
        number = int(value)
    except ValueError:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: {name}={value!r} is not an integer") from None
    if number <= 0:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: {name}={number} must be positive")
    return number


def combine(readings: Mapping[str, EndpointCache]) -> PoolCapacity:
    """A pool's capacity from its endpoints' readings (by URL); block sizes must agree."""
    if not readings:
        raise DiscoveryError("no endpoint has reported its cache")
    sizes = {url: r.block_size for url, r in readings.items()}
    if len(set(sizes.values())) != 1:
        described = ", ".join(f"{redact(url)}: {size}" for url, size in sorted(sizes.items()))
        raise DiscoveryError(f"endpoints disagree on block_size ({described})")
    return PoolCapacity(sum(r.usable_blocks for r in readings.values()), next(iter(sizes.values())))


def metrics_url(endpoint: str) -> str:
    """The /metrics URL of an endpoint given as its base URL (or as its /metrics URL)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


@dataclass
class _Endpoint:
    reading: EndpointCache | None = None
    read_at: float = 0.0
    error: str | None = None  # the last failure, while failing


@dataclass
class _Pool:
    refresh_seconds: float
    urls: frozenset[str] = frozenset()  # the endpoints the policy names now
    next_due: float = 0.0
    endpoints: dict[str, _Endpoint] = field(default_factory=dict)
    capacity: PoolCapacity | None = None
    published: bool = False
    error: str | None = None  # why the capacity is unknown, while it is


class Discovery:
    """Keeps `capacities` current for every pool of the policy configured with endpoints.

    `policy` is read on every round, so a reload that adds, drops or changes a discovered pool
    takes effect within a second. Static capacities are set by whoever publishes the policy
    (Service.publish); a reading that was in flight across a reload is published only if the
    pool still discovers from the same endpoints, so it never overwrites them.
    """

    def __init__(
        self,
        policy: Callable[[], Policy],
        capacities: Capacities,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._capacities = capacities
        self._clock = clock
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

    def _discovered(self) -> dict[str, tuple[list[str], float]]:
        """Pool name -> (endpoints, refresh_seconds) for the pools with endpoints now."""
        return {
            pool.name: (list(pool.config.capacity.endpoints), pool.config.capacity.refresh_seconds)
            for pool in self._policy().pools.values()
            if pool.config.capacity.endpoints
        }

    async def refresh(self, session: aiohttp.ClientSession, *, only_due: bool = False) -> None:
        """Read every discovered pool's endpoints (with `only_due`, the pools whose time has
        come) and publish the capacities."""
        wanted = self._discovered()
        for gone in [name for name in self._pools if name not in wanted]:
            del self._pools[gone]  # the policy dropped it or made it static
        now = self._clock()
        rounds = []
        for name, (endpoints, refresh_seconds) in wanted.items():
            state = self._pools.get(name)
            if state is None:
                state = self._pools[name] = _Pool(refresh_seconds)
            elif state.refresh_seconds != refresh_seconds:
                state.refresh_seconds, state.next_due = refresh_seconds, 0.0
            if state.urls != frozenset(endpoints):
                state.urls, state.next_due = frozenset(endpoints), 0.0
            for url in [u for u in state.endpoints if u not in endpoints]:
                del state.endpoints[url]
            if only_due and now < state.next_due:
                continue
            state.next_due = now + refresh_seconds
            rounds.append(self._refresh_pool(session, name, state, endpoints))
        await asyncio.gather(*rounds)

    async def _refresh_pool(
        self, session: aiohttp.ClientSession, name: str, state: _Pool, endpoints: Iterable[str]
    ) -> None:
        urls = list(endpoints)
        timeout = min(MAX_FETCH_SECONDS, state.refresh_seconds)
        # An endpoint that fails in a way no one foresaw is one more error, never a round that
        # stops short of publishing (which would keep the other endpoints' readings forever).
        results = await asyncio.gather(
            *(_fetch(session, url, timeout) for url in urls), return_exceptions=True
        )
        if not self._still_discovers(name, state, urls):
            log.info("pool %s: a capacity reading from before a reload is dropped", name)
            return
        now = self._clock()
        for url, outcome in zip(urls, results, strict=True):
            result = _why(outcome) if isinstance(outcome, BaseException) else outcome
            endpoint = state.endpoints.setdefault(url, _Endpoint())
            if isinstance(result, EndpointCache):
                if endpoint.error is not None:
                    log.info("pool %s: capacity discovery from %s recovered", name, redact(url))
                endpoint.reading, endpoint.read_at, endpoint.error = result, now, None
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

    def _still_discovers(self, name: str, state: _Pool, urls: list[str]) -> bool:
        """Whether the pool, in the policy of now, still discovers from exactly `urls` (a
        reload during the fetch may have made it static, dropped it or changed its endpoints).
        """
        pool = self._policy().pools.get(name)
        endpoints = pool.config.capacity.endpoints if pool is not None else None
        return self._pools.get(name) is state and set(endpoints or []) == set(urls)

    def _publish(self, name: str, state: _Pool, now: float) -> None:
        max_age = STALE_AFTER_REFRESHES * state.refresh_seconds
        readings = {}
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
                readings[url] = endpoint.reading
        capacity: PoolCapacity | None = None
        error = None
        try:
            capacity = combine(readings)
        except DiscoveryError as exc:
            failures = "; ".join(
                f"{redact(u)}: {e.error}" for u, e in state.endpoints.items() if e.error
            )
            error = f"{exc}" + (f" ({failures})" if failures and not readings else "")
        if capacity is not None and capacity != state.capacity:
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
        if self._capacities.get(name) != capacity:
            self._capacities.set(name, capacity)

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


async def _fetch(session: aiohttp.ClientSession, url: str, timeout: float) -> EndpointCache | str:
    """The endpoint's reading, or why there is none."""
    try:
        async with session.get(
            metrics_url(url), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                return f"/metrics answered HTTP {response.status}"
            body = await response.read()
    except aiohttp.InvalidURL:
        return "not a URL the HTTP client can use"  # its message is the URL, credentials and all
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return _why(exc)
    try:
        return parse_cache_config(body.decode())  # Prometheus's text format is UTF-8
    except UnicodeDecodeError:
        return "/metrics answered a body that is not UTF-8"
    except DiscoveryError as exc:
        return str(exc)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
