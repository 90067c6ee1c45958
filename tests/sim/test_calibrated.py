"""The `calibrated` policy in the simulator: it learns what requests produce, reserves that,
and backs off towards the worst case when the engine preempts (the loop of
admission.calibration, fed as discovery feeds it in `serve`)."""

from __future__ import annotations

from kvguard.admission.capacity import PoolCapacity
from kvguard.config.loading import parse as parse_config
from kvguard.config.schema import Config
from kvguard.sim.model.engine import EngineConfig
from kvguard.sim.model.policies import POLICIES
from kvguard.sim.model.replay import Run
from kvguard.sim.model.sweep import replay_policy
from kvguard.sim.model.trace import TraceRequest
from kvguard.sim.simulate import Options, engine_config

# One tier whose default (1024) is injected: clients send no max_tokens. 400 blocks of 16.
CONFIG = """
server: {response_sample: 0.2}
tenancy:
  default_tier: chat
  tiers:
    chat: {max_tokens_cap: 1024, default_max_tokens: 1024, max_blocks: 400}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 2048
    watermark: 0.1
    capacity: {blocks: 400, block_size: 16}
    reservation: {min_samples: 20}
"""


def setting() -> tuple[Config, PoolCapacity, EngineConfig]:
    config = parse_config(CONFIG, "sim.yaml", environ={})
    capacity = PoolCapacity(400, 16)
    return config, capacity, engine_config(config, capacity, Options("t", "c"))


def requests(outputs: list[int], every_s: float, start_s: float = 0.0) -> list[TraceRequest]:
    return [
        TraceRequest(start_s + i * every_s, f"t{i % 3}", 100, output)
        for i, output in enumerate(outputs)
    ]


async def replayed(policy: str, trace: list[TraceRequest]) -> Run:
    config, capacity, engine = setting()
    return await replay_policy(trace, POLICIES[policy], config, capacity, engine)


def served(run: Run) -> int:
    return sum(1 for o in run.outcomes if o.seq is not None)


async def test_short_answers_are_learnt_and_admitted_without_preemption() -> None:
    # Answers of 40 tokens, 20 a second: worst case holds 71 blocks each (5 at a time under
    # the 360-block limit), an estimate of 40 holds 9.
    trace = requests([40] * 600, 0.05)
    worst, calibrated = await replayed("worst_case", trace), await replayed("calibrated", trace)
    assert calibrated.preemptions == worst.preemptions == 0
    assert served(calibrated) >= 1.5 * served(worst), (served(calibrated), served(worst))
    reserved = [o.verdict for o in calibrated.outcomes if o.verdict.lease is not None]
    assert min(v.lease.blocks for v in reserved if v.lease) == 9  # (100 + 40) / 16, rounded up
    assert calibrated.trust[-1][1] == 1.0
    assert calibrated.reserved[-1][1] == 0  # every lease released at the end


async def test_a_wrong_estimate_preempts_then_the_loop_falls_back_and_relaxes() -> None:
    # Short answers teach an estimate of 40; then answers run to the whole limit. Leases grow
    # as they decode, yet the first long ones outgrow the pool: vLLM preempts, the trust falls
    # and reservations go back towards the worst case. Short answers again let it relax.
    trace = (
        requests([40] * 300, 0.1)
        + requests([1024] * 150, 0.1, start_s=30.0)
        + requests([40] * 1500, 0.2, start_s=45.0)
    )
    alone, calibrated = await replayed("vllm", trace), await replayed("calibrated", trace)
    trust = [value for _, value in calibrated.trust]
    assert 0 < calibrated.preemptions < alone.preemptions, (calibrated.preemptions,
                                                            alone.preemptions)  # fmt: skip
    assert min(trust) <= 0.5
    assert trust[-1] == 1.0  # relaxed again, step by step
    fell = next(t for t, value in calibrated.trust if value < 1.0)
    # Requests admitted after the fall were not preempted more than once each.
    later = [o.seq for o in calibrated.outcomes if o.seq is not None and o.seq.arrival > fell + 10]
    assert later and sum(seq.preemptions for seq in later) <= len(later) // 100
    assert all(o.seq.finished_at is not None for o in calibrated.outcomes if o.seq is not None)
