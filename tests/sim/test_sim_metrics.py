"""The simulator's vllm:inter_token_latency_seconds: the modelled seconds between a sequence's
consecutive tokens, in vLLM's buckets, as kvguard's discovery reads them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.ops.vllm_metrics import TokenIntervals, parse_metrics
from kvguard.sim.model.engine import TOKEN_GAP_BOUNDS, Engine, EngineConfig, Sequence, StepCost
from kvguard.sim.model.metrics import render

ITL = "vllm:inter_token_latency_seconds"


def run(engine: Engine, *sequences: Sequence) -> None:
    for seq in sequences:
        engine.add(seq)
    now = 0.0
    while (result := engine.step(now)) is not None:
        now = result.end


def itl(text: str) -> dict[str, float]:
    """The histogram's samples: "le=<bound>" for each bucket, then "count" and "sum"."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == ITL]
    return {
        f"le={s.labels['le']}" if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]: s.value
        for s in family.samples
    }


def test_one_sequence_observes_one_interval_per_token_after_its_first() -> None:
    cost = StepCost(base_s=0.02, prefill_token_s=0.0, decode_seq_s=0.0)
    engine = Engine(EngineConfig(num_gpu_blocks=17, block_size=16, max_model_len=256, cost=cost))
    run(engine, Sequence("0", prompt_tokens=4, max_tokens=5))
    text = render(engine, "m", {})
    samples = itl(text)
    assert samples["count"] == 4
    assert samples["sum"] == pytest.approx(4 * 0.02)
    # Each 0.02 s: none at or below 0.01, all at or below 0.025 and every bound after.
    assert samples["le=0.01"] == 0
    assert [samples[f"le={b!r}"] for b in TOKEN_GAP_BOUNDS[1:]] == [4] * 18
    assert samples["le=+Inf"] == 4
    assert parse_metrics(text).intervals == TokenIntervals(4, samples["sum"])


def test_a_preempted_sequence_counts_its_wait_in_its_next_interval() -> None:
    cost = StepCost(base_s=0.015, prefill_token_s=0.0, decode_seq_s=0.0)
    # 2 usable blocks of 4 tokens: both sequences fit until the first needs its second block.
    engine = Engine(EngineConfig(num_gpu_blocks=3, block_size=4, max_model_len=8, cost=cost))
    first = Sequence("a", prompt_tokens=4, max_tokens=4)
    second = Sequence("b", prompt_tokens=4, max_tokens=4)
    run(engine, first, second)
    assert (second.preemptions, engine.preemptions_total) == (1, 1)
    samples = itl(render(engine, "m", {}))
    # Per sequence, its intervals add up to the time from its first token to its last.
    spans = [(s.finished_at or 0.0) - (s.first_token_at or 0.0) for s in (first, second)]
    assert samples["count"] == (4 - 1) * 2
    assert samples["sum"] == pytest.approx(sum(spans))
    # The second waited behind the first's three decodes, then recomputed: 4 steps, 0.06 s.
    assert (samples["le=0.01"], samples["le=0.025"], samples["le=0.05"]) == (0, 5, 5)
    assert samples["le=0.075"] == samples["le=+Inf"] == 6
