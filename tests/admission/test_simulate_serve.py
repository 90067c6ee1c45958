"""Property-based: `kvguard simulate` (sim.gate.PolicyGate) and `kvguard serve`
(admission.admit.Admission with a memory ledger) decide every request alike.

Configurations are random: shadow mode, tiers (cap, default, quota), whether unknown tenants get a
default tier, max_model_len, block size, capacity and watermark. So are the requests: several
tenants, prompts that may fill the context, outputs sent as max_tokens or left to the tier's
default, with some admitted requests released in between. Serve gets what Envoy would send it (the
tenant header, a completion body) and a counter that returns the request's prompt count; the gate
gets the trace request (its `max_tokens` column set or empty). Both must give the same refusal code
(or none), the same output limit, the same blocks, and leave their ledgers holding the same blocks
per tenant. A reservation policy's smaller reservation changes only the blocks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, cast

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvguard.admission import decide
from kvguard.admission.admit import AdmissionRequest
from kvguard.admission.calibration import Calibration, Estimate
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.leases import Lease
from kvguard.admission.outputs import Histogram, Observed
from kvguard.admission.policy import identify_request
from kvguard.admission.record import Decision
from kvguard.admission.sizing import blocks_needed
from kvguard.config.schema import (
    CapacityConfig,
    Config,
    PoolConfig,
    ReservationConfig,
    TenancyConfig,
    TierConfig,
)
from kvguard.errors import Refusal
from kvguard.ledger.memory import MemoryLedger
from kvguard.sim.model.gate import PolicyGate, generation_bounds
from kvguard.sim.model.trace import TraceRequest
from tests.admission.serving import MODEL, serve

TENANTS = ["", "a", "b", "c"]  # "" is a request without the tenant header


@dataclass(frozen=True)
class Ask:
    tenant: str
    prompt_tokens: int
    output_tokens: int
    sends_max_tokens: bool


@dataclass(frozen=True)
class Release:
    which: int  # an index into the leases held, modulo their number


@st.composite
def cases(draw: st.DrawFn) -> tuple[Config, list[Ask | Release]]:
    """A configuration and the steps to run on it, their sizes drawn around the pool's: most
    requests need a few blocks, some need more than a tier or the pool allows."""
    block_size = draw(st.sampled_from([16, 4, 32, 1]))
    blocks = draw(st.integers(1, 400))
    max_model_len = draw(st.integers(8, 4096))
    tier_map = {}
    for name in draw(st.lists(st.sampled_from(["free", "pro", "max"]), min_size=1, unique=True)):
        cap = draw(st.integers(1, 4 * block_size) | st.integers(1, 1024))
        tier_map[name] = TierConfig(
            max_tokens_cap=cap,
            default_max_tokens=draw(st.integers(1, cap)),
            max_blocks=draw(st.integers(1, blocks)),
        )
    names = sorted(tier_map)
    # Each named tenant has a tier of its own, or none (then it gets the default tier, if any).
    mapped = {tenant: draw(st.sampled_from([*names, None])) for tenant in TENANTS[1:]}
    tenancy = TenancyConfig(
        default_tier=draw(st.sampled_from([*names, None])),
        tiers=tier_map,
        tenants={tenant: tier for tenant, tier in mapped.items() if tier is not None},
    )
    pool = PoolConfig(
        name="p",
        models=[MODEL],
        tokenizer="/models/p",  # not read: the counter is given the counts
        max_model_len=max_model_len,
        watermark=draw(st.sampled_from([0.15, 0.0, 0.05, 0.3, 0.5])),
        capacity=CapacityConfig(blocks=blocks, block_size=block_size),
        retry_after_max_seconds=draw(st.sampled_from([30.0, 0.0])),
    )
    small = st.integers(1, 4 * block_size)
    ask = st.builds(
        Ask,
        tenant=st.sampled_from(TENANTS),
        prompt_tokens=small | st.integers(1, max_model_len + 64),
        output_tokens=small | st.integers(1, 2000),
        sends_max_tokens=st.booleans(),
    )
    release = st.builds(Release, st.integers(0, 50))
    step = st.integers(0, 5).flatmap(lambda k: release if k == 0 else ask)  # 1 in 6 releases
    steps = cast(list[Ask | Release], draw(st.lists(step, min_size=10, max_size=40)))
    return Config(tenancy=tenancy, pools=[pool], shadow=draw(st.booleans())), steps


@dataclass(frozen=True)
class Learnt:
    """What both calibrations are fed before the steps: completions per tenant, and the
    output lengths the pool's engines reported (None: no scrape yet)."""

    completions: list[tuple[str, int]]
    pool_outputs: list[int] | None


