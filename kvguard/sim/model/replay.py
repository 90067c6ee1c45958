"""Replay a trace against the engine model in simulated time (a discrete-event simulation).

Time jumps from event to event: an engine step lasts its modelled cost, an idle engine waits
for the next arrival. A request is decided when it arrives (by the gate, when there is one),
joins the engine's waiting queue, and is picked up by the next step. Finished requests release
their lease when their step ends. A request sends the trace's `max_tokens` (or none) and its
answer stops at the trace's output length, or at the limit the engine applies when that is less:
kvguard's clamped or injected one when gated, else the client's, else vLLM's own default
(max_model_len less the prompt). Refused requests are not retried unless asked to.

A pool of several pods is several engines, each with its own cache, scheduler and steps, as
vLLM runs one per pod; an admitted request goes to the next pod in turn (`round_robin`: Envoy's
balancing, which knows nothing of what is reserved where), or, `by_lease`, to the pod its lease
was reserved on (kvguard's pick, the pods named by `pod_names`); a pod preempts on its own.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.errors import RETRY_AFTER_S, Code
from kvguard.sim.model.engine import Engine, EngineConfig, Sequence, StepResult
from kvguard.sim.model.gate import PolicyGate, Verdict
from kvguard.sim.model.metrics import Snapshot, snapshot
from kvguard.sim.model.trace import TraceRequest

MAX_SAMPLES = 2000  # timeline points kept for the plot


@dataclass
class Outcome:
    """What became of one trace request."""

    request: TraceRequest
    verdict: Verdict  # the last decision (after any retries)
    seq: Sequence | None = None  # None when refused
    attempts: int = 1

    @property
    def ttft_s(self) -> float | None:
        if self.seq is None or self.seq.first_token_at is None:
            return None
        return self.seq.first_token_at - self.request.arrival_s  # from the first attempt


@dataclass
class KvUse:
    """KV blocks the engine holds and the ledger reserves during each step, weighted by the
    step's duration: means over the time the engine is busy, and peaks."""

    busy_s: float = 0.0
    used_block_s: float = 0.0
    reserved_block_s: float = 0.0
    used_peak: int = 0
    reserved_peak: int = 0

    def add(self, seconds: float, used: int, reserved: int) -> None:
        self.busy_s += seconds
        self.used_block_s += used * seconds
        self.reserved_block_s += reserved * seconds
        self.used_peak = max(self.used_peak, used)
        self.reserved_peak = max(self.reserved_peak, reserved)

    @property
    def used_mean(self) -> float:
        return self.used_block_s / self.busy_s if self.busy_s else 0.0

    @property
    def reserved_mean(self) -> float:
        return self.reserved_block_s / self.busy_s if self.busy_s else 0.0


@dataclass
class Run:
    label: str
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[Snapshot] = field(default_factory=list)
    decisions: list[tuple[float, bool]] = field(default_factory=list)  # (time, admitted)
    reserved: list[tuple[float, int]] = field(default_factory=list)  # ledger blocks (guarded)
    trust: list[tuple[float, float]] = field(default_factory=list)  # the loop's (calibrated)
    end_s: float = 0.0
    preemptions: int = 0
    pod_preemptions: list[int] = field(default_factory=list)  # each pod's, in pod order
    # The blocks the pods held, each over its own busy time (the peak: the fullest any pod
    # was), and the ledger's reservations (the pool's) over the same steps.
    kv: KvUse = field(default_factory=KvUse)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pod_names(pods: int) -> list[str]:
    """What the ledger calls the simulated pods, in the engines' order."""
    return [f"pod-{i}" for i in range(pods)]


