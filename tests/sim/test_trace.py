"""Trace formats (by header), the simulator's prompt counting, and the replay's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.config.loading import parse as parse_config
from kvguard.sim.model import prompts
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.model.policies import POLICIES
from kvguard.sim.model.replay import replay
from kvguard.sim.model.report import (
    jain,
    percentile,
    policy_stats,
    policy_table,
    tenant_stats,
    tenant_table,
)
from kvguard.sim.model.sweep import compare
from kvguard.sim.model.trace import SINGLE_TENANT, TraceError, TraceRequest, load, parse
from kvguard.sim.simulate import Options, engine_config, pool_capacity

TRACES = Path(__file__).parents[1] / "data" / "traces"


def test_azure2023_has_one_tenant_and_seconds_from_the_first_request() -> None:
    trace = load(TRACES / "azure2023_conv_head40.csv")
    assert trace.format == "azure2023"
    assert len(trace.requests) == 40
    assert trace.tenants == [SINGLE_TENANT]
    first, second = trace.requests[0], trace.requests[1]
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 374, 44)
    assert second.arrival_s == pytest.approx(4.314579)
    assert (second.prompt_tokens, second.output_tokens) == (396, 109)


def test_vtc_lmsys_keeps_its_tenants() -> None:
    trace = load(TRACES / "vtc_lmsys_head80.csv", limit=50)
    assert trace.format == "vtc_lmsys"
    assert len(trace.requests) == 50
    assert trace.requests[0] == TraceRequest(0.0, "dummy-lora-7b-rank-8-13", 13, 199)
    assert "dummy-lora-7b-rank-8-0" in trace.tenants and len(trace.tenants) > 3


def test_plain_csv_and_jsonl_default_the_tenant() -> None:
    text = "arrival_s,prompt_tokens,output_tokens\n1.0,20,5\n2.5,10,0\n2.5,7,3.0\n"
    csv_trace = parse(text, "t.csv")
    assert csv_trace.format == "plain"
    assert csv_trace.requests == [
        TraceRequest(0.0, SINGLE_TENANT, 20, 5),
        TraceRequest(1.5, SINGLE_TENANT, 10, 1),  # a count of 0 is raised to 1
        TraceRequest(1.5, SINGLE_TENANT, 7, 3),  # equal arrivals are in order; 3.0 is whole
    ]
    lines = [
        {"arrival_s": 0, "tenant": "a", "prompt_tokens": 3, "output_tokens": 4},
        {"arrival_s": 0.5, "tenant": "b", "prompt_tokens": 5, "output_tokens": 6},
    ]
    jsonl = parse("\n".join(json.dumps(x) for x in lines) + "\n", "t.jsonl")
    assert [r.tenant for r in jsonl.requests] == ["a", "b"]
    assert jsonl.scaled(2).requests[1].arrival_s == 0.25


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,prompt,output\n1,2,3\n", "t.csv: unknown columns ['output', 'prompt', 'time']"),
        ("arrival_s,prompt_tokens,output_tokens\n", "t.csv: no requests"),
    ],
)
def test_unreadable_traces_name_the_file_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse(text, "t.csv")
    assert str(caught.value).startswith(message)


PLAIN = "arrival_s,tenant,prompt_tokens,output_tokens\n0,a,3,4\n"
JSONL = '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\n\n'  # line 2 is blank


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            PLAIN + "1,a,-5,4\n",
            "t.csv: line 3: prompt_tokens is -5: token counts cannot be negative",
        ),
        (
            PLAIN + "1,a,5,-1\n",
            "t.csv: line 3: output_tokens is -1: token counts cannot be negative",
        ),
        (
            PLAIN + "1,a,5,2.5\n",
            "t.csv: line 3: output_tokens is 2.5: token counts are whole numbers",
        ),
        (
            PLAIN + "1,a,x,4\n",
            "t.csv: line 3: prompt_tokens is 'x': token counts are whole numbers",
        ),
        (PLAIN + "1,a,,4\n", "t.csv: line 3: prompt_tokens is missing"),
        (
            PLAIN + "2,a,3,4\n\n1.5,b,3,4\n",  # the blank line 4 counts
            "t.csv: line 5: arrival_s 1.5 is before the previous row's 2: rows must be in "
            "order of arrival",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.9,396,109\n"
            "2023-11-16 18:15:46.6,374,44\n",
            "t.csv: line 3: TIMESTAMP 2023-11-16 18:15:46.6 is before the previous row's "
            "2023-11-16 18:15:50.9: rows must be in order of arrival",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,396,109\n"
            "2023-11-16 18:15:50.9+00:00,374,44\n",
            "t.csv: line 3: TIMESTAMP 2023-11-16 18:15:50.9+00:00 has a timezone and the first "
            "row's 2023-11-16 18:15:46.6 has none: give every time a timezone, or none",
        ),
        (
            JSONL.replace('"arrival_s": 0', '"arrival_s": "2023-11-16T18:15:46+01:00"')
            + '{"arrival_s": "2023-11-16T18:15:50", "prompt_tokens": 2, "output_tokens": 4}\n',
            "t.csv: line 3: arrival_s 2023-11-16T18:15:50 has no timezone and the first row's "
            "2023-11-16T18:15:46+01:00 has one: give every time a timezone, or none",
        ),
        (
            "req_time_s,tenant,prompt_len,output_len\n0,a,13,199\n0.5,b,12.5,3\n",
            "t.csv: line 3: prompt_len is 12.5: token counts are whole numbers",
        ),
        (
            PLAIN + "soon,a,3,4\n",
            "t.csv: line 3: arrival_s is 'soon': expected seconds or an ISO date and time",
        ),
        (
            JSONL + '{"arrival_s": 1, "prompt_tokens": -2, "output_tokens": 4}\n',
            "t.csv: line 3: prompt_tokens is -2: token counts cannot be negative",
        ),
        (
            JSONL + '{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 0.5}\n',
            "t.csv: line 3: output_tokens is 0.5: token counts are whole numbers",
        ),
        (
            JSONL + '{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 4}\n',
            "t.csv: line 3: prompt_tokens is true: token counts are whole numbers",
        ),
        (
            JSONL + '{"arrival_s": -1, "prompt_tokens": 2, "output_tokens": 4}\n',
            "t.csv: line 3: arrival_s -1 is before the previous row's 0: rows must be in "
            "order of arrival",
        ),
        (
            JSONL + '{"arrival_s": 1, "prompt_tokens": 2,\n',
            "t.csv: line 3: not JSON (Expecting property name enclosed in double quotes, "
            "column 37)",
        ),
    ],
)
def test_bad_rows_are_errors_that_name_the_line(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse(text, "t.csv")
    assert str(caught.value) == message


def test_the_max_tokens_column_is_the_clients_limit() -> None:
    plain = "arrival_s,tenant,prompt_tokens,output_tokens,max_tokens\n0,a,3,40,16\n1,a,3,40,\n"
    assert [r.max_tokens for r in parse(plain, "t.csv").requests] == [16, None]  # empty: none
    azure = "TIMESTAMP,ContextTokens,GeneratedTokens,max_tokens\n2023-11-16 18:15:46,374,44,900\n"
    assert parse(azure, "t.csv").requests == [TraceRequest(0.0, SINGLE_TENANT, 374, 44, 900)]
    vtc = "req_time_s,tenant,prompt_len,output_len,max_tokens\n0,a,13,199,1024\n"
    assert parse(vtc, "t.csv").requests[0].max_tokens == 1024
    lines = [
        {"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, "max_tokens": 8},
        {"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 4, "max_tokens": None},
        {"arrival_s": 2, "prompt_tokens": 3, "output_tokens": 4},
    ]
    jsonl = parse("\n".join(json.dumps(x) for x in lines), "t.jsonl")
    assert [r.max_tokens for r in jsonl.requests] == [8, None, None]
    assert load(TRACES / "azure2023_conv_head40.csv").requests[0].max_tokens is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (PLAIN.replace("\n", ",max_tokens\n", 1).replace("4\n", "4,8\n") + "1,a,3,4,0\n",
         "t.csv: line 3: max_tokens is 0: a limit is at least 1 token"),
        (PLAIN.replace("\n", ",max_tokens\n", 1).replace("4\n", "4,8\n") + "1,a,3,4,-3\n",
         "t.csv: line 3: max_tokens is -3: a limit is at least 1 token"),
        (PLAIN.replace("\n", ",max_tokens\n", 1).replace("4\n", "4,8\n") + "1,a,3,4,2.5\n",
         "t.csv: line 3: max_tokens is 2.5: token counts are whole numbers"),
        (PLAIN.replace("\n", ",max_tokens\n", 1).replace("4\n", "4,8\n") + "1,a,3,4,lots\n",
         "t.csv: line 3: max_tokens is 'lots': token counts are whole numbers"),
        (JSONL + '{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 4, "max_tokens": true}\n',
         "t.csv: line 3: max_tokens is true: token counts are whole numbers"),
    ],
)  # fmt: skip
def test_a_bad_max_tokens_names_the_line(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse(text, "t.csv")
    assert str(caught.value) == message


def test_prompt_tokens_come_from_kvguard_header_else_the_approximation() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 7}
    approx = prompts.parse("/v1/chat/completions", chat, None, max_model_len=100, block_size=4)
    assert approx.prompts[0].tokens == 3 + 4 + 10  # reply header + message overhead + 40 / 4
    exact = prompts.parse("/v1/chat/completions", chat, "33", max_model_len=100, block_size=4)
    assert exact.prompts[0].tokens == 33 and exact.max_tokens == 7
    batch = {"prompt": [[1, 2, 3], "abcdefgh"], "n": 2}
    parsed = prompts.parse("/v1/completions", batch, None, max_model_len=100, block_size=2)
    assert [p.tokens for p in parsed.prompts] == [3, 2]
    assert parsed.max_tokens == prompts.COMPLETIONS_DEFAULT_MAX_TOKENS and parsed.n == 2
    assert (
        parsed.prompts[0].keys
        == prompts.parse(
            "/v1/completions", {"prompt": [1, 2, 9]}, None, max_model_len=100, block_size=2
        )
        .prompts[0]
        .keys
    )  # the same first block of token ids: the same key
    no_limit = prompts.parse(
        "/v1/chat/completions", {"messages": chat["messages"]}, "10", max_model_len=100,
        block_size=4,
    )  # fmt: skip
    assert no_limit.max_tokens == 90  # vLLM: max_model_len minus the prompt
    with pytest.raises(prompts.BadRequest, match="maximum context length"):
        prompts.parse("/v1/chat/completions", chat, "100", max_model_len=100, block_size=4)


CONFIG = """
tenancy:
  default_tier: free
  tiers:
    free: {max_tokens_cap: 64, default_max_tokens: 32, max_blocks: 40}
    pro: {max_tokens_cap: 256, default_max_tokens: 64, max_blocks: 100}
  tenants: {dummy-lora-7b-rank-8-0: pro}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 2048
    watermark: 0.15
    capacity: {blocks: 120, block_size: 16}
