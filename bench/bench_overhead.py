"""What kvguard adds to a request, measured through the real Envoy (a benchmark, not a test).

Two Envoys from envoy/envoy.yaml in the same run: one with the ext_proc filter removed (bare),
one with kvguard (`kvguard serve`, its own process, memory ledger) in front of the same local
upstream. A separate load process sends chat requests at fixed rates (open loop: arrivals do not
wait for answers) and records end-to-end latency; kvguard's CPU time comes from /proc.

Prints, per prompt size and rate: p50/p99/p99.9 for bare and guarded and their difference; the
admissions per second one kvguard core sustains (requests / kvguard CPU seconds); and, for 8k and
32k-token prompts, the decision latency and any Envoy message timeouts (504). Writes
bench-results/overhead.json.

    .venv/bin/python bench/bench_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.testing.envoy import (  # noqa: E402
    EXT_PROC_FILTER,
    EnvoyProcess,
    loopback_config,
    without_http_filter,
)
from kvguard.testing.upstream import RecordingUpstream  # noqa: E402

WORDS = (ROOT / "README.md").read_text().split()
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def chat_body(tokens: int, i: int) -> bytes:
    # ~1.3 words per token on English prose: enough for a prompt of about `tokens` tokens.
    text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(int(tokens / 1.3)))
    body = {"model": "qwen", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return json.dumps(body).encode()


async def load(url: str, bodies: list[bytes], rate: float, seconds: float) -> dict[str, Any]:
    """Open-loop load: request i starts at i / rate, whatever happened to the others."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    total = int(rate * seconds)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(i: int) -> None:
            start = time.perf_counter()
            async with http.post(
                url + "/v1/chat/completions",
                data=bodies[i % len(bodies)],
                headers={"content-type": "application/json", "x-tenant-id": f"t{i % 8}"},
            ) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
            latencies.append(time.perf_counter() - start)

        t0 = time.perf_counter()
        tasks = []
        for i in range(total):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "requests": total,
        "statuses": statuses,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "mean_ms": statistics.fmean(latencies) * 1000,
    }


def load_in_subprocess(url: str, tokens: int, rate: float, seconds: float) -> dict[str, Any]:
    """Run `load` in its own process, so the client's CPU is not kvguard's or Envoy's."""
    code = (
        f"import json, sys, uvloop; sys.path.insert(0, {str(ROOT)!r}); "
        "from bench.bench_overhead import chat_body, load; "
        f"bodies = [chat_body({tokens}, i) for i in range(64)]; "
        f"print(json.dumps(uvloop.run(load({url!r}, bodies, {rate!r}, {seconds!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


async def main(quick: bool) -> None:
    seconds = 5.0 if quick else 15.0
    rates = [50.0, 150.0] if quick else [50.0, 150.0, 300.0]
    results: dict[str, Any] = {"seconds_per_point": seconds, "points": [], "large": []}
    upstream = RecordingUpstream()
    await upstream.start()
    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    port = free_port()
    kv_config = {
        "server": {
            "grpc_listen": f"127.0.0.1:{port}",
            "metrics_listen": "",
            "log_level": "warning",
        },
        "ledger": {"url": "memory://", "lease_seconds": 60},
        "tenancy": {
            "default_tier": "pro",
            "tiers": {"pro": {"max_tokens_cap": 64, "default_max_tokens": 16, "max_blocks": 10**6}},
        },
        "pools": [
            {
                "name": "qwen",
                "models": ["qwen"],
                "tokenizer": str(ROOT / ".cache" / "models" / "qwen"),
                "max_model_len": 65536,
                "capacity": {"blocks": 10**7, "block_size": 16},
            }
        ],
    }
    (work / "kvguard.yaml").write_text(yaml.safe_dump(kv_config))
    kvguard = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "serve", "--config", str(work / "kvguard.yaml")],
        stderr=(work / "kvguard.log").open("wb"),
    )
    guarded_config = loopback_config(port, upstream.port)
    bare_config = without_http_filter(guarded_config, EXT_PROC_FILTER)
    (work / "bare").mkdir()
    (work / "guarded").mkdir()
    try:
        async with (
            EnvoyProcess(bare_config, work / "bare") as bare,
            EnvoyProcess(guarded_config, work / "guarded") as guarded,
        ):
            await guarded.wait_cluster_healthy("kvguard", timeout=60)
            for tokens in (100, 1000):
                for rate in rates:
                    b = await asyncio.to_thread(load_in_subprocess, bare.url, tokens, rate, seconds)
                    cpu0 = cpu_seconds(kvguard.pid)
                    g = await asyncio.to_thread(
                        load_in_subprocess, guarded.url, tokens, rate, seconds
                    )
                    cpu = cpu_seconds(kvguard.pid) - cpu0
                    point = {
                        "prompt_tokens": tokens,
                        "rate": rate,
                        "bare": b,
                        "guarded": g,
                        "added_p50_ms": g["p50_ms"] - b["p50_ms"],
                        "added_p99_ms": g["p99_ms"] - b["p99_ms"],
                        "added_p999_ms": g["p999_ms"] - b["p999_ms"],
                        "kvguard_cpu_ms_per_request": cpu * 1000 / g["requests"],
                        "admissions_per_core_s": g["requests"] / cpu if cpu else None,
                    }
                    results["points"].append(point)
                    print(
                        f"{tokens:>5} tok {rate:>5.0f} rps | bare p50 {b['p50_ms']:6.2f} "
                        f"p99 {b['p99_ms']:6.2f} | guarded p50 {g['p50_ms']:6.2f} "
                        f"p99 {g['p99_ms']:6.2f} p99.9 {g['p999_ms']:6.2f} | added p50 "
                        f"{point['added_p50_ms']:5.2f} p99 {point['added_p99_ms']:5.2f} ms | "
                        f"kvguard {point['kvguard_cpu_ms_per_request']:.2f} ms CPU/req "
                        f"(~{point['admissions_per_core_s'] or 0:.0f} adm/s/core) "
                        f"{g['statuses']}",
                        flush=True,
                    )
            for tokens in (8000, 32000):
                g = await asyncio.to_thread(load_in_subprocess, guarded.url, tokens, 4.0, seconds)
                results["large"].append({"prompt_tokens": tokens, "rate": 4.0, "guarded": g})
                print(
                    f"{tokens:>5} tok     4 rps | guarded p50 {g['p50_ms']:7.2f} "
                    f"p99 {g['p99_ms']:7.2f} ms | statuses {g['statuses']} (504 = message timeout)",
                    flush=True,
                )
    finally:
        kvguard.terminate()
        kvguard.wait(30)
        await upstream.stop()
    out = ROOT / "bench-results" / "overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    uvloop.run(main(parser.parse_args().quick))
