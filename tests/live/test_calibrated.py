"""Calibrated reservations on the real engine. Requests ask for 900 tokens and stop after
21..61: reserving what such requests produce rather than their limit admits several times as
many at once, and vLLM still never preempts. When outputs suddenly run to their limit, the loop
with vLLM's preemption counter takes the overcommit back.

Lengths: the recording proxy adds min_tokens and an EOS bias to each request on its way to vLLM
(harness.stop_after), so that a request stops after exactly k + 1 tokens while kvguard, before
the proxy, sees a plain request for 900 tokens and learns only from what vLLM answers.

Sizes: ~70 prompt tokens + 900 = 8 blocks of 128 in the worst case; kvguard admits up to 53
blocks (63 x (1 - 0.15)), so 6 such requests at once. Calibrated, the estimate is the median of
the warm-up's outputs (~40 tokens): 1 block a request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from kvguard.testing.vllm import VllmProcess
from tests.live.harness import (
    CHAT,
    LIMIT,
    STOP_AFTER,
    FloodRun,
    Proxied,
    RecordingProxy,
    Result,
    Stopping,
    Wave,
    calibrated_gateway,
    flood_run,
    send,
    stopped,
    warm_up,
    wave_run,
)

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

REFRESH_S = 0.5  # capacity discovery, and so the loop, reads vLLM twice a second
WARM_UP = 8  # reservation.min_samples: the warm-up's completions are the samples
PER_TENANT = 8  # three tenants: 24 requests at once, 4 times what fits in the worst case
TIMEOUT = aiohttp.ClientTimeout(total=300)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def direct(vllm: VllmProcess) -> list[tuple[int, Result, Proxied]]:
    """A few requests through the rewriting proxy alone, straight to vLLM."""
    proxy = RecordingProxy(vllm.url, stop_after=STOP_AFTER)
    await proxy.start()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            url = f"http://127.0.0.1:{proxy.port}{CHAT}"
            out = []
            for k in (20, 41, 60, 299):
                request = Stopping("alpha", 7000 + k, k)
                result = await send(http, url, request)
                out.append((k, result, proxy.by_test_id(request.test_id)))
            return out
    finally:
        await proxy.stop()


async def test_the_proxy_ends_a_completion_after_k_plus_one_tokens(
    direct: list[tuple[int, Result, Proxied]],
) -> None:
    for k, result, proxied in direct:
        assert stopped(result, k), (k, result.status, result.body)
        # vLLM received the hint in the body, without its header; the sender did not.
        sent = json.loads(proxied.sent or b"{}")
        assert sent["max_tokens"] == LIMIT
        assert "min_tokens" not in sent and "logit_bias" not in sent
        assert proxied.json()["min_tokens"] == k
        assert STOP_AFTER not in proxied.headers


@dataclass
class Comparison:
    worst_case: FloodRun
    calibrated: FloodRun
    warm_up: list[tuple[Stopping, Result]]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def comparison(vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory) -> Comparison:
    """The same flood of early-stopping requests, all at once, through kvguard reserving the
    worst case, then through a kvguard reserving its estimate (vLLM stays up between)."""
    runs = {}
    warmed: list[tuple[Stopping, Result]] = []
    for mode in ("worst_case", "calibrated"):
        workdir = tmp_path_factory.mktemp(mode)
        async with (
            calibrated_gateway(workdir, vllm, mode, REFRESH_S) as gw,
            aiohttp.ClientSession(timeout=TIMEOUT) as http,
        ):
            warmed += await warm_up(http, gw, WARM_UP, seed=100)
            runs[mode] = await flood_run(http, gw, vllm, mode, PER_TENANT, seed=3000)
    return Comparison(runs["worst_case"], runs["calibrated"], warmed)


async def test_the_warm_up_completes_short(comparison: Comparison) -> None:
    assert all(stopped(r, q.k) for q, r in comparison.warm_up)


async def test_calibrated_admits_far_more_of_the_same_flood(comparison: Comparison) -> None:
    worst, calibrated = comparison.worst_case, comparison.calibrated
    assert len(worst.requests) == len(calibrated.requests) == 3 * PER_TENANT
    assert len(calibrated.admitted()) >= 1.5 * len(worst.admitted()) > 0


async def test_calibrated_flood_never_preempts(comparison: Comparison) -> None:
    assert comparison.calibrated.preemptions == 0


async def test_every_admitted_request_completes_with_its_length(comparison: Comparison) -> None:
    for run in (comparison.worst_case, comparison.calibrated):
        assert all(stopped(r, q.k) for q, r in run.admitted())
        refused = [r for r in run.results if r.status != 200]
        assert all(r.status == 429 for r in refused)
        # Only admitted requests reached vLLM.
        assert set(run.proxied) >= {q.test_id for q, _ in run.admitted()}
        reached = {q.test_id for q in run.requests} & set(run.proxied)
        assert len(reached) == len(run.admitted())


async def test_reservations_follow_the_mode(comparison: Comparison) -> None:
    assert set(comparison.worst_case.reserved_output()) == {LIMIT}
    assert max(comparison.calibrated.reserved_output()) < LIMIT


async def test_the_ledger_ends_at_zero(comparison: Comparison) -> None:
    assert comparison.worst_case.reserved_after == 0
    assert comparison.calibrated.reserved_after == 0


# A wrong estimate: after a warm-up of short outputs, every request runs to its limit. Long
# prompts (~575 tokens, 5 blocks) make the overcommit large: the estimate admits 10 of a burst
# of 12 (5 blocks each, 50 of 53), which need 12 blocks each at the end, 120 of vLLM's 63.
# vLLM 0.32 counts a preemption when the preempted request is scheduled again (its PREEMPTED
# event goes out with its next token), so vllm:num_preemptions_total, and the loop with it,
# moves only once requests ahead of it have ended: here tens of seconds after vLLM ran out of
# blocks (the timeline shows `running` falling while nothing completes).
WRONG_BURST = 4  # per tenant, at once
WRONG_WORDS = 500
WRONG_EVERY_S = 1.0  # then one request per tenant a second
WRONG_AFTER_REACTION_S = 5.0  # until this long after the reaction
WRONG_DURATION_S = 75.0  # or this long at most (the second wave: no reaction ends it)
SECOND_DURATION_S = 15.0


@dataclass
class Wrong:
    first: Wave
    second: Wave
    log: str


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def wrong(vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory) -> Wrong:
    workdir = tmp_path_factory.mktemp("wrong")
    async with (
        calibrated_gateway(workdir, vllm, "calibrated", REFRESH_S) as gw,
        aiohttp.ClientSession(timeout=TIMEOUT) as http,
    ):
        await warm_up(http, gw, WARM_UP, seed=100)
        first = await wave_run(
            http, gw, vllm, 9000, WRONG_BURST, WRONG_EVERY_S, WRONG_DURATION_S, WRONG_WORDS,
            after_reaction_s=WRONG_AFTER_REACTION_S,
        )  # fmt: skip
        second = await wave_run(
            http, gw, vllm, 19000, WRONG_BURST, WRONG_EVERY_S, SECOND_DURATION_S, WRONG_WORDS
        )
        assert gw.log_path is not None
        log = gw.log_path.read_text()
    print_timeline("first wave", first)
    print_timeline("second wave", second)
    return Wrong(first, second, log)


def print_timeline(name: str, wave: Wave) -> None:
    """The timeline, for the report of a failed run (pytest shows a fixture's output)."""
    print(f"{name}: sent {len(wave.requests)}, admitted {len(wave.admitted_at())}, "
          f"preemptions {wave.preemptions:g}")  # fmt: skip
    for row in wave.timeline():
        print(" ", json.dumps(row))
    moved = wave.moved_at()
    if moved is not None:
        print("  samples about the first preemption (s, trust, vLLM's count, kvguard's count):")
        for s in wave.samples:
            if abs(s.at - moved) < 2:
                at = round(s.at - wave.started, 2)
                print(f"    {at} {s.trust:.3g} {s.preemptions:g} {s.counted:g}")


async def test_a_wrong_estimate_preempts_and_the_loop_reacts_within_one_scrape(
    wrong: Wrong,
) -> None:
    first = wrong.first
    moved, reacted = first.moved_at(), first.reacted_at()
    assert first.preemptions > 0 and moved is not None
    assert reacted is not None
    # The loop reacts to a full KV cache (98 %) before vLLM counts the preemptions, and to the
    # counter at the latest in the reading that first counts them: kvguard's /metrics never
    # shows a counted preemption beside full trust.
    base = first.samples[0]
    counted = next(s for s in first.samples if s.counted > base.counted)
    assert counted.trust < base.trust
    # In time: kvguard reads vLLM every REFRESH_S, but a reading of a busy vLLM's /metrics on
    # two shared cores takes up to about a second (measured lags: 0.5 to 1.4 s), and the
    # samples here are 0.2 to 0.3 s apart.
    assert reacted - moved <= REFRESH_S + 1.5
    assert "calibrated reservations fall back towards worst case" in wrong.log


async def test_no_request_admitted_after_the_reaction_is_preempted(wrong: Wrong) -> None:
    """vLLM 0.32 counts a preemption late and per engine, not per request: what shows that none
    of the requests admitted after the reaction was preempted is that none was admitted while
    vLLM held preempted requests waiting, and that the second wave, admitted after it from
    start to end, adds no preemption while every request completes."""
    first = wrong.first
    reacted = first.reacted_at()
    assert reacted is not None
    for admitted_at, _ in first.admitted_at():
        if admitted_at <= reacted:
            continue
        before = [s for s in first.samples if s.at <= admitted_at]
        assert before and before[-1].waiting == 0, (admitted_at - first.started, before[-1])
    assert wrong.second.preemptions == 0
    assert all(r.status in (200, 429) for r in wrong.second.results)


async def test_a_second_wave_adds_no_preemption(wrong: Wrong) -> None:
    assert wrong.second.preemptions == 0
    assert len(wrong.second.admitted_at()) > 0


async def test_every_admitted_request_of_both_waves_completes(wrong: Wrong) -> None:
    for wave in (wrong.first, wrong.second):
        admitted = [(q, r) for q, r in zip(wave.requests, wave.results, strict=True)
                    if r.status == 200]  # fmt: skip
        assert admitted
        assert all(stopped(r, q.k) for q, r in admitted)
        assert all(r.status in (200, 429) for r in wave.results)
        assert wave.reserved_after == 0