"""


async def test_the_policy_removes_preemptions_on_an_overloaded_slice() -> None:
    config = parse_config(CONFIG, "sim.yaml", environ={})
    options = Options("trace", "sim.yaml")
    capacity = pool_capacity(config, options)
    engine = engine_config(config, capacity, options)
    assert (engine.num_gpu_blocks, engine.block_size, engine.max_model_len) == (121, 16, 1920)
    trace = load(TRACES / "vtc_lmsys_head80.csv").scaled(8)
    policies = [POLICIES["vllm"], POLICIES["worst_case"]]
    unguarded, guarded = await compare(trace, config, capacity, engine, policies=policies)
    assert unguarded.preemptions > 0
    assert guarded.preemptions == 0  # reservations cover prompt + output: nothing thrashes
    refused = [o for o in guarded.outcomes if o.verdict.refused]
    assert refused and {o.verdict.refused for o in refused} <= {
        "tenant_block_quota_exceeded", "kv_cache_watermark_exceeded", "request_exceeds_capacity",
    }  # fmt: skip
    served = [o for o in guarded.outcomes if o.seq is not None]
    # Clients send no max_tokens: kvguard injects the tier default, the answer stops at the
    # trace's output or at that limit.
    for o in served:
        assert o.seq is not None
        assert o.seq.output_tokens == min(o.request.output_tokens, o.verdict.max_tokens)
    assert all(o.verdict.clamped for o in served)
    assert {o.verdict.max_tokens for o in served} == {32, 64}
    stats = tenant_stats(guarded, {"dummy-lora-7b-rank-8-0": "pro"})
    assert stats["dummy-lora-7b-rank-8-0"].tier == "pro"
    assert sum(s.requests for s in stats.values()) == 80
    text = tenant_table([unguarded, guarded], {}, 2.0)
    assert "dummy-lora-7b-rank-8-0" in text and "worst_case" in text
    rows = [policy_stats(run, 8, run is guarded, 2.0) for run in (unguarded, guarded)]
    assert "Jain" in policy_table(rows, 2.0)


async def test_replay_timeline_follows_the_engine() -> None:
    config = EngineConfig(num_gpu_blocks=9, block_size=16, max_model_len=128,
                          cost=StepCost(0.01, 0, 0))  # fmt: skip
    requests = [TraceRequest(0.0, "a", 60, 60), TraceRequest(0.0, "b", 60, 60)]
    run = await replay(requests, config, None, label="unguarded")
    assert run.preemptions == run.timeline[-1].preemptions > 0
    assert max(s.kv_usage for s in run.timeline) == 1.0
    assert run.timeline[-1].running == 0 and run.timeline[-1].kv_usage == 0.0
    first = run.outcomes[0].ttft_s
    assert first is not None and first == pytest.approx(0.01)


def test_jain_and_percentiles() -> None:
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0, 0.0, 0.0]) == 0.25
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile(range(1, 101), 0.99) == 99
    assert percentile([], 0.5) is None
