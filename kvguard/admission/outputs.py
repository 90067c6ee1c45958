"""What requests really produce: per-pool output-length distributions, learnt from vLLM.

Capacity discovery (ops/discovery.py) reads vLLM's own histogram at each endpoint's /metrics
(`vllm:request_generation_tokens`) and feeds its deltas here; the decision reads quantiles.
Pure data: no clock (times are arguments), no I/O, so that admission may read it and the
simulator may feed it.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# How far back a pool's distribution reaches, in seconds of scrape time.
WINDOW_S = 900.0


class Sampler:
    """Picks `share` of the exchanges by their request id (0 picks none, 1 every one with an
    id). The id decides, not a random draw: Envoy makes it a random UUID, so the share holds,
    and the same request is picked by every kvguard replica and every test run alike."""

    def __init__(self, share: float) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"the sampled share {share} is not in [0, 1]")
        self.share = share
        self._below = round(share * 2**32)

    def pick(self, request_id: str) -> bool:
        if not request_id or self._below == 0:
            return False
        return zlib.crc32(request_id.encode()) < self._below


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram: cumulative counts at each finite upper bound, then the total.

    `bounds` ascend; `cumulative[i]` counts the observations <= bounds[i]; `count` is the +Inf
    bucket (every observation) and `total` the sum of the observed values (tokens)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    total: float

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, (0.0,) * len(bounds), 0.0, 0.0)

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` was read. A counter that went down means the
        server restarted (its counters start again at zero): everything now counted is new."""
        if earlier is None or earlier.bounds != self.bounds or self._went_down(earlier):
            return self
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            self.count - earlier.count,
            self.total - earlier.total,
        )

    def _went_down(self, earlier: Histogram) -> bool:
        """Whether some count or the sum went down, or the difference is no histogram (a
        bucket grew by more than the total): a restart, even one that counted as much again."""
        new = self.count - earlier.count
        return (
            new < 0
            or self.total < earlier.total
            or any(
                a < b or a - b > new
                for a, b in zip(self.cumulative, earlier.cumulative, strict=True)
            )
        )

    def plus(self, other: Histogram) -> Histogram:
        """Both histograms' observations (same bounds: one vLLM version across a pool)."""
        if other.bounds != self.bounds:
            raise ValueError(f"histogram bounds differ: {self.bounds} and {other.bounds}")
        return Histogram(
            self.bounds,
            tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
            self.count + other.count,
            self.total + other.total,
        )

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q <= 1), interpolated linearly inside its bucket as Prometheus's
        histogram_quantile does; the largest finite bound when it falls in the +Inf bucket.
        None without observations."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile {q} is not in (0, 1]")
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank:
                inside = cumulative - below
                if inside <= 0:
                    return bound
                return lower + (bound - lower) * (rank - below) / inside
            lower, below = bound, cumulative
        return self.bounds[-1] if self.bounds else math.inf


@dataclass(frozen=True, slots=True)
class Observed:
    """What one pool's endpoints reported between two scrapes, summed."""

    at: float  # seconds on the feeder's clock
    generated: Histogram  # output tokens per finished request


@dataclass
class _Pool:
    window: deque[Observed]
    generated: Histogram | None = None  # everything learnt since kvguard started
    in_window: Histogram | None = None  # the generated histogram over the window, once summed


class OutputLengths:
    """Per-pool output-length distributions over the last `window_s` seconds of scrapes.

    The feeder (discovery) calls `add` once per pool and scrape with the summed deltas; readers
    ask for `generated(pool)` (a Histogram over the window) and its quantiles."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._pools: dict[str, _Pool] = {}

    def add(self, pool: str, observed: Observed, window_s: float | None = None) -> None:
        """One scrape's deltas for `pool`; `window_s` replaces the window for this pool (its
        `reservation.window_seconds`)."""
        state = self._pools.setdefault(pool, _Pool(deque()))
        window_s = self._window_s if window_s is None else window_s
        state.window.append(observed)
        state.generated = _sum(state.generated, observed.generated)
        while state.window and observed.at - state.window[0].at > window_s:
            state.window.popleft()
        state.in_window = None

    def retain(self, pools: set[str]) -> None:
        """Forget the pools no longer discovered."""
        for gone in [name for name in self._pools if name not in pools]:
            del self._pools[gone]

    def pools(self) -> list[str]:
        return sorted(self._pools)

    def generated(self, pool: str) -> Histogram | None:
        """Output tokens per request over the window; None before the first scrape. Summed once
        per scrape: admissions read it."""
        state = self._pools.get(pool)
        if state is None:
            return None
        if state.in_window is None:
            state.in_window = _window_sum(state.window)
        return state.in_window

    def lifetime(self, pool: str) -> Histogram | None:
        """Output tokens per request since kvguard started learning the pool."""
        state = self._pools.get(pool)
        return state.generated if state is not None else None

    def quantile(self, pool: str, q: float) -> float | None:
        generated = self.generated(pool)
        return generated.quantile(q) if generated is not None else None


def _window_sum(window: Iterable[Observed]) -> Histogram | None:
    """The generated histograms of the scrapes in `window`, summed."""
    out: Histogram | None = None
    for observed in window:
        out = _sum(out, observed.generated)
    return out


def _sum(a: Histogram | None, b: Histogram) -> Histogram:
    """a + b; b alone when the bounds changed (a vLLM upgrade): the newer bounds count."""
    if a is None or a.bounds != b.bounds:
        return b
    return a.plus(b)
