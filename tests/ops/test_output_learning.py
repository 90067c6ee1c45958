"""Learning output lengths from vLLM's own histograms: the pure distribution (deltas, resets,
sums, quantiles) and discovery feeding it from real /metrics texts over HTTP."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvguard.admission.capacity import Capacities
from kvguard.admission.outputs import Histogram, Observed, OutputLengths
from kvguard.admission.policy import build
from kvguard.admission.record import Completion
from kvguard.ops.discovery import Discovery
from kvguard.ops.metrics import Metrics
from kvguard.ops.telemetry import Telemetry
from kvguard.ops.vllm_metrics import parse_metrics
from tests.clock import Clock
from tests.ops.fakes import REAL_METRICS, discovered_config, fake_vllms, with_outputs
from tests.ops.readings import points

VLLM_BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)


def observed(values: Sequence[float], bounds: tuple[float, ...] = VLLM_BOUNDS) -> Histogram:
    """The histogram vLLM would export after observing `values`."""
    cumulative = tuple(float(sum(v <= b for v in values)) for b in bounds)
    return Histogram(bounds, cumulative, float(len(values)), float(sum(values)))


# --- the pure distribution ---------------------------------------------------------------------


def test_a_delta_counts_only_what_came_after_the_earlier_reading() -> None:
    earlier = observed([3, 40])
    later = observed([3, 40, 7, 300])
    assert later.since(earlier) == observed([7, 300])
    assert later.since(None) == later  # the first reading: everything since the server started


def test_a_counter_that_went_down_is_a_restart_whose_counts_are_all_new() -> None:
    before_restart = observed([3, 40, 7, 300, 900])
    after_restart = observed([12])
    assert after_restart.since(before_restart) == after_restart
    # One bucket going down is enough, even when the count did not.
    shifted = observed([1500, 1500, 1500, 1500, 1500])
    assert shifted.since(before_restart) == shifted
    # So is a sum that went down, or a bucket that grew by more than the count did.
    assert observed([3]).since(observed([400])) == observed([3])
    assert observed([3, 900]).since(observed([900, 900])) == observed([3, 900])


def test_histograms_of_several_endpoints_add_up() -> None:
    assert observed([3, 40]).plus(observed([7])) == observed([3, 40, 7])
    with pytest.raises(ValueError, match="bounds differ"):
        observed([3]).plus(observed([3], bounds=(1.0, 10.0)))


def test_quantiles_interpolate_inside_the_bucket_as_prometheus_does() -> None:
    # 10 requests: 4 in (20, 50], 4 in (50, 100], 2 in (100, 200].
    histogram = observed([30] * 4 + [60] * 4 + [150] * 2)
    assert histogram.quantile(0.4) == 50.0
    assert histogram.quantile(0.5) == pytest.approx(50 + 50 * (5 - 4) / 4)
    assert histogram.quantile(0.95) == pytest.approx(100 + 100 * (9.5 - 8) / 2)
    assert histogram.quantile(1.0) == 200.0
    assert histogram.mean() == pytest.approx((120 + 240 + 300) / 10)
    # Past the last finite bound: that bound (vLLM's last bucket edge is 2000).
    assert observed([5000]).quantile(0.5) == 2000.0
    assert Histogram.empty(VLLM_BOUNDS).quantile(0.9) is None
    with pytest.raises(ValueError):
        histogram.quantile(0)


def test_the_window_keeps_only_recent_scrapes() -> None:
    outputs = OutputLengths(window_s=60)
    outputs.add("qwen", Observed(0.0, observed([900] * 10)))
    outputs.add("qwen", Observed(30.0, observed([20] * 10)))
    assert outputs.generated("qwen") == observed([900] * 10 + [20] * 10)
    outputs.add("qwen", Observed(61.0, observed([20] * 10)))
    assert outputs.generated("qwen") == observed([20] * 20)  # the scrape at 0 s left the window
    assert outputs.quantile("qwen", 0.95) == pytest.approx(10 + 10 * (19 - 0) / 20)
    assert outputs.lifetime("qwen") == observed([900] * 10 + [20] * 20)
    assert outputs.generated("other") is None
    outputs.retain(set())
    assert outputs.pools() == []


# --- parsing and discovery ---------------------------------------------------------------------


def test_the_real_vllm_text_gives_both_histograms_and_the_used_blocks() -> None:
    text = with_outputs(REAL_METRICS, [21, 61, 40], usage=0.5)
    reading = parse_metrics(text)
    assert reading.generated == observed([21, 61, 40])
    assert reading.used_blocks == round(0.5 * 63)
    # A vLLM without these series still gives its capacity.
    bare = "\n".join(line for line in REAL_METRICS.splitlines() if "vllm:cache_config_info" in line)
    assert parse_metrics(bare).generated is None
    assert parse_metrics(bare).used_blocks is None


async def test_discovery_learns_the_pools_deltas_summed_over_endpoints(tmp_path: Path) -> None:
    clock = Clock(100.0)
    async with fake_vllms(
        with_outputs(REAL_METRICS, [10, 30], usage=0.25),
        with_outputs(REAL_METRICS, [400], usage=0.5),
    ) as (a, b):
        outputs = OutputLengths()
        policy = build(discovered_config(tmp_path, [a.url, b.url]))
        discovery = Discovery(lambda: policy, Capacities(), outputs=outputs, clock=clock)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            # The first reading teaches what each server did since it started.
            assert outputs.generated("qwen") == observed([10, 30, 400])
            assert discovery.used_blocks() == {"qwen": round(0.25 * 63) + round(0.5 * 63)}

            clock.now += 10
            a.text = with_outputs(REAL_METRICS, [10, 30, 7, 8])
            b.text = with_outputs(REAL_METRICS, [3])  # b restarted: its counts are new
            await discovery.refresh(session)
            assert outputs.generated("qwen") == observed([10, 30, 400, 7, 8, 3])

            clock.now += 10
            await discovery.refresh(session)  # nothing new anywhere
            assert outputs.lifetime("qwen") == observed([10, 30, 400, 7, 8, 3])


async def test_an_endpoint_that_fails_and_recovers_is_not_learnt_twice(tmp_path: Path) -> None:
    async with fake_vllms(with_outputs(REAL_METRICS, [10, 30])) as (a,):
        outputs = OutputLengths()
        policy = build(discovered_config(tmp_path, [a.url]))
        discovery = Discovery(lambda: policy, Capacities(), outputs=outputs)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            a.status = 500
            await discovery.refresh(session)
            a.status = 200
            a.text = with_outputs(REAL_METRICS, [10, 30, 50])
            await discovery.refresh(session)
        assert outputs.lifetime("qwen") == observed([10, 30, 50])


# --- what is exported --------------------------------------------------------------------------


def test_released_completions_and_used_blocks_are_exported() -> None:
    reader = InMemoryMetricReader()
    metrics = Metrics(MeterProvider([reader]))
    telemetry = Telemetry(metrics)
    telemetry.released(Completion("r1", "acme", "pro", "qwen", "l1", 128, 40, "stop", "usage"))
    telemetry.released(Completion("r2", "acme", "pro", "qwen", "l2", 128))  # not read: no count
    metrics.view.used = {"qwen": 12}
    (completions,) = points(reader, "kvguard_completion_tokens")
    assert completions.attributes == {"pool": "qwen", "tier": "pro"}
    assert (completions.count, completions.sum) == (1, 40)
    (used,) = points(reader, "kvguard_engine_used_blocks")
    assert (used.attributes, used.value) == ({"pool": "qwen"}, 12)
