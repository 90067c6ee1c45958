"""The engine's feedback: what each reading of a pool's vLLM servers tells the decision.

One entry, `EngineFeedback.read`, takes one reading of a pool: the blocks vLLM holds (compared
with the blocks the ledger reserves, as last given to `reserved`), the preemptions it counted
since the last reading, and the intervals between a sequence's consecutive tokens it observed
since. Capacity discovery (ops/discovery.py) calls it each round that read one of the pool's
endpoints, the simulator's gate (sim/model/gate.py) each `refresh_seconds` of simulated time, so
`serve` and `kvguard simulate` follow the same rules:

- the pressure rule: a KV cache at PRESSURE_SHARE of the pool's capacity or more counts as a
  preemption, at once;
- `Overcommit`, the closed loop with the engine: how far each pool's calibrated reservations
  trust the estimate (1: the estimate; 0: the worst case). Preemptions halve the trust at once;
  readings without preemptions give it back slowly (additive increase, multiplicative decrease);
- `EngineView`: the blocks vLLM holds beyond what the ledger counts;
- the decode rate, in tokens per second per sequence: the intervals observed divided by their
  seconds (a reading without any keeps the last rate);
- the preemptions counted since the pool's first reading.

Pure data and arithmetic: times are arguments, nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True, slots=True)
class TrustMoved:
    """A reading that moved a pool's trust: from `before` to `after`; `full` when its KV cache
    was as good as full (PRESSURE_SHARE of the capacity or more)."""

    before: float
    after: float
    full: bool


class EngineFeedback:
    """Per pool, what the engine's readings taught: the trust of the estimate (`overcommit`),
    the blocks vLLM holds beyond the ledger (`view`), the decode rate and the preemptions."""

    def __init__(self) -> None:
        self.overcommit = Overcommit()
        self.view = EngineView()
        self._decode_rate: dict[str, float] = {}  # tokens/s per sequence, as last observed
        self._preemptions: dict[str, int] = {}  # counted since the first reading

    def read(
        self,
        pool: str,
        at: float,
        *,
        capacity_blocks: int = 0,
        used: int | None = None,
        preempted: int | None = None,
        intervals: float = 0.0,
        interval_s: float = 0.0,
    ) -> TrustMoved | None:
        """One reading of `pool`'s engine at `at`: `used` of its `capacity_blocks` blocks in use
        (None: not known; the ledger's blocks are as last given to `reserved`), `preempted`
        preemptions since the last reading (None: the engine
        counts none), and `intervals` between consecutive tokens observed since, `interval_s`
        seconds in all. The trust's move when it moved, else None."""
        if preempted is not None:
            self._preemptions[pool] = self._preemptions.get(pool, 0) + preempted
        if intervals > 0 and interval_s > 0:
            self._decode_rate[pool] = intervals / interval_s
        self.view.read(pool, used)
        full = capacity_blocks > 0 and used is not None and used >= PRESSURE_SHARE * capacity_blocks
        before = self.overcommit.trust(pool)
        after = self.overcommit.read(pool, preempted or 0, at, full=full)
        return TrustMoved(before, after, full) if after is not None else None

    def reserved(self, pool: str, blocks: int) -> None:
        """The ledger reserves `blocks` in `pool` now: what the next reading's blocks in use are
        compared with."""
        self.view.reserved(pool, blocks)

    def trust(self, pool: str) -> float:
        """How far the pool's calibrated reservations trust the estimate (1: the estimate; 0:
        the worst case)."""
        return self.overcommit.trust(pool)

    def unaccounted(self, pool: str) -> int:
        """The blocks vLLM held beyond the ledger's at the last reading."""
        return self.view.unaccounted(pool)

    def decode_rate(self, pool: str) -> float | None:
        """The pool's decode rate in tokens per second per sequence, as last observed; None
        until an interval between two tokens was observed."""
        return self._decode_rate.get(pool)

    def preemptions(self, pool: str) -> int | None:
        """The preemptions counted since the pool's first reading; None until a reading gave
        a count (an engine that counts none)."""
        return self._preemptions.get(pool)

    def retain(self, pools: set[str]) -> None:
        """Forget the pools no longer read."""
        self.overcommit.retain(pools)
        self.view.retain(pools)
        for gone in [name for name in self._decode_rate if name not in pools]:
            del self._decode_rate[gone]
        for gone in [name for name in self._preemptions if name not in pools]:
            del self._preemptions[gone]