@st.composite
def calibrated_cases(draw: st.DrawFn) -> tuple[Config, list[Ask | Release], Learnt]:
    """A case whose pool is in calibrated mode (each tier keeping it, or replacing it either
    way), with few enough samples needed that estimates come from tenants, tiers and the pool."""
    config, steps = draw(cases())
    pool = config.pools[0]
    reservation = ReservationConfig(
        mode="calibrated",
        quantile=draw(st.sampled_from([0.5, 0.9, 0.95, 1.0])),
        min_samples=draw(st.integers(1, 6)),
        min_tokens=draw(st.integers(1, 32)),
    )
    modes = st.sampled_from([None, None, "calibrated", "worst_case"])
    tiers = {
        name: tier.model_copy(update={"reservation_mode": draw(modes)})
        for name, tier in config.tenancy.tiers.items()
    }
    tenancy = config.tenancy.model_copy(update={"tiers": tiers})
    pools = [pool.model_copy(update={"reservation": reservation})]
    config = config.model_copy(update={"tenancy": tenancy, "pools": pools})
    tokens = st.integers(1, 4 * (pool.capacity.block_size or 1)) | st.integers(1, 2000)
    completions = draw(st.lists(st.tuples(st.sampled_from(TENANTS), tokens), max_size=30))
    pool_outputs = draw(st.none() | st.lists(tokens, max_size=12))
    return config, steps, Learnt(completions, pool_outputs)


def learn(
    calibration: Calibration, pool: PoolConfig, tenancy: TenancyConfig, learnt: Learnt
) -> None:
    for tenant, tokens in learnt.completions:
        tier = tenancy.tier_of(tenant)
        if tier is not None:
            calibration.observe(pool, tier, tenant, tokens, 0.0)
    if learnt.pool_outputs is not None:
        bounds = generation_bounds(pool.max_model_len)
        counts = [sum(1 for t in learnt.pool_outputs if t <= bound) for bound in bounds]
        histogram = Histogram(
            bounds,
            tuple(float(c) for c in counts),
            float(len(learnt.pool_outputs)),
            float(sum(learnt.pool_outputs)),
        )
        calibration.outputs.add(pool.name, Observed(0.0, histogram))


async def both_decide(
    config: Config, steps: list[Ask | Release], learnt: Learnt | None = None
) -> None:
    """Both decide each step alike; with `learnt`, in calibrated mode, both calibrations fed it."""
    pool = config.pools[0]
    assert pool.capacity.blocks is not None and pool.capacity.block_size is not None
    gate = PolicyGate(
        config,
        PoolCapacity(pool.capacity.blocks, pool.capacity.block_size),
        lambda: 0.0,
        calibrated=learnt is not None,
    )
    calibration = None
    if learnt is not None:
        assert gate.calibration is not None
        calibration = Calibration()
        learn(gate.calibration, gate.pool, config.tenancy, learnt)
        learn(calibration, pool, config.tenancy, learnt)
    # Both tell refused requests when their leases are expected to end, at the decode rate
    # neither has measured yet; each request is new (its own body and id), so none is a retry.
    admission, policy, ledger, counter = serve(config, calibration=calibration)
    held: list[tuple[Lease, Lease]] = []  # (simulate's, serve's) lease of each admitted request
    for i, step in enumerate(steps):
        await same_usage(gate, ledger)
        if isinstance(step, Release):
            if held:
                simulated, served = held.pop(step.which % len(held))
                await gate.release(simulated)
                await ledger.release(served)
            continue
        sent = step.output_tokens if step.sends_max_tokens else None
        request = TraceRequest(0.0, step.tenant, step.prompt_tokens, step.output_tokens, sent)
        verdict = await gate.admit(request, f"r{i}")
        event(verdict.refused or "admitted")
        body: dict[str, Any] = {"model": MODEL, "prompt": f"ask {i}"}
        if step.sends_max_tokens:
            body["max_tokens"] = step.output_tokens
        counter.prompt_tokens = step.prompt_tokens
        decision = Decision()
        try:
            identity = identify_request(policy, {config.tenancy.header: step.tenant})
            raw = json.dumps(body).encode()
            admitted = await admission.admit(
                AdmissionRequest(policy, "completion", identity, raw, decision)
            )
        except Refusal as refusal:
            assert verdict.refused == refusal.code.value, (step, refusal.message)
            # The same promise, or the same word not to retry (the jitter differs).
            assert verdict.should_retry == (refusal.should_retry is not False), step
            assert (verdict.retry_after_s is None) == (refusal.retry_after_s is None), step
            if verdict.retry_after_s is not None:
                event("promised")
            if decision.max_tokens is not None:  # refused once sized
                assert verdict.max_tokens == decision.max_tokens, step
            continue
        assert verdict.refused is None, (step, verdict)
        if admitted.would_refuse is not None:  # shadow mode: passed as sent, without a lease
            assert verdict.would_refuse == admitted.would_refuse.value, step
            assert verdict.lease is None and admitted.lease is None and admitted.body is None
            continue
        assert verdict.would_refuse is None, (step, verdict)
        assert verdict.lease is not None and admitted.lease is not None
        sent = json.loads(admitted.body)["max_tokens"] if admitted.body else step.output_tokens
        assert verdict.max_tokens == decision.max_tokens == sent, step
        assert verdict.clamped == (admitted.body is not None), step  # lowered or injected
        assert verdict.lease.blocks == admitted.lease.blocks == admitted.blocks, step
        assert verdict.lease.tenant == admitted.lease.tenant, step
        event(f"reserved from {decision.reserved_from}")
        held.append((verdict.lease, admitted.lease))
    await same_usage(gate, ledger)


