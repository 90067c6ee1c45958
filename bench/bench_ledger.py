"""What the shared Redis ledger costs per admission (a benchmark, not a test).

Starts its own redis-server on a free loopback port (no persistence) and runs reserve + release
cycles against one pool through `RedisLedger` (the scripts kvguard runs: one round trip each),
from one client process and from several, each with some cycles in flight; each scenario
twice, side by side: claims without pods (the pool's sum) and claims naming `--pods` candidate
pods (the pick and the reservation in the one script). The pool's limit and quotas are far
above demand, so every reserve is an admission: the figures are the ledger's cost, not its
refusals.

Prints a table (admissions per second over all processes; p50/p99 of one reserve + release in
ms) and writes bench-results/ledger.json.

    .venv/bin/python bench/bench_ledger.py [--quick] [--processes N] [--seconds S] [--pods N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.ledger import Claim, Outcome, PodLimit  # noqa: E402
from kvguard.ledger.redis_ledger import RedisLedger  # noqa: E402
from kvguard.testing.redis import RedisServer  # noqa: E402

POOL = "bench"
LIMIT = 10**12  # never the constraint here
TENANTS = 16


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def client(
    url: str, index: int, in_flight: int, seconds: float, start_at: float, pods: int
) -> dict[str, Any]:
    """One client process: cycles for `seconds` from wall time `start_at`; its latencies."""
    import uvloop

    return uvloop.run(_cycles(url, index, in_flight, seconds, start_at, pods))


async def _cycles(
    url: str, index: int, in_flight: int, seconds: float, start_at: float, pods: int
) -> dict[str, Any]:
    candidates = tuple(PodLimit(f"10.0.0.{i + 1}:8000", LIMIT) for i in range(pods))
    # kvguard's client settings, but patient: a noisy machine must not end the run early.
    ledger = RedisLedger.from_url(url, timeout_s=2.0)
    await ledger.start()
    await ledger.usage(POOL)  # a warm connection before the clock starts
    latencies: list[float] = []
    refused = 0
    # Processes start at slightly different times: begin together, at a wall-clock instant.
    await asyncio.sleep(max(0.0, start_at - time.time()))
    end = time.perf_counter() + seconds

    async def lane(lane_index: int) -> None:
        nonlocal refused
        n = 0
        while time.perf_counter() < end:
            n += 1
            claim = Claim(
                f"{index}-{lane_index}-{n}",
                POOL,
                f"t{n % TENANTS}",
                1 + n % 40,
                LIMIT,
                LIMIT,
                60,
                pods=candidates,
            )
            started = time.perf_counter()
            reservation = await ledger.reserve(claim)
            if reservation.outcome is Outcome.ADMITTED and reservation.lease is not None:
                await ledger.release(reservation.lease)
                latencies.append(time.perf_counter() - started)
            else:
                refused += 1

    began = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(in_flight)))
    elapsed = time.perf_counter() - began
    await ledger.close()
    return {"latencies": latencies, "elapsed_s": elapsed, "refused": refused}


def run(url: str, processes: int, in_flight: int, seconds: float, pods: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 1.5 + 0.3 * processes  # time for the processes to start
    with context.Pool(processes) as pool:
        results = pool.starmap(
            client, [(url, i, in_flight, seconds, start_at, pods) for i in range(processes)]
        )
    latencies = [x for r in results for x in r["latencies"]]
    elapsed = max(r["elapsed_s"] for r in results)
    assert sum(r["refused"] for r in results) == 0, "the bench pool refused admissions"
    return {
        "processes": processes,
        "in_flight_per_process": in_flight,
        "pods": pods,
        "seconds": round(elapsed, 2),
        "admissions": len(latencies),
        "admissions_per_s": round(len(latencies) / elapsed),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 s per scenario")
    parser.add_argument("--seconds", type=float, default=5.0, help="per scenario")
    parser.add_argument("--processes", type=int, default=4, help="client processes (several)")
    parser.add_argument("--pods", type=int, default=16, help="candidate pods a claim names")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else args.seconds
    scenarios = [(1, 1), (1, 16), (args.processes, 1), (args.processes, 16)]
    rows = []
    with tempfile.TemporaryDirectory() as folder, RedisServer(Path(folder)) as redis:
        version = redis.cli("info", "server").split("redis_version:")[1].split()[0]
        for processes, in_flight in scenarios:
            for pods in (0, args.pods):
                redis.flushall()
                rows.append(run(redis.url, processes, in_flight, seconds, pods))
    header = (
        f"{'processes':>9}  {'in flight':>9}  {'pods':>4}  {'admissions/s':>12}  {'p50 ms':>7}  "
        f"{'p99 ms':>7}"
    )
    print(f"reserve + release on redis-server {version}, {os.cpu_count()} cores, loopback")
    print(header)
    for row in rows:
        print(
            f"{row['processes']:>9}  {row['in_flight_per_process']:>9}  {row['pods']:>4}  "
            f"{row['admissions_per_s']:>12}  {row['p50_ms']:>7.3f}  {row['p99_ms']:>7.3f}"
        )
    out = ROOT / "bench-results" / "ledger.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "redis_version": version,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "operation": "reserve + release (two EVALSHA round trips), all admitted",
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
