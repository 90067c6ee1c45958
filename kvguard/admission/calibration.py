"""What a request reserves for its output in `calibrated` mode, and how its lease grows.

- `Calibration` learns what requests produce, per pool and tier and per tenant, from the
  completions kvguard reads (`learn`, per sequence; docs/design.md, "The response path"), and
  falls back to the pool's distribution that vLLM exports (`outputs.OutputLengths`).
  `estimate` gives the configured quantile, or None (worst case) while too few samples exist,
  with the trust that the engine's feedback (`engine.EngineFeedback`, held as `engine`) gives.
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
from dataclasses import dataclass, replace

from kvguard.admission.engine import EngineFeedback
from kvguard.admission.outputs import OutputLengths
from kvguard.admission.record import Completion, ReservedFrom
from kvguard.admission.sizing import blocks_needed
from kvguard.config.schema import PoolConfig, TierConfig

# Samples kept per pool and tier, and per tenant: the newest, within the window.
MAX_SAMPLES = 2048
# Every this many observations, windows left empty are forgotten.
PRUNE_EVERY = 1024
# A decode rate (tokens per second per sequence) assumed until vLLM reports one: fast, so that
# leases grow early rather than late (and a refusal is told to come back early, not late).
DEFAULT_DECODE_RATE = 100.0


def ends_in_s(output_tokens: float, tokens_per_s: float | None) -> float:
    """Seconds until a request with `output_tokens` left to produce per sequence is expected to
    end, at the pool's decode rate (DEFAULT_DECODE_RATE while it is unknown)."""
    return max(0.0, output_tokens) / (tokens_per_s or DEFAULT_DECODE_RATE)


def reservation_mode(pool: PoolConfig, tier: TierConfig) -> str:
    """The mode a tier's requests reserve by in `pool`: the tier's own, else the pool's."""
    return tier.reservation_mode or pool.reservation.mode


def calibrated(pool: PoolConfig, tiers: Iterable[TierConfig]) -> bool:
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
    source: ReservedFrom  # what it was learnt from (never WORST_CASE)
    trust: float = 1.0  # the loop's: 1 reserves the estimate, 0 the whole limit
    floor: int = 1  # reserve at least this (pools[].reservation.min_tokens)

    def reserve(self, limit: int) -> int:
        """Output tokens to reserve for a sequence whose limit is `limit`: the estimate moved
        towards the limit as far as trust is lost, at least `floor`, at most `limit`."""
        if self.tokens >= limit:
            return limit
        blended = self.tokens + (1.0 - self.trust) * (limit - self.tokens)
        return min(limit, max(self.floor, math.ceil(blended)))


class Calibration:
    """Learnt output lengths per (pool, tier) and (pool, tier, tenant), and the estimate an
    admission reads. `outputs` holds the pool-wide distributions that vLLM exports."""

    def __init__(self, outputs: OutputLengths | None = None) -> None:
        self.outputs = outputs or OutputLengths()
        self.engine = EngineFeedback()  # the trust of the estimate, vLLM's unaccounted blocks
        # (pool, tier) and (pool, tier, tenant): their window
        self._windows: dict[tuple[str, ...], Window] = {}
        self._observed = 0

    def learn(self, pool: PoolConfig | None, completion: Completion, at: float) -> None:
        """Learn what a released lease's request produced, per sequence, where it is known
        (`pool`: its pool in the policy of now; None when the policy no longer has it)."""
        if completion.completion_tokens is None or pool is None:
            return
        tokens = -(-completion.completion_tokens // max(1, completion.sequences))
        self.observe(pool, completion.tier, completion.tenant, tokens, at)

    def observe(self, pool: PoolConfig, tier: str, tenant: str, tokens: int, at: float) -> None:
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
        self, pool: PoolConfig, tier_name: str, tier: TierConfig, tenant: str, at: float
    ) -> Estimate | None:
        """What a request of `tenant` reserves per sequence, before its limit caps it; None to
        reserve the whole limit (worst-case mode, or too few samples yet)."""
        settings = pool.reservation
        if reservation_mode(pool, tier) != "calibrated":
            return None
        tokens, source = self._learnt(pool, tier_name, tenant, at)
        if tokens is None:
            return None
        trust = self.engine.trust(pool.name)
        return Estimate(tokens, source, trust, settings.min_tokens)

    def _learnt(
        self, pool: PoolConfig, tier: str, tenant: str, at: float
    ) -> tuple[int | None, ReservedFrom]:
        settings = pool.reservation
        for window, source in (
            (self._windows.get((pool.name, tier, tenant)), ReservedFrom.TENANT),
            (self._windows.get((pool.name, tier)), ReservedFrom.TIER),
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
                return max(1, math.ceil(value)), ReservedFrom.POOL
        return None, ReservedFrom.WORST_CASE


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
