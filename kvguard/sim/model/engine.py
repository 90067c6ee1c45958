"""A model of vLLM v1's engine core, as pure code: no clock, no I/O.

It follows vllm/v1/core/sched/scheduler.py (`Scheduler.schedule`, FCFS policy) and
vllm/v1/core/kv_cache_manager.py (`allocate_slots`) of vllm 0.32:

- Continuous batching. Each step has a token budget (`max_num_batched_tokens`). Running
  sequences are served first, in order, each with all the tokens it lacks (a decode: one;
  a prefill: its prompt, chunked to what is left of the budget). Waiting sequences are admitted
  next, first come first served, while the budget lasts and fewer than `max_num_seqs` run.
- KV blocks are allocated as tokens are computed: ceil(tokens / block_size) per sequence,
  nothing reserved for the output to come. When a running sequence's next tokens need a block
  that is not free, the newest running sequence is preempted (its blocks freed, its progress
  dropped: recompute preemption) and put at the front of the waiting queue, so it resumes before
  newer requests; this repeats until the allocation fits or the sequence preempted itself. A
  step that preempted admits no waiting sequence. A waiting sequence is admitted only when its
  whole input (prompt + output so far, less prefix-cache hits) fits in the free blocks, not just
  its first chunk (vLLM's scheduler_reserve_full_isl, on by default); one that does not fit
  stops admission (no skipping ahead).
- A resumed sequence recomputes its prompt and the output it had; prefix caching may spare the
  full blocks that are still cached (see blocks.py).
- A sequence samples a token when a step computes its last missing token; it finishes after
  `max_tokens` tokens (or its natural end, `stop_after`, when the request did not ignore EOS).

Simplified: one engine (no data/pipeline parallelism), no speculative decoding, no async
scheduling (vLLM turns it off on CPU), no priority policy, no long-prefill threshold, no
multimodal encoder budget, and a step's cost is a linear model (StepCost), not measured compute.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvguard.sim.model.blocks import Block, BlockPool

# vLLM's bucket bounds (seconds) for vllm:inter_token_latency_seconds.
TOKEN_GAP_BOUNDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds one engine step takes: base + per prefill token + per decoding sequence."""

    base_s: float = 0.015
    prefill_token_s: float = 0.00005
    decode_seq_s: float = 0.00015

    def of(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM's settings that shape scheduling (defaults: vLLM's OpenAI server on CPU)."""

    num_gpu_blocks: int = 64  # as vLLM reports it: the null block included
    block_size: int = 128
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    watermark: float = 0.0  # vLLM's --watermark: free share kept back from admissions
    # vLLM's scheduler_reserve_full_isl (on by default): admit a waiting sequence only when
    # its whole input (prompt + output so far) fits, not just its first prefill chunk.
    reserve_full_input: bool = True
    cost: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("num_gpu_blocks >= 2, block_size >= 1 and max_num_seqs >= 1")
        if self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_batched_tokens >= 1 and max_model_len >= 2")
        if self.max_model_len > self.usable_blocks * self.block_size:
            # vLLM refuses to start then too: one full-length sequence must fit the cache.
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit {self.usable_blocks} blocks "
                f"of {self.block_size} tokens"
            )

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1  # vLLM keeps one back: its null block


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One engine request: a prompt and up to `max_tokens` output tokens (one of a request's
    `n` choices, or one prompt of a batch completion)."""

    uid: str
    prompt_tokens: int
    max_tokens: int
    arrival: float = 0.0
    tenant: str = ""
    # Keys of the prompt's full blocks (each naming all tokens up to its end), for prefix
    # caching; blocks past them are unique to this sequence.
    prompt_keys: tuple[Hashable, ...] = ()
    stop_after: int | None = None  # the natural end (EOS) when the request does not ignore it

    status: Status = Status.WAITING
    output_tokens: int = 0
    computed: int = 0
    blocks: list[Block] = field(default_factory=list)
    preemptions: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    last_token_at: float | None = None
    _cached: int = 0  # leading blocks already offered to the prefix cache

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def target(self) -> int:
        """Output tokens this sequence will produce."""
        if self.stop_after is None:
            return self.max_tokens
        return max(1, min(self.max_tokens, self.stop_after))

    def block_key(self, index: int, block_size: int) -> Hashable:
        if index < len(self.prompt_keys) and (index + 1) * block_size <= self.prompt_tokens:
            return self.prompt_keys[index]
        return (self.uid, index)


