"""Calibrated reservations: the learnt windows and their quantiles, what an estimate reserves
under a limit, the overcommit loop, where an estimate comes from, how `decide.plan` sizes a
request with one, and admission answers in a calibrated pool (a memory ledger, given counts)."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest

from kvguard.admission import decide
from kvguard.admission.admit import AdmissionRequest
from kvguard.admission.calibration import MAX_SAMPLES, Calibration, Estimate, Window
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.engine import MAX_QUIET_S, RELAX_PER_S, EngineView, Overcommit
from kvguard.admission.outputs import Histogram, Observed, OutputLengths
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
from kvguard.errors import Code, Refusal
from tests.admission.serving import MODEL, serve

BLOCK = 16
CAPACITY = PoolCapacity(1000, BLOCK)
TIER = TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=500)


def pool(mode: str = "calibrated", **reservation: Any) -> PoolConfig:
    settings = {"min_samples": 3, "min_tokens": 4, "quantile": 0.95, **reservation}
    return PoolConfig(
        name="p",
        models=[MODEL],
        tokenizer="/models/p",
        max_model_len=4096,
        capacity=CapacityConfig(blocks=1000, block_size=BLOCK),
        reservation=ReservationConfig(mode=mode, **settings),  # type: ignore[arg-type]
    )


def fed(
    calibration: Calibration, at_pool: PoolConfig, tier: str, tenant: str, *tokens: int
) -> None:
    for value in tokens:
        calibration.observe(at_pool, tier, tenant, value, 0.0)


# Window


def window_of(values: list[int], window_s: float = 60.0, **kw: int) -> Window:
    window = Window(window_s, **kw)
    for value in values:
        window.add(value, 0.0)
    return window


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.95, 95), (0.5, 50), (0.55, 55), (0.57, 57), (0.07, 7), (1.0, 100), (0.001, 1)],
)
def test_a_window_gives_nearest_rank_quantiles(q: float, expected: int) -> None:
    window = window_of(list(range(100, 0, -1)))  # added out of order: kept sorted
    assert len(window) == 100
    assert window.quantile(q) == expected


def test_a_quantile_of_a_small_window_is_the_nearest_rank() -> None:
    window = window_of([10, 30, 20])
    assert [window.quantile(q) for q in (0.33, 0.34, 0.66, 0.67, 0.95)] == [10, 20, 20, 30, 30]


def test_a_window_forgets_samples_older_than_its_seconds() -> None:
    window = Window(60.0)
    window.add(5, 0.0)
    window.add(7, 30.0)
    window.expire(60.0)  # exactly window_s old: kept
    assert len(window) == 2
    window.expire(60.5)
    assert (len(window), window.quantile(1.0)) == (1, 7)
    window.add(1, 100.0)  # adding expires too: 7 (at 30) is 70 s old
    assert (len(window), window.quantile(1.0)) == (1, 1)


def test_a_full_window_drops_its_oldest_sample() -> None:
    window = window_of([100, 1, 2, 3], max_samples=3)
    assert len(window) == 3
    assert window.quantile(1.0) == 3  # 100 was the oldest
    window.add(50, 0.0)
    assert (len(window), window.quantile(0.01), window.quantile(1.0)) == (3, 2, 50)


def test_the_default_bound_is_max_samples() -> None:
    window = Window(60.0)
    for value in range(MAX_SAMPLES + 10):
        window.add(value, 0.0)
    assert len(window) == MAX_SAMPLES
    assert window.quantile(0.0001) == 10  # 0..9 went first


def test_dropping_a_duplicate_removes_one_copy() -> None:
    window = Window(10.0)
    window.add(5, 0.0)
    window.add(5, 1.0)
    window.add(9, 2.0)
    window.add(5, 3.0)
    window.expire(10.5)  # the first 5 goes; two 5s and the 9 stay
    assert len(window) == 3
    assert [window.quantile(q) for q in (0.3, 0.6, 1.0)] == [5, 5, 9]
    window.expire(11.5)
    assert [window.quantile(q) for q in (0.5, 1.0)] == [5, 9]
    window.expire(12.5)
    assert (len(window), window.quantile(1.0)) == (1, 5)
    window.expire(13.5)
    assert len(window) == 0


# Estimate


def test_full_trust_reserves_the_estimate() -> None:
    assert Estimate(100, "tier", 1.0).reserve(512) == 100


def test_no_trust_reserves_the_limit() -> None:
    assert Estimate(100, "tier", 0.0).reserve(512) == 512


@pytest.mark.parametrize(("trust", "expected"), [(0.5, 306), (0.25, 409), (0.75, 203)])
def test_partial_trust_moves_the_estimate_towards_the_limit(trust: float, expected: int) -> None:
    # 100 + (1 - trust) * 412, rounded up
    assert Estimate(100, "tier", trust).reserve(512) == expected


def test_the_floor_is_reserved_at_least() -> None:
    assert Estimate(3, "tier", 1.0, floor=16).reserve(512) == 16
    assert Estimate(0, "oracle").reserve(512) == 1


def test_the_floor_never_takes_a_reservation_past_the_limit() -> None:
    assert Estimate(3, "tier", 1.0, floor=16).reserve(10) == 10
    assert Estimate(3, "tier", 0.5, floor=16).reserve(16) == 16


@pytest.mark.parametrize("tokens", [512, 513, 10_000])
def test_an_estimate_at_or_above_the_limit_reserves_the_limit(tokens: int) -> None:
    assert Estimate(tokens, "tier", 1.0).reserve(512) == 512
    assert Estimate(tokens, "tier", 0.3).reserve(512) == 512


@pytest.mark.parametrize("trust", [0.0, 0.05, 0.1, 0.3, 0.5, 0.7000000000000001, 0.95, 1.0])
@pytest.mark.parametrize("tokens", [-5, 0, 1, 7, 100, 511])
def test_a_reservation_lies_between_the_estimate_and_the_limit(trust: float, tokens: int) -> None:
    reserved = Estimate(tokens, "tier", trust, floor=4).reserve(512)
    assert max(4, tokens) <= reserved <= 512


# Overcommit


class Readings:
    """Readings of one loop, 10 s apart (discovery's default refresh)."""

    def __init__(self, loop: Overcommit) -> None:
        self.loop, self.at = loop, 0.0

    def __call__(self, pool: str, preemptions: int, *, full: bool = False) -> float | None:
        self.at += 10.0
        return self.loop.read(pool, preemptions, self.at, full=full)


def test_preemptions_halve_the_trust_at_once() -> None:
    loop = Overcommit()
    read = Readings(loop)
    assert loop.trust("p") == 1.0
    assert [read("p", 3) for _ in range(5)] == [0.5, 0.25, 0.125, 0.0625, 0.03125]
    assert read("p", 1) == 0.0  # 0.015625 is below 0.025: worst case
    assert read("p", 9) is None  # already there
    assert loop.trust("p") == 0.0
    assert loop.trust("q") == 1.0  # per pool


def test_a_full_kv_cache_halves_the_trust_as_preemptions_do() -> None:
    loop = Overcommit()
    read = Readings(loop)
    assert read("p", 0, full=True) == 0.5
    assert read("p", 0, full=True) == 0.25
    assert read("p", 0) == pytest.approx(0.25 + 10 * RELAX_PER_S)


def test_quiet_readings_give_the_trust_back_by_the_second() -> None:
    loop = Overcommit()
    read = Readings(loop)
    assert read("p", 0) is None  # full trust stays
    read("p", 1)
    read("p", 1)
    assert loop.trust("p") == 0.25
    steps = []
    while (after := read("p", 0)) is not None:
        steps.append(after)
    assert steps[0] == pytest.approx(0.25 + 10 * RELAX_PER_S)
    assert all(b - a == pytest.approx(10 * RELAX_PER_S) for a, b in itertools.pairwise(steps))
    assert len(steps) == 15 and steps[-1] == 1.0 == loop.trust("p")
    # Readings closer together give back as much per second, not per reading.
    loop.read("q", 1, 0.0)
    assert loop.read("q", 0, 1.0) == pytest.approx(0.5 + RELAX_PER_S)
    # A long silence counts MAX_QUIET_S at most.
    assert loop.read("q", 0, 3600.0) == pytest.approx(0.5 + RELAX_PER_S * (1 + MAX_QUIET_S))


def test_from_the_worst_case_two_hundred_quiet_seconds_restore_full_trust() -> None:
    loop = Overcommit(_trust={"p": 0.0})
    read = Readings(loop)
    readings = [read("p", 0) for _ in range(21)]
    assert readings[0] is None  # the first reading of a pool starts its clock
    assert readings[20] == 1.0 and loop.read("p", 0, 1000.0) is None
    assert all(r is not None and r < 1.0 for r in readings[1:20])


def test_retain_forgets_the_pools_gone() -> None:
    loop = Overcommit()
    loop.read("p", 1, 0.0)
    loop.read("q", 1, 0.0)
    loop.retain({"q"})
    assert (loop.trust("p"), loop.trust("q")) == (1.0, 0.5)


# Calibration.estimate


def test_worst_case_mode_gives_no_estimate() -> None:
    calibration = Calibration()
    worst = pool("worst_case")
    fed(calibration, worst, "pro", "a", 10, 20, 30, 40)
    assert calibration.samples("p", "pro") == 4
    assert calibration.estimate(worst, "pro", TIER, "a", 0.0) is None


def test_too_few_samples_give_no_estimate() -> None:
    calibration, calibrated = Calibration(), pool()
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) is None
    fed(calibration, calibrated, "pro", "a", 10, 20)
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) is None
    fed(calibration, calibrated, "pro", "a", 30)
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) == Estimate(30, "tenant", 1.0, 4)


