"""What a request reserves for its output in `calibrated` mode, and how its lease grows.

- `Calibration` learns what requests produce, per pool and tier and per tenant, from the
  completions kvguard reads (docs/design.md, "The response path"), and falls back to the pool's
  distribution that vLLM exports (`outputs.OutputLengths`). `estimate` gives the configured
  quantile, or None (worst case) while too few samples exist.
- `Overcommit` is the closed loop with the engine: how far each pool's reservations trust the
  estimate (1: the estimate; 0: the worst case). Preemptions halve the trust at once; readings
  without preemptions give it back slowly (additive increase, multiplicative decrease).
- `Growth` follows a lease's request as it decodes: elapsed time times the pool's decode rate, or
  the tokens seen in its stream, up to its limit; and when it is expected to end, its limit less
  what it produced at that rate.

Pure data and arithmetic: times are arguments, nothing here reads a clock or does I/O, so that
`serve` and `kvguard simulate` feed and read the same objects.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvguard.admission.estimate import blocks_needed
from kvguard.admission.outputs import OutputLengths
from kvguard.config.schema import Pool, Tier

# Samples kept per pool and tier, and per tenant: the newest, within the window.
MAX_SAMPLES = 2048
# Every this many observations, windows left empty are forgotten.
PRUNE_EVERY = 1024
# The loop: the trust kept after a reading with new preemptions (or a KV cache as good as
# full), and the trust each second without gives back (200 s from worst case to the estimate:
# 0.05 a reading at discovery's default 10 s). A reading counts at most MAX_QUIET_S of quiet.
BACKOFF = 0.5
RELAX_PER_S = 0.005
MAX_QUIET_S = 30.0
# vLLM preempts when a running sequence needs a block and none is free; it counts the
# preemption only when that sequence is scheduled again, tens of seconds later under load. A
# KV cache this full is taken as the same sign, at once.
PRESSURE_SHARE = 0.98
# A decode rate (tokens per second per sequence) assumed until vLLM reports one: fast, so that
# leases grow early rather than late (and a refusal is told to come back early, not late).
DEFAULT_DECODE_RATE = 100.0


def ends_in_s(output_tokens: float, tokens_per_s: float | None) -> float:
    """Seconds until a request with `output_tokens` left to produce per sequence is expected to
    end, at the pool's decode rate (DEFAULT_DECODE_RATE while it is unknown)."""
    return max(0.0, output_tokens) / (tokens_per_s or DEFAULT_DECODE_RATE)


def reservation_mode(pool: Pool, tier: Tier) -> str:
    """The mode a tier's requests reserve by in `pool`: the tier's own, else the pool's."""
    return tier.reservation_mode or pool.reservation.mode


def calibrated(pool: Pool, tiers: Iterable[Tier]) -> bool:
    """Whether some of `tiers` reserves by the estimate in `pool`."""
    return any(reservation_mode(pool, tier) == "calibrated" for tier in tiers)


class Window:
    """Output lengths observed over the last `window_s` seconds (`MAX_SAMPLES` at most), kept
    sorted so that a quantile is one index."""

    def __init__(self, window_s: float, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._max = max_samples
        self._arrived: deque[tuple[float, int]] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, tokens: int, at: float) -> None:
        self.expire(at)
        self._arrived.append((at, tokens))
        bisect.insort(self._sorted, tokens)
        if len(self._arrived) > self._max:
            self._drop()

    def expire(self, now: float) -> None:
        while self._arrived and now - self._arrived[0][0] > self.window_s:
            self._drop()

    def _drop(self) -> None:
        _, tokens = self._arrived.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, tokens)]

    def quantile(self, q: float) -> int:
        """The nearest-rank q-quantile (the smallest sample with at least q of them at or below
        it). The window must not be empty. The rank is rounded first: 0.55 * 100 is
        55.00000000000001 in floating point, and its rank is 55."""
        rank = max(1, math.ceil(round(q * len(self._sorted), 9)))
        return self._sorted[rank - 1]


