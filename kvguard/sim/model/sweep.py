"""The policies replayed side by side: each on the same trace and engine model, at each rate
scale, with a quiet tenant beside the trace when asked. On several pods a gated policy runs once
per routing: `round_robin` (the gateway's balancing; kvguard counts the pool's sum) and `pick`
(kvguard reserves on a pod and the request goes there, as `routing: pick` in serve).

The quiet tenant sends QUIET_RATE requests per second whatever the scale (Poisson arrivals from
a fixed seed, over the scaled trace's window), each with the trace's median prompt and output
and no max_tokens. Its p99 TTFT is measured beside the trace and with its requests replayed
alone, under the same policy.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import replace

from kvguard.admission.capacity import PodCapacity, PoolCapacity
from kvguard.config.schema import Config
from kvguard.sim.model.engine import EngineConfig
from kvguard.sim.model.gate import PolicyGate
from kvguard.sim.model.policies import POLICIES, Policy
from kvguard.sim.model.replay import Run, pod_names, replay
from kvguard.sim.model.report import PolicyStats, policy_stats, tenant_p99
from kvguard.sim.model.trace import Trace, TraceError, TraceRequest

QUIET_TENANT = "quiet"
QUIET_RATE = 0.2  # requests per second, whatever the rate scale
QUIET_SEED = 20231116  # its arrivals are the same on every run


def quiet_requests(trace: Trace, seed: int = QUIET_SEED) -> list[TraceRequest]:
    """A quiet tenant beside `trace`: Poisson arrivals at QUIET_RATE over the trace's window,
    each with the trace's median prompt and output and no max_tokens of its own."""
    prompt = int(statistics.median_low(r.prompt_tokens for r in trace.requests))
    output = int(statistics.median_low(r.output_tokens for r in trace.requests))
    draw = random.Random(seed)
    arrivals: list[TraceRequest] = []
    at = draw.expovariate(QUIET_RATE)
    while at <= trace.duration_s:
        arrivals.append(TraceRequest(at, QUIET_TENANT, prompt, output))
        at += draw.expovariate(QUIET_RATE)
    return arrivals


def with_quiet(trace: Trace, quiet: list[TraceRequest]) -> Trace:
    """`trace` with the quiet tenant's requests among its own, in order of arrival."""
    if QUIET_TENANT in trace.tenants:
        raise TraceError(f"the trace has a tenant {QUIET_TENANT!r}: --quiet-tenant adds one")
    # sorted is stable: at equal arrivals the trace's rows come first, in their order.
    merged = sorted([*trace.requests, *quiet], key=lambda r: r.arrival_s)
    return Trace(trace.format, merged)


# How requests reach the pods: the gateway's round robin, or kvguard's pick.
ROUTINGS = ("round_robin", "pick")


async def replay_policy(
    requests: list[TraceRequest],
    policy: Policy,
    config: Config,
    capacity: PoolCapacity,
    engine: EngineConfig,
    retries: int = 0,
    pods: int = 1,
    routing: str = "round_robin",
) -> Run:
    """`requests` replayed under `policy` on `pods` fresh engines (and a ledger, when it gates,
    over the pool's `capacity`: every pod's blocks), routed by `routing` (ROUTINGS; the
    ungated policy is always round robin)."""
    if not policy.gated:
        return await replay(requests, engine, None, label=policy.name, pods=pods)
    label = policy.name
    if routing == "pick":  # the ledger picks among the pods, each with its own cache
        blocks = engine.num_gpu_blocks - 1
        names = pod_names(pods)
        capacity = replace(capacity, pods=tuple(PodCapacity(name, blocks) for name in names))
        pool = config.pools[0].model_copy(update={"routing": "pick"})
        config = config.model_copy(update={"pools": [pool, *config.pools[1:]]})
        label = f"{policy.name} pick"
    return await replay(
        requests,
        engine,
        lambda clock: PolicyGate(config, capacity, clock, calibrated=policy.calibrated),
        label=label,
        retries=retries,
        reserve=policy.reserve,
        pods=pods,
        by_lease=routing == "pick",
    )


async def compare(
    trace: Trace,
    config: Config,
    capacity: PoolCapacity,
    engine: EngineConfig,
    retries: int = 0,
    policies: list[Policy] | None = None,
    pods: int = 1,
    routings: Sequence[str] = ("round_robin",),
) -> list[Run]:
    """One run per policy (all of them by default) and routing (the ungated policy once), on
    the same trace and engine model."""
    chosen = policies if policies is not None else list(POLICIES.values())
    return [
        await replay_policy(
            trace.requests, policy, config, capacity, engine, retries, pods, routing
        )
        for routing in routings
        for policy in chosen
        if policy.gated or routing == routings[0]
    ]


async def measure(
    trace: Trace,
    config: Config,
    capacity: PoolCapacity,
    engine: EngineConfig,
    *,
    policies: list[Policy],
    scales: Sequence[float],
    retries: int,
    slo_s: float,
    quiet_tenant: bool,
    pods: int = 1,
    routings: Sequence[str] = ("round_robin",),
) -> tuple[list[PolicyStats], list[Run]]:
    """Each policy's figures at each rate scale (the quiet tenant added when asked), and the
    runs of the last scale."""
    rows: list[PolicyStats] = []
    runs: list[Run] = []
    for scale in scales:
        scaled = trace.scaled(scale)
        quiet = quiet_requests(scaled) if quiet_tenant else []
        if quiet_tenant:
            scaled = with_quiet(scaled, quiet)
        runs = await compare(scaled, config, capacity, engine, retries, policies, pods, routings)
        runs_of = [
            (policy, routing)
            for routing in routings
            for policy in policies
            if policy.gated or routing == routings[0]
        ]
        for (policy, routing), run in zip(runs_of, runs, strict=True):
            stats = policy_stats(run, scale, policy.gated, slo_s)
            if quiet_tenant:
                alone = await replay_policy(
                    quiet, policy, config, capacity, engine, pods=pods, routing=routing
                )
                stats = replace(stats, quiet_p99=tenant_p99(run, QUIET_TENANT),
                                quiet_alone_p99=tenant_p99(alone, QUIET_TENANT))  # fmt: skip
            rows.append(stats)
    return rows, runs