def test_a_tenant_with_samples_of_its_own_uses_them_and_others_use_the_tiers() -> None:
    calibration, calibrated = Calibration(), pool(quantile=0.5)
    fed(calibration, calibrated, "pro", "a", 100, 100, 100)
    fed(calibration, calibrated, "pro", "b", 10, 10)  # too few of its own
    assert calibration.samples("p", "pro") == 5
    assert calibration.samples("p", "pro", "b") == 2
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) == Estimate(100, "tenant", 1, 4)
    # the tier's five: 10 10 100 100 100, median 100
    assert calibration.estimate(calibrated, "pro", TIER, "b", 0.0) == Estimate(100, "tier", 1, 4)
    assert calibration.estimate(calibrated, "pro", TIER, "c", 0.0) == Estimate(100, "tier", 1, 4)
    assert calibration.estimate(calibrated, "free", TIER, "a", 0.0) is None  # another tier


def test_the_pools_histogram_is_the_fallback() -> None:
    outputs = OutputLengths()
    calibration, calibrated = Calibration(outputs), pool(min_samples=50)
    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    few = Histogram(bounds, (0, 0, 0, 0, 0, 49, 49), 49, 49 * 30)
    outputs.add("p", Observed(0.0, few))
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) is None  # 49 < min_samples
    one = Histogram(bounds, (0, 0, 0, 0, 0, 1, 1), 1, 30)
    outputs.add("p", Observed(1.0, one))
    # 50 observations in (20, 50]: rank 47.5 lies at 20 + 30 * 47.5 / 50 = 48.5
    assert calibration.estimate(calibrated, "pro", TIER, "a", 1.0) == Estimate(49, "pool", 1, 4)
    fed(calibration, calibrated, "pro", "b", *[7] * 50)  # the tier's own samples come first
    assert calibration.estimate(calibrated, "pro", TIER, "a", 1.0) == Estimate(7, "tier", 1, 4)