@dataclass
class StepResult:
    start: float
    end: float
    scheduled: dict[str, int]  # uid -> tokens computed in this step
    emitted: list[Sequence]  # sequences that sampled one token at `end`
    finished: list[Sequence]
    preempted: list[Sequence]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.usable_blocks, caching=config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total: dict[str, int] = {}
        # The seconds between a sequence's consecutive tokens (a wait while preempted included,
        # as vLLM counts them): their sum, and how many fell in each of TOKEN_GAP_BOUNDS's
        # buckets, the last one past them all (not cumulative).
        self.token_gap_seconds_total = 0.0
        self.token_gaps = [0] * (len(TOKEN_GAP_BOUNDS) + 1)
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        if seq.prompt_tokens < 1 or seq.max_tokens < 1:
            raise ValueError("a sequence needs at least one prompt and one output token")
        if seq.prompt_tokens + seq.max_tokens > self.config.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, now: float) -> None:
        """End a sequence early (its client went away); idempotent."""
        if seq.status in (Status.FINISHED, Status.ABORTED):
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, now, "abort", Status.ABORTED)

    def step(self, now: float) -> StepResult | None:
        """Schedule one step starting at `now`, run it, and return what it did (None: idle)."""
        if self.idle:
            return None
        scheduled, preempted = self._schedule()
        prefill_tokens = decode_seqs = 0
        for seq, new in scheduled:
            if new == 1 and seq.computed >= seq.prompt_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += new
        end = now + self.config.cost.of(prefill_tokens, decode_seqs)
        emitted, finished = [], []
        for seq, new in scheduled:
            seq.computed += new
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk: no token sampled yet
            seq.output_tokens += 1
            self.generation_tokens_total += 1
            if seq.first_token_at is None:
                seq.first_token_at = end
            if seq.last_token_at is not None:
                gap = end - seq.last_token_at
                self.token_gap_seconds_total += gap
                self.token_gaps[bisect.bisect_left(TOKEN_GAP_BOUNDS, gap)] += 1
            seq.last_token_at = end
            emitted.append(seq)
            if seq.output_tokens >= seq.target:
                self.running.remove(seq)
                reason = "length" if seq.output_tokens >= seq.max_tokens else "stop"
                self._finish(seq, end, reason, Status.FINISHED)
                finished.append(seq)
        return StepResult(now, end, {s.uid: n for s, n in scheduled}, emitted, finished, preempted)

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            new = min(seq.num_tokens - seq.computed, budget)
            while True:
                need = self._new_blocks(seq, len(seq.blocks), seq.computed + new)
                if need <= self.pool.free:
                    seq.blocks.extend(self.pool.allocate(need))
                    break
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: nothing later can be scheduled either
            self._offer_to_cache(seq, seq.computed + new)
            scheduled.append((seq, new))
            budget -= new
            index += 1
        if preempted:
            return scheduled, preempted
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self._prefix_hits(seq)
            computed = len(hits) * self.config.block_size
            new = min(seq.num_tokens - computed, budget)
            need = self._new_blocks(seq, len(hits), computed + new)
            watermark = self._watermark_blocks if self.running else 0
            gate = need
            if self.config.reserve_full_input:
                gate = max(need, self._new_blocks(seq, len(hits), seq.num_tokens))
            if gate + self.pool.evictable(hits) + watermark > self.pool.free:
                break
            self.waiting.popleft()
            if seq.status is Status.WAITING:
                self.prompt_tokens_total += seq.prompt_tokens  # once, not on a recompute
            self.pool.touch(hits)
            seq.blocks = hits + self.pool.allocate(need)
            seq.computed, seq._cached = computed, len(hits)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._offer_to_cache(seq, computed + new)
            scheduled.append((seq, new))
            budget -= new
        return scheduled, preempted

    def _new_blocks(self, seq: Sequence, held: int, tokens: int) -> int:
        return max(0, math.ceil(tokens / self.config.block_size) - held)

    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        if not self.pool.caching:
            return []
        # vLLM leaves at least one token to compute: a hit never covers the whole sequence.
        full = (seq.num_tokens - 1) // self.config.block_size
        return self.pool.lookup([seq.block_key(i, self.config.block_size) for i in range(full)])

    def _offer_to_cache(self, seq: Sequence, tokens: int) -> None:
        """Cache the blocks that `tokens` computed tokens fill (vLLM does so when it
        allocates them, so a sibling admitted later in the same step already hits them)."""
        full = min(tokens, seq.num_tokens) // self.config.block_size
        for index in range(seq._cached, full):
            self.pool.cache(seq.blocks[index], seq.block_key(index, self.config.block_size))
        seq._cached = max(seq._cached, full)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq._cached = [], 0, 0
        seq.status = Status.PREEMPTED
        seq.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, now: float, reason: str, status: Status) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.status, seq.finished_at, seq.finish_reason = status, now, reason
        self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
