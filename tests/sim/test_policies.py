"""The policies `kvguard simulate` replays side by side, and each figure it reports, on tiny
hand-made traces whose answers are known."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvguard.admission.capacity import PoolCapacity
from kvguard.config.loading import parse as parse_config
from kvguard.config.schema import Config
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.model.policies import POLICIES, by_names
from kvguard.sim.model.replay import replay
from kvguard.sim.model.report import jain, policy_stats, policy_table, tenant_stats
from kvguard.sim.model.sweep import QUIET_TENANT, quiet_requests, replay_policy, with_quiet
from kvguard.sim.model.trace import Trace, TraceRequest
from kvguard.sim.simulate import Options, add_arguments, engine_config, run, run_from_args

TRACES = Path(__file__).parents[1] / "data" / "traces"

# One tier, its default 1024; tenant b has no tier (and there is no default tier).
CONFIG = """
tenancy:
  tiers:
    chat: {max_tokens_cap: 1024, default_max_tokens: 1024, max_blocks: 100}
  tenants: {a: chat}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 1600
    watermark: 0.0
    capacity: {blocks: 100, block_size: 16}
    retry_after_max_seconds: 0  # its clients never retry: a promise would only hold blocks
"""


def config() -> tuple[Config, PoolCapacity, EngineConfig]:
    parsed = parse_config(CONFIG, "sim.yaml", environ={})
    capacity = PoolCapacity(100, 16)
    return parsed, capacity, engine_config(parsed, capacity, Options("t", "c"))


async def test_goodput_counts_only_requests_within_the_slo() -> None:
    # One sequence at a time, 0.1 s a step: a's first token comes at 0.1 s and it ends at 1.0 s;
    # b waits for it, so its first token comes at 1.1 s and it ends at 2.0 s.
    engine = EngineConfig(num_gpu_blocks=9, block_size=16, max_model_len=128, max_num_seqs=1,
                          cost=StepCost(0.1, 0, 0))  # fmt: skip
    requests = [TraceRequest(0.0, "a", 1, 10), TraceRequest(0.0, "b", 1, 10)]
    run_ = await replay(requests, engine, None, label="vllm")
    assert [o.ttft_s for o in run_.outcomes] == [pytest.approx(0.1), pytest.approx(1.1)]
    assert run_.end_s == pytest.approx(2.0)
    within = policy_stats(run_, 1, gated=False, slo_s=0.5)
    assert within.goodput == pytest.approx(10 / 2.0)  # b misses the SLO: its tokens count 0
    assert policy_stats(run_, 1, gated=False, slo_s=2.0).goodput == pytest.approx(20 / 2.0)
    assert (within.served, within.refused, within.preemptions) == (2, {}, 0)
    assert (within.ttft_p50, within.ttft_p99) == (pytest.approx(0.1), pytest.approx(1.1))
    assert within.reserved_mean is None and within.used_peak == 1  # one block, no ledger


def test_jain_of_equal_and_unequal_splits() -> None:
    assert jain([0.5, 0.5]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([1.0, 0.5]) == pytest.approx(2.25 / 2.5)


async def test_refused_requests_count_zero_and_by_code() -> None:
    parsed, capacity, engine = config()
    requests = [TraceRequest(0.0, "a", 10, 20), TraceRequest(0.5, "b", 10, 20)]
    run_ = await replay_policy(requests, POLICIES["worst_case"], parsed, capacity, engine)
    stats = policy_stats(run_, 1, gated=True, slo_s=2.0)
    assert (stats.served, stats.refused) == (1, {"unknown_tenant": 1})
    by_tenant = tenant_stats(run_)
    assert (by_tenant["a"].served_tokens, by_tenant["b"].served_tokens) == (20, 0)
    assert stats.fairness == 0.5  # a got all of its demand, b none
    assert stats.goodput == pytest.approx(20 / run_.end_s)
    assert "refused at x1 by worst_case: 1 unknown_tenant" in policy_table([stats], 2.0)


@pytest.mark.parametrize(
    ("sent", "output", "served", "oracle_blocks", "worst_blocks"),
    [
        (None, 30, 30, 4, 66),  # injected 1024: ceil((20 + 30) / 16) against ceil(1044 / 16)
        (10, 30, 10, 2, 2),  # the client's 10 cuts the answer short: both reserve 10
        (200, 30, 30, 4, 14),
    ],
)
async def test_the_oracle_reserves_exactly_the_output(
    sent: int | None, output: int, served: int, oracle_blocks: int, worst_blocks: int
) -> None:
    parsed, capacity, engine = config()
    requests = [TraceRequest(0.0, "a", 20, output, sent)]
    for name, blocks in (("oracle", oracle_blocks), ("worst_case", worst_blocks)):
        run_ = await replay_policy(requests, POLICIES[name], parsed, capacity, engine)
        (outcome,) = run_.outcomes
        assert outcome.verdict.lease is not None and outcome.verdict.lease.blocks == blocks
        assert outcome.seq is not None and outcome.seq.output_tokens == served
        assert outcome.verdict.max_tokens == (1024 if sent is None else sent)
        assert run_.kv.reserved_peak == blocks
        assert run_.kv.used_peak == (4 if served == 30 else 2)  # ceil((20 + served - 1) / 16)
    alone = await replay_policy(requests, POLICIES["vllm"], parsed, capacity, engine)
    seq = alone.outcomes[0].seq
    assert seq is not None and seq.max_tokens == (1600 - 20 if sent is None else sent)
    assert seq.output_tokens == served and seq.finish_reason == ("length" if sent == 10 else "stop")


def test_policies_by_name() -> None:
    assert [p.name for p in by_names("oracle, vllm,oracle")] == ["oracle", "vllm"]
    with pytest.raises(ValueError, match="unknown policy guess: expected some of vllm, "):
        by_names("vllm,guess")


def test_the_quiet_tenant_is_deterministic_and_sized_by_the_medians() -> None:
    requests = [TraceRequest(float(t), "a", 10 + t, 100 + t) for t in range(1001)]
    trace = Trace("plain", requests)
    quiet = quiet_requests(trace)
    assert quiet == quiet_requests(trace)  # the same seed, the same arrivals
    assert 150 < len(quiet) < 250  # 0.2 req/s over 1000 s
    assert {(q.tenant, q.prompt_tokens, q.output_tokens, q.max_tokens) for q in quiet} == {
        (QUIET_TENANT, 510, 600, None)
    }
    merged = with_quiet(trace, quiet)
    assert len(merged.requests) == 1001 + len(quiet)
    assert [r.arrival_s for r in merged.requests] == sorted(r.arrival_s for r in merged.requests)


def write_config(folder: Path) -> Path:
    path = folder / "kvguard.yaml"
    path.write_text(CONFIG.replace("tenants: {a: chat}", "default_tier: chat"))
    return path


def test_a_sweep_prints_one_table_of_every_policy_at_each_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(TRACES / "vtc_lmsys_head80.csv")
    options = Options(trace, str(write_config(tmp_path)), sweep=(1, 4), quiet_tenant=True)
    assert run(options) == 0
    out = capsys.readouterr().out
    assert "rate scales 1, 4); 0 send max_tokens" in out
    assert "quiet tenant 'quiet' (tier chat)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scale  policy"))
    assert lines[header].endswith("Jain  quiet p99 (alone)")
    names = ("vllm", "worst_case", "calibrated", "oracle")
    rows = [line.split()[:2] for line in lines[header + 1 : header + 9]]
    assert rows == [[f"x{s}", p] for s in (1, 4) for p in names]
    assert lines[header + 9] == ""
    assert lines[header + 10].startswith("x1: worst_case serves ")
    assert lines[header + 11].startswith("x4: worst_case serves ")
    assert lines[header - 2].startswith("quiet tenant")  # a sweep prints no per-tenant table
    # At x1 the quiet tenant is served by every policy (at x4 a gate may refuse all of its few).
    quiet = [line.split()[-2:] for line in lines[header + 1 : header + 5]]
    assert all(p99 != "-" and alone not in ("(-)", "-") for p99, alone in quiet), quiet


def test_one_scale_prints_the_tenants_then_the_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(TRACES / "azure2023_conv_head40.csv")
    options = Options(trace, str(write_config(tmp_path)), policies=("worst_case", "oracle"))
    assert run(options) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("tenant ")))
    assert lines[at - 1].split() == ["preemptions", "goodput@2s", "tok/s", "TTFT", "p99", "s",
                                     "refused"]  # fmt: skip
    assert lines[at].split()[3:5] == ["worst_case", "oracle"]
    assert lines[at + 1].split()[:3] == ["default", "chat", "40"]
    table = lines[at + 3 :]
    assert [line.split()[:2] for line in table[:3]] == [
        ["scale", "policy"], ["x1", "worst_case"], ["x1", "oracle"],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "vllm,best"], "error: unknown policy best: expected some of vllm, "
         "worst_case, calibrated, oracle"),
        (["--sweep", "1,x"], "error: --sweep '1,x': expected positive numbers separated by commas"),
        (["--sweep", "0,2"], "error: --sweep '0,2': expected positive numbers separated by commas"),
        (["--ttft-slo", "0"], "error: --ttft-slo 0: expected seconds above 0"),
    ],
)  # fmt: skip
def test_bad_options_are_one_error_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(["--trace", "t.csv", "--config", "c.yaml", *args])
    assert run_from_args(parsed) == 2
    assert capsys.readouterr() == ("", message + "\n")
