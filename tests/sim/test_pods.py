"""A pool of several pods in the simulator: an engine each, requests sent to them in turn as
Envoy's round robin sends them while the ledger counts the pool, or to the pod the ledger
reserved them on (routing pick)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvguard.admission.capacity import PoolCapacity
from kvguard.config.loading import parse as parse_config
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.model.policies import POLICIES
from kvguard.sim.model.replay import replay
from kvguard.sim.model.report import policy_stats, policy_table
from kvguard.sim.model.sweep import replay_policy
from kvguard.sim.model.trace import TraceRequest
from kvguard.sim.simulate import Options, add_arguments, per_pod, run, run_from_args

CONFIG = """
tenancy:
  default_tier: chat
  tiers:
    chat: {max_tokens_cap: 1024, default_max_tokens: 256, max_blocks: 100}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 640
    watermark: 0.0
    capacity: {blocks: 80, block_size: 16}
    retry_after_max_seconds: 0
"""
# One pod: 40 usable blocks of 16 tokens, 10 ms a step.
POD = EngineConfig(num_gpu_blocks=41, block_size=16, max_model_len=640, cost=StepCost(0.01, 0, 0))
# Long (100 + 300 tokens: 25 blocks) and short (10 + 10: 2 blocks) requests alternating, as in
# the flood that preempted a real engine: round robin sends every long one to the first pod.
FLOOD = [
    TraceRequest(i * 0.001, "t", *((100, 300, 300) if i % 2 == 0 else (10, 10, 10)))
    for i in range(4)
]


async def test_round_robin_overflows_one_pod_that_the_pool_sum_admits() -> None:
    config = parse_config(CONFIG, "sim.yaml", environ={})
    pool = PoolCapacity(80, 16)  # two pods' blocks: 54 reserved fit the pool's 80
    guarded = await replay_policy(FLOOD, POLICIES["worst_case"], config, pool, POD, pods=2)
    assert [o.verdict.refused for o in guarded.outcomes] == [None] * 4
    assert all(o.seq is not None and o.seq.finish_reason for o in guarded.outcomes)
    assert guarded.kv.reserved_peak == 54 <= pool.limit(0.0)
    # Both long requests on the first pod: 50 blocks for its 40, so it preempts; the second
    # pod holds the short ones and never does.
    assert guarded.pod_preemptions[0] > 0 and guarded.pod_preemptions[1] == 0
    assert guarded.preemptions == sum(guarded.pod_preemptions)
    # One engine with the pool's blocks (the guarantee kvguard gives today) never preempts.
    one = EngineConfig(num_gpu_blocks=81, block_size=16, max_model_len=640, cost=POD.cost)
    alone = await replay_policy(FLOOD, POLICIES["worst_case"], config, pool, one)
    assert (alone.preemptions, alone.pod_preemptions) == (0, [0])
    stats = policy_stats(guarded, 1, gated=True, slo_s=2.0)
    table = policy_table([stats], 2.0)
    assert "preempt by pod" in table.splitlines()[0]
    assert f"{guarded.pod_preemptions[0]}/0" in table.splitlines()[1]
    assert "preempt by pod" not in policy_table([policy_stats(alone, 1, True, 2.0)], 2.0)


async def test_the_pick_reserves_on_the_pod_and_sends_the_request_there() -> None:
    config = parse_config(CONFIG, "sim.yaml", environ={})
    pool = PoolCapacity(80, 16)
    picked = await replay_policy(
        FLOOD, POLICIES["worst_case"], config, pool, POD, pods=2, routing="pick"
    )
    assert picked.label == "worst_case pick"
    assert [o.verdict.refused for o in picked.outcomes] == [None] * 4
    assert all(o.seq is not None and o.seq.finish_reason for o in picked.outcomes)
    # A long request on each pod (25 of its 40 blocks), a short one beside each: none preempts.
    pods = [o.verdict.lease.pod for o in picked.outcomes if o.verdict.lease is not None]
    assert pods == ["pod-0", "pod-1", "pod-1", "pod-0"]
    assert picked.pod_preemptions == [0, 0]


async def test_a_request_that_fits_no_pod_is_refused_though_the_pool_has_room() -> None:
    config = parse_config(CONFIG, "sim.yaml", environ={})
    longs = [TraceRequest(i * 0.001, "t", 100, 300, 300) for i in range(3)]  # 25 blocks each
    picked = await replay_policy(
        longs, POLICIES["worst_case"], config, PoolCapacity(80, 16), POD, pods=2,
        routing="pick",
    )  # fmt: skip
    # One on each pod; the third fits the pool's 80 (75) but neither pod's 15 left.
    refused = [o.verdict.refused for o in picked.outcomes]
    assert refused == [None, None, "kv_cache_watermark_exceeded"]
    assert picked.pod_preemptions == [0, 0]


async def test_an_idle_pod_starts_at_once_while_another_is_in_a_step() -> None:
    slow = EngineConfig(num_gpu_blocks=9, block_size=16, max_model_len=128, max_num_seqs=1,
                        cost=StepCost(1.0, 0, 0))  # fmt: skip
    requests = [TraceRequest(0.0, "a", 1, 3), TraceRequest(0.5, "b", 1, 3)]
    two = await replay(requests, slow, None, label="vllm", pods=2)
    # b's pod is idle when it arrives: its first step starts then, not when a's step ends.
    assert [o.ttft_s for o in two.outcomes] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert two.end_s == pytest.approx(3.5)
    one = await replay(requests, slow, None, label="vllm")
    assert [o.ttft_s for o in one.outcomes] == [pytest.approx(1.0), pytest.approx(3.5)]


def test_the_pools_blocks_are_split_over_its_pods() -> None:
    assert per_pod(PoolCapacity(8001, 16), 4) == PoolCapacity(2000, 16)
    with pytest.raises(ValueError, match="3 blocks cannot be split over 4 pods"):
        per_pod(PoolCapacity(3, 16), 4)


def test_simulate_with_pods_says_how_the_pool_is_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvguard.yaml"
    config.write_text(CONFIG)
    trace = tmp_path / "trace.csv"
    lines = [f"{r.arrival_s},{r.tenant},{r.prompt_tokens},{r.output_tokens}" for r in FLOOD]
    trace.write_text("arrival_s,tenant,prompt_tokens,output_tokens\n" + "\n".join(lines) + "\n")
    options = Options(str(trace), str(config), policies=("vllm", "worst_case"), pods=2)
    assert run(options) == 0
    out = capsys.readouterr().out
    assert "pool p: 80 blocks of 16 tokens on 2 pods of 40, routed round robin" in out
    assert "preempt by pod" in out
    both = Options(str(trace), str(config), policies=("vllm", "worst_case"), pods=2,
                   routings=("round_robin", "pick"))  # fmt: skip
    assert run(both) == 0
    out = capsys.readouterr().out
    assert "on 2 pods of 40, routed round robin and pick" in out
    assert "worst_case pick" in out and "vllm pick" not in out


def test_an_unknown_routing_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace", "t.csv", "--config", "c.yaml", "--routing", "random"])
    assert run_from_args(args) == 2
    assert capsys.readouterr().err == (
        "error: --routing random: expected one or both of round_robin, pick, each once\n"
    )


def test_no_pods_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace", "t.csv", "--config", "c.yaml", "--pods", "0"])
    assert run_from_args(args) == 2
    assert capsys.readouterr().err == "error: --pods 0: expected 1 or more\n"