def test_the_pools_histogram_of_another_pool_is_not_used() -> None:
    outputs = OutputLengths()
    calibration = Calibration(outputs)
    histogram = Histogram((10.0,), (5,), 5, 25)
    outputs.add("q", Observed(0.0, histogram))
    assert calibration.estimate(pool(), "pro", TIER, "a", 0.0) is None


def test_a_tiers_mode_replaces_the_pools_both_ways() -> None:
    calibration = Calibration()
    worst, calibrated = pool("worst_case"), pool()
    fed(calibration, worst, "pro", "a", 10, 20, 30)
    opted_in = TIER.model_copy(update={"reservation_mode": "calibrated"})
    opted_out = TIER.model_copy(update={"reservation_mode": "worst_case"})
    assert calibration.estimate(worst, "pro", opted_in, "a", 0.0) == Estimate(30, "tenant", 1, 4)
    assert calibration.estimate(calibrated, "pro", opted_out, "a", 0.0) is None
    assert calibration.estimate(calibrated, "pro", TIER, "a", 0.0) is not None


def test_expired_samples_take_the_estimate_back_to_the_worst_case() -> None:
    calibration, calibrated = Calibration(), pool(window_seconds=60.0)
    for at in (0.0, 10.0, 20.0):
        calibration.observe(calibrated, "pro", "a", 40, at)
    assert calibration.estimate(calibrated, "pro", TIER, "a", 60.0) == Estimate(40, "tenant", 1, 4)
    assert calibration.estimate(calibrated, "pro", TIER, "b", 60.0) == Estimate(40, "tier", 1, 4)
    assert calibration.estimate(calibrated, "pro", TIER, "a", 60.5) is None
    assert calibration.samples("p", "pro") == 2