async def same_usage(gate: PolicyGate, ledger: MemoryLedger) -> None:
    """Both ledgers hold the same blocks, per tenant, and the same promises."""
    simulated, served = await gate.ledger.usage(gate.pool.name), await ledger.usage(gate.pool.name)
    assert (simulated.reserved, simulated.tenants) == (served.reserved, served.tenants)
    assert (simulated.promised, simulated.promises) == (served.promised, served.promises)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(case=cases())
def test_simulate_and_serve_decide_the_same(case: tuple[Config, list[Ask | Release]]) -> None:
    asyncio.run(both_decide(*case))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(case=calibrated_cases())
def test_simulate_and_serve_decide_the_same_when_calibrated(
    case: tuple[Config, list[Ask | Release], Learnt],
) -> None:
    """In calibrated mode too, fed the same samples: their estimates size requests alike."""
    asyncio.run(both_decide(*case))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    case=cases(),
    prompt=st.integers(1, 600),
    sent=st.none() | st.integers(1, 2000),
    reserve=st.integers(-5, 2100),
)
def test_a_smaller_reservation_changes_only_the_blocks(
    case: tuple[Config, list[Ask | Release]], prompt: int, sent: int | None, reserve: int
) -> None:
    """`decide.plan` with an estimate (a reservation policy's) keeps the limits
    `serve` applies and reserves the estimate, capped by the limit and at least 1 token."""
    config = case[0]
    pool, tier = config.pools[0], next(iter(config.tenancy.tiers.values()))
    assert pool.capacity.blocks is not None and pool.capacity.block_size is not None
    capacity = PoolCapacity(pool.capacity.blocks, pool.capacity.block_size)
    counted = decide.Counted("completion", {} if sent is None else {"max_tokens": sent}, [prompt])
    try:
        worst = decide.plan(counted, pool, "a", tier, capacity)
    except Refusal as refusal:
        with pytest.raises(Refusal) as caught:
            decide.plan(counted, pool, "a", tier, capacity, Estimate(reserve, "oracle"))
        assert caught.value.code == refusal.code
        return
    estimated = decide.plan(counted, pool, "a", tier, capacity, Estimate(reserve, "oracle"))
    assert estimated.limits == worst.limits and worst.reserved_output == worst.limits.max_tokens
    assert estimated.reserved_output == max(1, min(reserve, worst.limits.max_tokens))
    assert estimated.blocks == blocks_needed(
        [prompt], estimated.reserved_output, 1, capacity.block_size
    )
    assert estimated.blocks <= worst.blocks
    assert (estimated.quota, estimated.pool_limit) == (worst.quota, worst.pool_limit)
