"""Soak: mixed traffic with faults for a while, then the ledger's drift from the truth
(a benchmark, not a test; it stops by itself).

Real processes: redis-server, `kvguard serve` with 2 workers sharing it (SO_REUSEPORT), the
shipped Envoy, a local upstream. Traffic: chat and completions, streamed or not, 6 tenants,
clients that walk away, upstream 500s and connection resets. Faults, in turn, every
`--fault-every` seconds: redis-server restarted empty, a kvguard worker SIGKILLed (the
supervisor starts it again), Envoy's upstream answering 5xx for a while.

The truth at the end is "no stream open", so every block still reserved once the leases of
killed workers have had time to expire is drift. Prints admitted / refused / errors and the
drift, and writes bench-results/soak.json.

    .venv/bin/python bench/soak.py [--minutes 10] [--rate 40]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
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

from kvguard.ledger.redis_ledger import RedisLedger  # noqa: E402
from kvguard.testing.envoy import EnvoyProcess, loopback_config  # noqa: E402
from kvguard.testing.redis import RedisServer, free_port  # noqa: E402
from kvguard.testing.upstream import RecordingUpstream  # noqa: E402

LEASE_S = 5


def worker_pids(supervisor: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


async def client(http: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    chat = rng.random() < 0.7
    body: dict[str, Any] = {"model": "qwen", "max_tokens": rng.choice([None, 20, 200, 5000])}
    if chat:
        body["messages"] = [{"role": "user", "content": "word " * rng.randint(1, 400)}]
    else:
        body["prompt"] = "word " * rng.randint(1, 400)
    body["stream"] = rng.random() < 0.5
    headers = {"x-tenant-id": f"tenant-{rng.randint(0, 5)}"}
    if rng.random() < 0.05:
        headers["x-test-status"] = "500"
    if rng.random() < 0.03:
        headers["x-test-reset"] = "1"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with asyncio.timeout(rng.choice([0.05, 30, 30, 30])):  # some walk away early
            async with http.post(url + path, json=body, headers=headers) as response:
                await response.read()
                if response.status == 200:
                    return "admitted"
                return response.headers.get("x-kvguard-reason", f"http_{response.status}")
    except TimeoutError:
        return "client_gave_up"
    except aiohttp.ClientError:
        return "connection_error"


async def main(minutes: float, rate: float, fault_every: float) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvguard-soak-"))
    rng = random.Random(7)
    outcomes: collections.Counter[str] = collections.Counter()
    faults: list[str] = []
    with RedisServer(work / "redis") as redis:
        port = free_port()
        config = {
            "server": {"grpc_listen": f"127.0.0.1:{port}", "metrics_listen": "", "workers": 2,
                       "log_level": "warning", "drain_seconds": 5},
            "ledger": {"url": redis.url, "lease_seconds": LEASE_S, "replicas": 2},
            "tenancy": {"default_tier": "free",
                        "tiers": {"free": {"max_tokens_cap": 256, "default_max_tokens": 64,
                                           "max_blocks": 200}}},
            "pools": [{"name": "qwen", "models": ["qwen"],
                       "tokenizer": str(ROOT / ".cache" / "models" / "qwen"),
                       "max_model_len": 8192, "capacity": {"blocks": 600, "block_size": 16}}],
        }  # fmt: skip
        (work / "kvguard.yaml").write_text(yaml.safe_dump(config))
        kvguard = subprocess.Popen(
            [sys.executable, "-m", "kvguard", "serve", "--config", str(work / "kvguard.yaml")],
            stderr=(work / "kvguard.log").open("wb"),
        )
        upstream = RecordingUpstream(token_delay=0.01)
        await upstream.start()
        ledger = RedisLedger.from_url(redis.url)
        rendered = loopback_config(port, upstream.port)
        try:
            async with EnvoyProcess(rendered, work) as envoy, aiohttp.ClientSession() as http:
                await envoy.wait_cluster_healthy("kvguard", timeout=60)
                start = time.monotonic()
                end = start + minutes * 60
                next_fault, fault_no = start + fault_every, 0
                tasks: set[asyncio.Task[str]] = set()
                i = 0
                while time.monotonic() < end:
                    i += 1
                    await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                    task = asyncio.create_task(client(http, envoy.url, rng))
                    task.add_done_callback(lambda t: outcomes.update([t.result()]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if time.monotonic() >= next_fault:
                        kind = ("redis restarted empty", "worker SIGKILLed")[fault_no % 2]
                        if fault_no % 2 == 0:
                            await asyncio.to_thread(redis.restart)
                        else:
                            pids = worker_pids(kvguard.pid)
                            if pids:
                                os.kill(rng.choice(pids), signal.SIGKILL)
                        faults.append(f"{time.monotonic() - start:.0f}s {kind}")
                        print(f"fault: {faults[-1]}", flush=True)
                        fault_no += 1
                        next_fault += fault_every
                await asyncio.gather(*tasks, return_exceptions=True)
            # The truth now: no stream is open. Leases of killed workers expire within LEASE_S.
            settle_until = time.monotonic() + LEASE_S + 5
            drift = (await ledger.usage("qwen")).reserved
            while drift and time.monotonic() < settle_until:
                await asyncio.sleep(0.5)
                drift = (await ledger.usage("qwen")).reserved
        finally:
            kvguard.send_signal(signal.SIGTERM)
            code = kvguard.wait(60)
            await ledger.close()
            await upstream.stop()
    admitted = outcomes["admitted"]
    refused = sum(n for k, n in outcomes.items() if k not in ("admitted",))
    result = {"minutes": minutes, "rate": rate, "outcomes": dict(outcomes), "faults": faults,
              "drift_blocks": drift, "kvguard_exit": code}  # fmt: skip
    print(json.dumps(result, indent=2))
    print(f"admitted {admitted}, not admitted {refused}, faults {len(faults)}, "
          f"ledger drift at the end: {drift} blocks, kvguard exit {code}")  # fmt: skip
    out = ROOT / "bench-results" / "soak.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate", type=float, default=40, help="requests per second")
    parser.add_argument("--fault-every", type=float, default=30, help="seconds")
    args = parser.parse_args()
    uvloop.run(main(args.minutes, args.rate, args.fault_every))