def test_the_loops_trust_is_carried_in_the_estimate() -> None:
    calibration, calibrated = Calibration(), pool()
    fed(calibration, calibrated, "pro", "a", 100, 100, 100)
    calibration.engine.read("p", 0.0, preempted=2)
    estimate = calibration.estimate(calibrated, "pro", TIER, "a", 0.0)
    assert estimate is not None and estimate.trust == 0.5
    assert estimate.reserve(500) == 300
    calibration.engine.read("other", 0.0, preempted=2)
    again = calibration.estimate(calibrated, "pro", TIER, "a", 0.0)
    assert again is not None and again.trust == 0.5


# decide.plan with an estimate


def counted(prompt: int = 30, limits: dict[str, int] | None = None, **kw: Any) -> decide.Counted:
    return decide.Counted("completion", limits or {}, [prompt], **kw)


def test_a_plan_reserves_the_estimate() -> None:
    calibrated = pool()
    plan = decide.plan(
        counted(30, {"max_tokens": 512}), calibrated, "a", TIER, CAPACITY, Estimate(100, "tier")
    )
    assert (plan.reserved_output, plan.reserved_from) == (100, "tier")
    assert plan.blocks == math.ceil(130 / BLOCK) == 9
    worst = decide.plan(counted(30, {"max_tokens": 512}), calibrated, "a", TIER, CAPACITY)
    assert (worst.reserved_output, worst.reserved_from) == (512, "worst_case")
    assert worst.blocks == math.ceil(542 / BLOCK)


def test_a_plan_counts_every_prompt_and_sequence_of_the_estimate() -> None:
    request = decide.Counted("completion", {}, [30, 50], n=3)
    plan = decide.plan(request, pool(), "a", TIER, CAPACITY, Estimate(34, "tenant"))
    assert plan.blocks == 3 * (math.ceil(64 / BLOCK) + math.ceil(84 / BLOCK)) == 30
    assert plan.limits.max_tokens == 256 and plan.reserved_output == 34


@pytest.mark.parametrize("source", ["tenant", "tier", "pool", "oracle"])
def test_a_plan_names_the_estimates_source(source: str) -> None:
    plan = decide.plan(counted(), pool(), "a", TIER, CAPACITY, Estimate(10, source))
    assert plan.reserved_from == source


def test_an_estimate_that_reserves_the_whole_limit_is_the_worst_case() -> None:
    plan = decide.plan(counted(30, {"max_tokens": 50}), pool(), "a", TIER, CAPACITY,
                       Estimate(80, "tier"))  # fmt: skip
    assert (plan.reserved_output, plan.reserved_from) == (50, "worst_case")


def test_a_calibrated_request_whose_limit_can_never_fit_is_refused_at_once() -> None:
    # 64 prompt tokens, 4 sequences of up to 512: 4 x 36 = 144 blocks at worst, above the quota
    # of 100, though its estimate of 20 needs only 4 x 6 = 24 now; its lease could grow there.
    tier = TierConfig(max_tokens_cap=512, default_max_tokens=512, max_blocks=100)
    plan = decide.plan(counted(64, n=4), pool(), "a", tier, CAPACITY, Estimate(20, "tier"))
    assert (plan.blocks, plan.worst_blocks) == (24, 144)
    with pytest.raises(Refusal) as refused:
        decide.claim(plan, "l", 60.0)
    assert refused.value.code is Code.REQUEST_EXCEEDS_CAPACITY
    assert "needs 144 KV-cache blocks" in refused.value.message


def test_blocks_vllm_holds_beyond_the_ledger_are_taken_off_a_calibrated_claim() -> None:
    estimated = decide.plan(counted(30), pool(), "a", TIER, CAPACITY, Estimate(20, "tier"))
    worst = decide.plan(counted(30), pool(), "a", TIER, CAPACITY)
    limit = CAPACITY.limit(pool().watermark)
    assert decide.claim(estimated, "l", 60.0, unaccounted=100).pool_limit == limit - 100
    assert decide.claim(estimated, "l", 60.0, unaccounted=10 * limit).pool_limit == 0
    assert decide.claim(worst, "l", 60.0, unaccounted=100).pool_limit == limit  # by construction