async def replay(
    requests: list[TraceRequest],
    config: EngineConfig,
    gate_factory: Callable[[Callable[[], float]], PolicyGate] | None,
    *,
    label: str,
    retries: int = 0,
    reserve: Callable[[TraceRequest], int | None] | None = None,
    pods: int = 1,
    by_lease: bool = False,
) -> Run:
    """Run `requests` (sorted by arrival) through `pods` fresh engines of `config`, admitted
    requests sent to them in turn; guarded when a gate is made, each request reserving
    `reserve(request)` output tokens (None, or no `reserve`: its whole limit).

    A request refused with a 429 comes back after its retry-after (in ms, as the OpenAI SDK
    reads it), `retries` times at most, unless told not to retry; its TTFT counts from its
    first arrival.
    """
    clock = _Clock()
    gate = gate_factory(clock) if gate_factory is not None else None
    engines = [Engine(config) for _ in range(pods)]
    turn = itertools.cycle(engines)  # round robin over the pods
    on_pod = dict(zip(pod_names(pods), engines, strict=True))
    steps: list[StepResult | None] = [None] * pods  # the step each pod is in, if any
    run = Run(label)
    horizon = requests[-1].arrival_s if requests else 0.0
    sample_every = max(horizon, 1.0) / MAX_SAMPLES * 2
    next_sample = 0.0
    open_leases: dict[str, tuple[Verdict, Sequence]] = {}
    # (time, tie-breaker, request index, attempt): first arrivals, then retries as they come.
    arrivals = [(r.arrival_s, i, i, 0) for i, r in enumerate(requests)]
    heapq.heapify(arrivals)
    order = itertools.count(len(requests))

    # Promised retries waiting for their held blocks: index -> (attempt, until when).
    waiting: dict[int, tuple[int, float]] = {}

    async def arrive(at: float, index: int, attempt: int, *, final: bool = False) -> None:
        request = requests[index]
        clock.now = at
        room = config.max_model_len - request.prompt_tokens
        if gate is None:
            limit = request.max_tokens if request.max_tokens is not None else max(room, 1)
            verdict = Verdict("", limit)
        else:
            reserved = reserve(request) if reserve is not None else None
            verdict = await gate.admit(
                request, f"sim-{index}", reserve_output=reserved, final=final
            )
            if verdict.wait_s > 0:  # it waits on its stream, decided again as blocks free
                waiting[index] = (attempt, at + verdict.wait_s)
                return
        waiting.pop(index, None)
        if verdict.refused is None and verdict.max_tokens > room:
            # vLLM itself answers 400: prompt + max_tokens above max_model_len.
            if gate is not None and verdict.lease is not None:
                await gate.release(verdict.lease)
            verdict = Verdict(verdict.tier, verdict.max_tokens, verdict.clamped,
                              refused=Code.CONTEXT_LENGTH_EXCEEDED.value)  # fmt: skip
        run.decisions.append((at, verdict.refused is None))
        if (
            verdict.refused is not None
            and attempt < retries
            and Code(verdict.refused).status == 429
            and verdict.should_retry
        ):
            wait = verdict.retry_after_s if verdict.retry_after_s is not None else RETRY_AFTER_S
            heapq.heappush(arrivals, (at + wait, next(order), index, attempt + 1))
            return
        outcome = Outcome(request, verdict, attempts=attempt + 1)
        run.outcomes.append(outcome)
        if verdict.refused is not None:
            return
        outcome.seq = Sequence(
            str(index),
            request.prompt_tokens,
            verdict.max_tokens,
            arrival=at,
            tenant=request.tenant,
            stop_after=request.output_tokens,
        )
        lease = verdict.lease
        if by_lease and lease is not None and lease.pod:
            on_pod[lease.pod].add(outcome.seq)
        else:
            next(turn).add(outcome.seq)
        open_leases[outcome.seq.uid] = (verdict, outcome.seq)

    def progress() -> list[tuple[Verdict, int]]:
        return [(verdict, seq.output_tokens) for verdict, seq in open_leases.values()]

    def idle() -> bool:
        return all(step is None for step in steps) and all(e.idle for e in engines)

    now = 0.0
    while arrivals or waiting or not idle():
        if idle():
            if not arrivals:  # only waiters left: their waits end
                now = max(now, min(until for _, until in waiting.values()))
                for index, (attempt, until) in list(waiting.items()):
                    await arrive(now, index, attempt, final=now >= until)
                continue
            now = max(now, arrivals[0][0])
        while arrivals and arrivals[0][0] <= now:
            at, _, index, attempt = heapq.heappop(arrivals)
            await arrive(at, index, attempt)
        # Each pod without a step in progress starts one with what it has.
        for pod, engine in enumerate(engines):
            if steps[pod] is None:
                steps[pod] = engine.step(now)
        ends = [(step.end, pod) for pod, step in enumerate(steps) if step is not None]
        if not ends:
            continue
        end, pod = min(ends)
        # Arrivals before the first step ends are decided at their own time; a pod that was
        # idle starts on them at once, the others take them at their next step.
        if arrivals and arrivals[0][0] < end:
            now = arrivals[0][0]
            while arrivals and arrivals[0][0] <= now:
                at, _, index, attempt = heapq.heappop(arrivals)
                await arrive(at, index, attempt)
            continue
        engine, result = engines[pod], steps[pod]
        assert result is not None
        steps[pod] = None
        now = clock.now = result.end
        # What the step held: the engine freed the finished sequences' blocks as it ended, and
        # their leases are released next.
        freed = sum(math.ceil(seq.computed / config.block_size) for seq in result.finished)
        used = min(engine.pool.used + freed, config.usable_blocks)
        run.kv.add(result.end - result.start, used, gate.held if gate else 0)
        for seq in result.finished:
            verdict, _ = open_leases.pop(seq.uid)
            if gate is not None and verdict.lease is not None:
                gate.finished(verdict, seq.output_tokens)
                await gate.release(verdict.lease)
        # Waiting retries are decided again as blocks free, first come first; those whose
        # wait is over get their final answer.
        for index, (attempt, until) in list(waiting.items()):
            await arrive(now, index, attempt, final=now >= until)
        if gate is not None:
            gate.stepped(result.end - result.start)
            preemptions = sum(e.preemptions_total for e in engines)
            used_now = sum(e.pool.used for e in engines)
            await gate.tick(now, preemptions, used_now, progress)
        if now >= next_sample or idle():
            run.timeline.append(snapshot(engines, now))
            if gate is not None:
                run.reserved.append((now, await gate.reserved()))
                run.trust.append((now, gate.trust))
            next_sample = now + sample_every
    run.end_s = now
    run.pod_preemptions = [e.preemptions_total for e in engines]
    run.preemptions = sum(run.pod_preemptions)
    return run
