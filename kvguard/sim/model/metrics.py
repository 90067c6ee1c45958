"""The engine's state under vLLM's metric names: a snapshot, and its Prometheus text.

Names and labels follow vLLM 0.32's /metrics (`vllm:cache_config_info` carries the cache size
in its labels; `vllm:kv_cache_usage_perc` is a fraction, 1 meaning full). The per-tenant
preemption counter is the simulator's own (`kvguard_sim_` prefix): vLLM has no tenants.
`vllm:inter_token_latency_seconds` observes the modelled seconds between a sequence's
consecutive tokens, with vLLM's bucket bounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvguard.sim.model.engine import TOKEN_GAP_BOUNDS, Engine


@dataclass(frozen=True, slots=True)
class Snapshot:
    t: float
    kv_usage: float
    running: int
    waiting: int
    preemptions: int


def snapshot(engines: Sequence[Engine], t: float) -> Snapshot:
    """The pods of a pool at `t`: the used share of all their blocks, their requests summed."""
    if len(engines) == 1:  # the share as vLLM reports it, to the last bit
        usage = engines[0].pool.usage()
    else:
        usage = sum(e.pool.used for e in engines) / sum(e.pool.usable for e in engines)
    return Snapshot(
        t,
        usage,
        sum(len(e.running) for e in engines),
        sum(len(e.waiting) for e in engines),
        sum(e.preemptions_total for e in engines),
    )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def render(engine: Engine, model: str, tenant_preemptions: Mapping[str, int]) -> str:
    config = engine.config
    base = {"engine": "0", "model_name": model}
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample, labels, value in samples:
            lines.append(f"{sample}{labels} {float(value)!r}")

    family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [
            (
                "vllm:cache_config_info",
                _labels(
                    block_size=str(config.block_size),
                    enable_prefix_caching=str(config.enable_prefix_caching),
                    engine="0",
                    num_gpu_blocks=str(config.num_gpu_blocks),
                    simulated="True",
                ),
                1.0,
            )
        ],
    )
    gauges = [
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         len(engine.running)),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         len(engine.waiting)),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         engine.pool.usage()),
    ]  # fmt: skip
    for name, help_text, value in gauges:
        family(name, "gauge", help_text, [(name, _labels(**base), value)])
    counters = [
        ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
         engine.preemptions_total),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
         engine.prompt_tokens_total),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.",
         engine.generation_tokens_total),
    ]  # fmt: skip
    for name, help_text, value in counters:
        family(name, "counter", help_text, [(name, _labels(**base), value)])
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            ("vllm:request_success_total", _labels(**base, finished_reason=reason), count)
            for reason, count in sorted(engine.finished_total.items())
            if reason != "abort"
        ],
    )
    *cumulative, gaps = itertools.accumulate(engine.token_gaps)  # le=bound, then +Inf
    family(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        [
            *(
                ("vllm:inter_token_latency_seconds_bucket", _labels(**base, le=repr(bound)), n)
                for bound, n in zip(TOKEN_GAP_BOUNDS, cumulative, strict=True)
            ),
            ("vllm:inter_token_latency_seconds_bucket", _labels(**base, le="+Inf"), gaps),
            ("vllm:inter_token_latency_seconds_count", _labels(**base), gaps),
            (
                "vllm:inter_token_latency_seconds_sum",
                _labels(**base),
                engine.token_gap_seconds_total,
            ),
        ],
    )
    family(
        "kvguard_sim_preemptions_total",
        "counter",
        "Preemptions of each tenant's requests (x-tenant-id), simulator only.",
        [
            ("kvguard_sim_preemptions_total", _labels(tenant=tenant), count)
            for tenant, count in sorted(tenant_preemptions.items())
        ],
    )
    return "\n".join(lines) + "\n"