def test_the_engine_view_counts_what_vllm_holds_beyond_the_ledger() -> None:
    view = EngineView()
    assert view.unaccounted("p") == 0  # nothing read yet
    view.read("p", 150)
    assert view.unaccounted("p") == 150  # the ledger said nothing yet: all of it
    view.reserved("p", 100)
    view.read("p", 150)
    assert view.unaccounted("p") == 50  # traffic kvguard does not see, or outgrown leases
    view.read("p", 80)
    assert view.unaccounted("p") == 0  # vLLM holds less than reserved: nothing to take off
    view.read("p", 400)
    view.read("p", None)
    assert view.unaccounted("p") == 0  # vLLM no longer says
    view.read("p", 400)
    view.retain({"q"})
    assert view.unaccounted("p") == 0


def test_a_request_that_runs_to_its_limit_reserves_the_whole_limit() -> None:
    request = counted(30, {"max_tokens": 400}, runs_to_limit=True)
    plan = decide.plan(request, pool(), "a", TIER, CAPACITY, Estimate(10, "tier"))
    assert (plan.reserved_output, plan.reserved_from) == (400, "worst_case")
    assert plan.blocks == math.ceil(430 / BLOCK)


def test_the_requests_min_tokens_is_reserved_at_least() -> None:
    request = counted(30, {"max_tokens": 400}, min_tokens=200)
    plan = decide.plan(request, pool(), "a", TIER, CAPACITY, Estimate(10, "tier"))
    assert plan.reserved_output == 200
    assert plan.blocks == math.ceil(230 / BLOCK)


@pytest.mark.parametrize("estimate", [Estimate(10, "tier"), Estimate(-3, "oracle")])
def test_an_echo_only_completion_reserves_no_output(estimate: Estimate) -> None:
    """`max_tokens: 0` with `echo`: the prompt's blocks are all it holds, as in worst case."""
    request = counted(32, {"max_tokens": 0})
    worst = decide.plan(request, pool(), "a", TIER, CAPACITY)
    planned = decide.plan(request, pool(), "a", TIER, CAPACITY, estimate)
    assert (planned.reserved_output, planned.blocks) == (worst.reserved_output, worst.blocks)
    assert (planned.reserved_output, planned.blocks) == (0, 2)


@pytest.mark.parametrize("limit", [1, 10, 16])
def test_a_limit_at_or_below_the_pools_min_tokens_reserves_the_whole_limit(limit: int) -> None:
    calibration, calibrated = Calibration(), pool(min_tokens=16)
    fed(calibration, calibrated, "pro", "a", 2, 2, 2)
    estimate = calibration.estimate(calibrated, "pro", TIER, "a", 0.0)
    assert estimate == Estimate(2, "tenant", 1.0, 16)
    plan = decide.plan(
        counted(30, {"max_tokens": limit}), calibrated, "a", TIER, CAPACITY, estimate
    )
    assert plan.reserved_output == limit
    above = decide.plan(counted(30, {"max_tokens": 17}), calibrated, "a", TIER, CAPACITY, estimate)
    assert above.reserved_output == 16


@pytest.mark.parametrize("sent", [None, 1, 100, 256, 511, 512, 513, 9000])
@pytest.mark.parametrize("prompt", [1, 30, 3800, 4095])
@pytest.mark.parametrize(
    "estimate",
    [Estimate(1, "tier"), Estimate(64, "pool", 0.5, 16), Estimate(600, "tenant", 0.0, 16)],
)
def test_the_limits_sent_to_vllm_do_not_depend_on_the_estimate(
    sent: int | None, prompt: int, estimate: Estimate
) -> None:
    limits = {} if sent is None else {"max_tokens": sent}
    worst = decide.plan(counted(prompt, limits), pool(), "a", TIER, CAPACITY)
    planned = decide.plan(counted(prompt, limits), pool(), "a", TIER, CAPACITY, estimate)
    assert planned.limits == worst.limits
    assert (planned.quota, planned.pool_limit) == (worst.quota, worst.pool_limit)
    assert planned.reserved_output == estimate.reserve(worst.limits.max_tokens)
    assert planned.blocks == blocks_needed([prompt], planned.reserved_output, 1, BLOCK)
    assert planned.blocks <= worst.blocks