@dataclass(frozen=True, slots=True)
class Estimate:
    """The output one sequence of a request reserves, before its limit caps it."""

    tokens: int  # what the learnt quantile says a sequence produces
    source: str  # tenant | tier | pool (vLLM's histogram) | oracle (the simulator's truth)
    trust: float = 1.0  # the loop's: 1 reserves the estimate, 0 the whole limit
    floor: int = 1  # reserve at least this (pools[].reservation.min_tokens)

    def reserve(self, limit: int) -> int:
        """Output tokens to reserve for a sequence whose limit is `limit`: the estimate moved
        towards the limit as far as trust is lost, at least `floor`, at most `limit`."""
        if self.tokens >= limit:
            return limit
        blended = self.tokens + (1.0 - self.trust) * (limit - self.tokens)
        return min(limit, max(self.floor, math.ceil(blended)))


@dataclass
class Overcommit:
    """Per pool, how far reservations trust the estimate: the loop with vLLM's preemptions."""

    backoff: float = BACKOFF
    relax_per_s: float = RELAX_PER_S
    _trust: dict[str, float] = field(default_factory=dict)
    _read_at: dict[str, float] = field(default_factory=dict)

    def trust(self, pool: str) -> float:
        return self._trust.get(pool, 1.0)

    def read(
        self, pool: str, preemptions: int, at: float, *, full: bool = False
    ) -> float | None:  # fmt: skip
        """One reading of the engine at `at`, with `preemptions` new since the last, and
        whether its KV cache was as good as full: the new trust when it changed, else None."""
        before = self.trust(pool)
        quiet_s = min(MAX_QUIET_S, max(0.0, at - self._read_at.get(pool, at)))
        self._read_at[pool] = at
        if preemptions > 0 or full:
            after = before * self.backoff
            after = 0.0 if after < self.relax_per_s * 5 else after  # below 0.025: worst case
        else:
            after = min(1.0, before + self.relax_per_s * quiet_s)
        if after == before:
            return None
        self._trust[pool] = after
        return after

    def retain(self, pools: set[str]) -> None:
        for gone in [name for name in self._trust if name not in pools]:
            del self._trust[gone]
            self._read_at.pop(gone, None)


class EngineView:
    """Per pool, the blocks vLLM holds beyond what the ledger counts: its reading of blocks in
    use less the blocks the ledger reserved then (never below 0). Traffic that does not pass
    kvguard, or a request that outgrew its lease before growth counted it, shows here; a
    calibrated admission must fit under the pool's limit less these. Both readings come in
    from the caller (discovery and the ledger's view in `serve`, the engine model in the
    simulator); per process."""

    def __init__(self) -> None:
        self._reserved: dict[str, int] = {}  # pool -> the ledger's blocks, as last read
        self._unaccounted: dict[str, int] = {}

    def reserved(self, pool: str, blocks: int) -> None:
        """The ledger reserves `blocks` in `pool` now."""
        self._reserved[pool] = blocks

    def read(self, pool: str, used: int | None) -> None:
        """vLLM reports `used` blocks in use in `pool` now (None: not known)."""
        if used is None:
            self._unaccounted.pop(pool, None)
        else:
            self._unaccounted[pool] = max(0, used - self._reserved.get(pool, 0))

    def unaccounted(self, pool: str) -> int:
        return self._unaccounted.get(pool, 0)

    def retain(self, pools: set[str]) -> None:
        for gone in [name for name in self._unaccounted if name not in pools]:
            del self._unaccounted[gone]
        for gone in [name for name in self._reserved if name not in pools]:
            del self._reserved[gone]


class Calibration:
    """Learnt output lengths per (pool, tier) and (pool, tier, tenant), and the estimate an
    admission reads. `outputs` holds the pool-wide distributions that vLLM exports."""

    def __init__(self, outputs: OutputLengths | None = None) -> None:
        self.outputs = outputs or OutputLengths()
        self.overcommit = Overcommit()
        self.engine = EngineView()
        # (pool, tier) and (pool, tier, tenant): their window
        self._windows: dict[tuple[str, ...], Window] = {}
        self._observed = 0

    def observe(self, pool: Pool, tier: str, tenant: str, tokens: int, at: float) -> None:
        """One completion of `tenant` (of `tier`) in `pool` produced `tokens` per sequence."""
        window_s = pool.reservation.window_seconds
        for key in ((pool.name, tier), (pool.name, tier, tenant)):
            window = self._windows.get(key)
            if window is None or window.window_s != window_s:
                window = self._windows[key] = Window(window_s)
            window.add(tokens, at)
        self._observed += 1
        if self._observed % PRUNE_EVERY == 0:
            self._prune(at)

    def _prune(self, now: float) -> None:
        """Forget the windows whose samples all expired (tenants that went quiet)."""
        for key, window in list(self._windows.items()):
            window.expire(now)
            if not window:
                del self._windows[key]

    def samples(self, pool: str, tier: str, tenant: str | None = None) -> int:
        """Samples in the window of the tier (or of one tenant), as last expired."""
        window = self._windows.get((pool, tier) if tenant is None else (pool, tier, tenant))
        return len(window) if window is not None else 0

    def estimate(
        self, pool: Pool, tier_name: str, tier: Tier, tenant: str, at: float
    ) -> Estimate | None:
        """What a request of `tenant` reserves per sequence, before its limit caps it; None to
        reserve the whole limit (worst-case mode, or too few samples yet)."""
        settings = pool.reservation
        if reservation_mode(pool, tier) != "calibrated":
            return None
        tokens, source = self._learnt(pool, tier_name, tenant, at)
        if tokens is None:
            return None
        trust = self.overcommit.trust(pool.name)
        return Estimate(tokens, source, trust, settings.min_tokens)

    def _learnt(self, pool: Pool, tier: str, tenant: str, at: float) -> tuple[int | None, str]:
        settings = pool.reservation
        for window, source in (
            (self._windows.get((pool.name, tier, tenant)), "tenant"),
            (self._windows.get((pool.name, tier)), "tier"),
        ):
            if window is None:
                continue
            window.expire(at)
            if len(window) >= settings.min_samples:
                return window.quantile(settings.quantile), source
        generated = self.outputs.generated(pool.name)
        if generated is not None and generated.count >= settings.min_samples:
            value = generated.quantile(settings.quantile)
            if value is not None and math.isfinite(value):
                return max(1, math.ceil(value)), "pool"
        return None, ""


@dataclass(frozen=True, slots=True)
class Growth:
    """How a lease's blocks follow its request: each of its `n` sequences per prompt holds the
    prompt and the output decoded so far, which grows past what was reserved as it decodes.
    When the loop loses trust in the estimate, the reservation moves towards the limit too."""

    pool: str
    prompt_tokens: tuple[int, ...]
    n: int
    block_size: int
    limit: int  # the output limit vLLM applies
    reserved_output: int  # output tokens per sequence the lease reserved at admission
    admitted_at: float
    estimate: Estimate | None = None  # what sized reserved_output, to size it again

    def blocks_at(
        self, now: float, tokens_per_s: float, seen: int = 0, trust: float | None = None
    ) -> int:
        """The blocks to count at `now`: output so far taken as the elapsed time at
        `tokens_per_s` per sequence, or the `seen` tokens of its stream when more, or the
        estimate reserved again at the pool's `trust` of now; never less than reserved nor
        more than the limit."""
        decoded = math.ceil(max(0.0, now - self.admitted_at) * tokens_per_s)
        output = max(self.reserved_output, decoded, seen)
        if trust is not None and self.estimate is not None and trust < self.estimate.trust:
            output = max(output, replace(self.estimate, trust=trust).reserve(self.limit))
        return blocks_needed(list(self.prompt_tokens), min(self.limit, output), self.n,
                             self.block_size)  # fmt: skip

    def ends_in_s(self, now: float, tokens_per_s: float | None, seen: int | None = None) -> float:
        """Seconds from `now` until it is expected to end: its limit less what it produced (the
        `seen` tokens of its stream per sequence, else the elapsed time at the rate), at the
        rate."""
        rate = tokens_per_s or DEFAULT_DECODE_RATE
        produced = seen if seen is not None else max(0.0, now - self.admitted_at) * rate
        return ends_in_s(self.limit - produced, rate)

    @property
    def grows(self) -> bool:
        return self.reserved_output < self.limit

    @property
    def limit_blocks(self) -> int:
        """The blocks of the whole limit: the worst case, where growth stops."""
        return blocks_needed(list(self.prompt_tokens), self.limit, self.n, self.block_size)