# Admission in a calibrated pool


def config_of(at_pool: PoolConfig) -> Config:
    tenancy = TenancyConfig(tiers={"pro": TIER}, default_tier="pro")
    return Config(tenancy=tenancy, pools=[at_pool])


async def admit(config: Config, calibration: Calibration | None, tenant: str, **body: Any) -> Any:
    admission, policy, ledger, counter = serve(config, calibration=calibration, clock=lambda: 7.5)
    counter.prompt_tokens = 40
    decision = Decision()
    identity = identify_request(policy, {config.tenancy.header: tenant})
    raw = json.dumps({"model": MODEL, "prompt": "x", **body}).encode()
    admitted = await admission.admit(
        AdmissionRequest(policy, "completion", identity, raw, decision)
    )
    return admitted, decision, ledger


async def test_a_calibrated_pool_reserves_the_prompt_and_the_estimate() -> None:
    config = config_of(pool())
    calibration = Calibration()
    fed(calibration, config.pools[0], "pro", "a", 10, 20, 30)
    admitted, decision, ledger = await admit(config, calibration, "a")
    assert admitted.blocks == math.ceil((40 + 30) / BLOCK) == 5
    assert admitted.reserved_output == 30
    assert admitted.blocks == admitted.lease.blocks == 5
    assert (await ledger.usage("p")).tenants == {"a": 5}
    assert json.loads(admitted.body)["max_tokens"] == 256  # the tier default, as in worst case
    growth = admitted.growth
    assert growth is not None
    assert (growth.pool, growth.prompt_tokens, growth.n) == ("p", (40,), 1)
    assert (growth.limit, growth.reserved_output, growth.admitted_at) == (256, 30, 7.5)
    assert growth.limit_blocks == math.ceil(296 / BLOCK)
    assert admitted.sequences == 1
    assert (decision.reserved_output, decision.reserved_from) == (30, "tenant")
    assert (decision.max_tokens, decision.blocks) == (256, 5)


async def test_another_tenant_of_the_tier_reserves_the_tiers_estimate() -> None:
    config = config_of(pool())
    calibration = Calibration()
    fed(calibration, config.pools[0], "pro", "a", 10, 20, 30)
    admitted, decision, _ = await admit(config, calibration, "b", n=2)
    assert decision.reserved_from == "tier"
    assert admitted.reserved_output == 30
    assert admitted.blocks == 10  # two sequences
    assert admitted.sequences == 2 and admitted.growth is not None and admitted.growth.n == 2


async def test_a_calibrated_pool_without_samples_reserves_the_whole_limit() -> None:
    config = config_of(pool())
    admitted, decision, _ = await admit(config, Calibration(), "a", max_tokens=100)
    assert admitted.reserved_output == 100
    assert admitted.blocks == math.ceil(140 / BLOCK)
    assert admitted.growth is not None and not admitted.growth.grows  # its end is followed
    assert admitted.body is None
    assert decision.reserved_from == "worst_case"


async def test_a_request_that_ignores_eos_reserves_its_whole_limit() -> None:
    config = config_of(pool())
    calibration = Calibration()
    fed(calibration, config.pools[0], "pro", "a", 10, 20, 30)
    admitted, decision, _ = await admit(config, calibration, "a", ignore_eos=True)
    assert admitted.reserved_output == 256
    assert admitted.growth is not None and not admitted.growth.grows
    assert decision.reserved_from == "worst_case"


@pytest.mark.parametrize("learnt", [False, True])
async def test_a_worst_case_pool_reserves_max_tokens(learnt: bool) -> None:
    config = config_of(pool("worst_case"))
    calibration = Calibration()
    if learnt:
        fed(calibration, config.pools[0], "pro", "a", 10, 20, 30)
    admitted, decision, ledger = await admit(config, calibration, "a", max_tokens=300)
    assert admitted.reserved_output == 300
    assert admitted.blocks == math.ceil(340 / BLOCK) == 22
    assert admitted.growth is not None and not admitted.growth.grows
    assert (decision.reserved_output, decision.reserved_from) == (300, "worst_case")
    assert (await ledger.usage("p")).reserved == 22
