"""Refusals people can act on, through the real Envoy: does a 429's Retry-After keep its promise?
(Figures, not a test.)

bench/bench_retry.py's measurement in real time: clients send chat completions without
max_tokens, Poisson arrivals from TENANTS tenants (`x-tenant-id`), through Envoy from
envoy/envoy.yaml to kvguard (`kvguard serve` in its own process, so that the 429s' round trips
carry none of the load's work; memory ledger, worst-case reservations) in front of an upstream
that holds each request as an engine would: TOKEN_S per output token plus PROMPT_TOKEN_S per
prompt token, then one JSON answer. Every client refused retries once, as the OpenAI SDK does:
the same body, after `retry-after-ms` (else `retry-after`), unless `x-should-retry: false`.

Time is compressed so that a run fits in ten minutes: a pool of BLOCKS blocks of 16, answers of
25-150 tokens (0.5-3 s), scenarios 0.4 times as long as the simulator's, and the promise
horizon halved (`retry_after_max_seconds`, `--horizon`, 15 s; 0 in the runs without promises: a
429 says `retry-after: 1`, holding nothing). The promises' jitter and grace are not compressed.
Each run gets a fresh kvguard (no promise, no learnt hold time carried over) and Envoy; the
upstream and the clients live in this process.

Scenarios, as multiples of the pool's drain rate D (requests a second it serves when
saturated: a saturating load without retries, admitted per second in its second half):
- burst: 0.7 D for 10 s, 1.5 D for 10 s, 0.7 D for 20 s;
- steady 1.0 D, 1.05 D, 1.5 D and 2 D, for `--steady-s` (45) each.

Per scenario, with and without promises: requests refused at their first attempt; of those,
the shares admitted on the retry, refused on it, and told not to retry; requests served; and
the round trip of every 429 as the client sees it through Envoy (p50, p99; the target is a p99
of at most 5 ms). The host's speed (seconds `sum(range(10**7))` takes, at start and at the end)
goes with the figures to bench-results/retry_envoy.json.

    .venv/bin/python bench/bench_retry_envoy.py [--seed 1] [--steady-s 45] [--horizon 15]
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
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.sim.load import sdk_retry_delay  # noqa: E402
from kvguard.sim.report import percentile  # noqa: E402
from kvguard.testing import free_port  # noqa: E402
from kvguard.testing.envoy import EnvoyProcess, loopback_config  # noqa: E402

RESULTS = ROOT / "bench-results"
TOKENIZER = ROOT / ".cache" / "models" / "qwen"
MODEL = "qwen"
TENANTS = 8
BLOCKS, BLOCK_SIZE, WATERMARK = 320, 16, 0.1
MAX_TOKENS = 160  # the tier's default and cap: what a request without max_tokens reserves
PROMPT_WORDS = (50, 300)  # one token each, as Qwen counts them
OUTPUT_TOKENS = (25, 150)  # log-uniform: where an answer ends by itself
TOKEN_S = 0.02
PROMPT_TOKEN_S = 0.0002
WORDS = [" the", " cat", " sat", " on", " a", " mat", " and", " it", " was", " good"]
SATURATING_RATE = 30.0  # requests a second: about 3 D
SATURATING_S = 20.0


def kvguard_config(port: int, horizon_s: float) -> dict[str, Any]:
    return {
        "server": {"grpc_listen": f"127.0.0.1:{port}", "metrics_listen": ""},
        "ledger": {"url": "memory://"},
        "tenancy": {
            "header": "x-tenant-id",
            "default_tier": "chat",
            "tiers": {
                "chat": {
                    "max_tokens_cap": MAX_TOKENS,
                    "default_max_tokens": MAX_TOKENS,
                    "max_blocks": BLOCKS,
                }
            },
        },
        "pools": [
            {
                "name": "p",
                "models": [MODEL],
                "tokenizer": str(TOKENIZER),
                "max_model_len": 4096,
                "watermark": WATERMARK,
                "capacity": {"blocks": BLOCKS, "block_size": BLOCK_SIZE},
                "retry_after_max_seconds": horizon_s,
            }
        ],
    }


class EngineUpstream:
    """Answers each completion after TOKEN_S per output token (the client's `x-bench-tokens`,
    cut to the body's max_tokens) and PROMPT_TOKEN_S per prompt token (kvguard's count)."""

    def __init__(self) -> None:
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_route("*", "/{tail:.*}", self._other)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _other(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _complete(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        limit = body.get("max_completion_tokens", body.get("max_tokens", MAX_TOKENS))
        natural = int(request.headers.get("x-bench-tokens", limit))
        tokens = min(natural, limit)
        prompt = int(request.headers.get("x-kvguard-prompt-tokens", "0"))
        await asyncio.sleep(TOKEN_S * tokens + PROMPT_TOKEN_S * prompt)
        message = {"role": "assistant", "content": "tok " * tokens}
        finish = "stop" if natural < limit else "length"
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
        }
        return web.json_response(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            }
        )


@dataclass(frozen=True)
class Planned:
    at_s: float
    tenant: str
    body: bytes
    tokens: int  # where its answer ends by itself


def load(rate_of: list[tuple[float, float]], seed: int) -> list[Planned]:
    """Poisson arrivals at each (seconds, requests a second) in turn, from TENANTS tenants;
    every body differs (its number leads the message)."""
    rng = random.Random(seed)
    out: list[Planned] = []
    start = 0.0
    for seconds, rate in rate_of:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            words = "".join(rng.choice(WORDS) for _ in range(rng.randint(*PROMPT_WORDS)))
            low, high = OUTPUT_TOKENS
            tokens = int(low * ((high / low) ** rng.random()))
            message = {"role": "user", "content": f"{len(out)}:{words}"}
            body = json.dumps({"model": MODEL, "messages": [message]}).encode()
            out.append(Planned(t, f"t{rng.randrange(TENANTS)}", body, tokens))
            t += rng.expovariate(rate)
        start += seconds
    return out


@dataclass
class Attempt:
    status: int
    seconds: float  # the round trip as the client saw it
    reason: str = ""
    should_retry: str = ""  # x-should-retry, when given
    retry_after_s: float | None = None  # what the client waits before its retry


@dataclass
class Outcome:
    planned: Planned
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None  # a transport failure

    @property
    def served(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].status == 200


async def attempt(
    http: aiohttp.ClientSession, url: str, planned: Planned
) -> tuple[Attempt, Mapping[str, str]]:
    """One POST of `planned`'s body, timed from its sending to the last byte of its answer."""
    headers = {
        "content-type": "application/json",
        "x-tenant-id": planned.tenant,
        "x-bench-tokens": str(planned.tokens),
    }
    started = time.perf_counter()
    async with http.post(url, data=planned.body, headers=headers) as response:
        await response.read()
        seconds = time.perf_counter() - started
        answer = Attempt(
            response.status,
            seconds,
            response.headers.get("x-kvguard-reason", ""),
            response.headers.get("x-should-retry", ""),
        )
        return answer, response.headers


async def send(url: str, plan: list[Planned], seed: int, *, retry: bool = True) -> list[Outcome]:
    """Each planned request at its time, and its retry as the SDK would make it."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    start = loop.time()
    target = url + "/v1/chat/completions"

    async def one(http: aiohttp.ClientSession, planned: Planned) -> Outcome:
        outcome = Outcome(planned)
        await asyncio.sleep(max(0.0, start + planned.at_s - loop.time()))
        try:
            first, headers = await attempt(http, target, planned)
            outcome.attempts.append(first)
            first.retry_after_s = sdk_retry_delay(first.status, headers, 0, rng)
            if not retry or first.retry_after_s is None:
                return outcome
            await asyncio.sleep(first.retry_after_s)
            second, _ = await attempt(http, target, planned)
            outcome.attempts.append(second)
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        return list(await asyncio.gather(*(one(http, p) for p in plan)))


class Gateway:
    """A fresh kvguard (`kvguard serve`) and Envoy in front of the upstream, for one run."""

    def __init__(self, work: Path, upstream_port: int, horizon_s: float) -> None:
        self._work = work
        self._upstream_port = upstream_port
        self._horizon_s = horizon_s
        self._kvguard: subprocess.Popen[bytes] | None = None
        self.envoy: EnvoyProcess | None = None

    async def __aenter__(self) -> EnvoyProcess:
        self._work.mkdir(parents=True)
        port = free_port()
        config = self._work / "kvguard.yaml"
        config.write_text(yaml.safe_dump(kvguard_config(port, self._horizon_s), sort_keys=False))
        command = [sys.executable, "-m", "kvguard", "serve", "--config", str(config)]
        log = (self._work / "kvguard.log").open("wb")
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        self._kvguard = subprocess.Popen(command, stderr=log, stdout=log, env=env)
        self.envoy = EnvoyProcess(loopback_config(port, self._upstream_port), self._work)
        await self.envoy.start()
        await self.envoy.wait_cluster_healthy("kvguard", timeout=60)
        return self.envoy

    async def __aexit__(self, *_: object) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        if self._kvguard is not None:
            self._kvguard.terminate()
            await asyncio.to_thread(self._kvguard.wait, 30)


@dataclass
class Figures:
    scenario: str
    promises: bool
    requests: int
    refused_first: int
    admitted_on_retry: float  # shares of refused_first
    refused_on_retry: float
    told_not_to_retry: float
    served: int
    refusals_429: int  # every 429 answered, retries included
    refusal_p50_ms: float | None
    refusal_p99_ms: float | None
    retry_after_p50_s: float | None  # what the refused were told to wait
    reasons: dict[str, int]  # first refusals by status and x-kvguard-reason
    errors: int
    wall_s: float


def figures(scenario: str, promises: bool, outcomes: list[Outcome], wall_s: float) -> Figures:
    refused = [o for o in outcomes if o.attempts and o.attempts[0].status != 200]
    retried = [o for o in refused if len(o.attempts) > 1]
    admitted = sum(1 for o in retried if o.served)
    not_told = sum(1 for o in refused if o.attempts[0].should_retry == "false")
    n = max(1, len(refused))
    ms_429 = [1000 * a.seconds for o in outcomes for a in o.attempts if a.status == 429]
    waits = [o.attempts[0].retry_after_s for o in retried]
    reasons = Counter(f"{o.attempts[0].status} {o.attempts[0].reason}" for o in refused)
    return Figures(
        scenario,
        promises,
        len(outcomes),
        len(refused),
        admitted / n,
        (len(retried) - admitted) / n,
        not_told / n,
        sum(1 for o in outcomes if o.served),
        len(ms_429),
        _round(percentile(ms_429, 0.5)),
        _round(percentile(ms_429, 0.99)),
        _round(percentile([w for w in waits if w is not None], 0.5)),
        dict(reasons.most_common()),
        sum(1 for o in outcomes if o.error is not None),
        round(wall_s, 1),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def host_speed() -> float:
    """Seconds this host takes for sum(range(10**7)): the figures' yardstick."""
    start = time.perf_counter()
    sum(range(10**7))
    return round(time.perf_counter() - start, 3)


async def drain_rate(work: Path, upstream: EngineUpstream, seed: int) -> float:
    """Requests a second the pool serves when saturated: SATURATING_RATE for SATURATING_S,
    without retries, admitted per second over its second half."""
    plan = load([(SATURATING_S, SATURATING_RATE)], seed)
    async with Gateway(work / "drain", upstream.port, 0) as envoy:
        outcomes = await send(envoy.url, plan, seed, retry=False)
    half = SATURATING_S / 2
    return sum(1 for o in outcomes if o.served and o.planned.at_s >= half) / half


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steady-s", type=float, default=45.0, help="seconds per steady run")
    parser.add_argument("--horizon", type=float, default=15.0, help="retry_after_max_seconds")
    args = parser.parse_args()
    speed = host_speed()
    upstream = EngineUpstream()
    await upstream.start()
    rows: list[Figures] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvguard-retry-") as tmp:
            work = Path(tmp)
            d = await drain_rate(work, upstream, args.seed)
            print(
                f"drain rate D = {d:.1f} requests/s (worst case, {BLOCKS} blocks of "
                f"{BLOCK_SIZE}, watermark {WATERMARK}); sum(range(10**7)) takes {speed} s",
                flush=True,
            )
            steady = args.steady_s
            scenarios = {
                "burst 1.5D x 10 s": [(10.0, 0.7 * d), (10.0, 1.5 * d), (20.0, 0.7 * d)],
                "steady 1.0D": [(steady, 1.0 * d)],
                "steady 1.05D": [(steady, 1.05 * d)],
                "steady 1.5D": [(steady, 1.5 * d)],
                "steady 2D": [(steady, 2.0 * d)],
            }
            print(
                f"{'scenario':<18} {'promises':<8} {'sent':>5} {'refused':>7} "
                f"{'admitted on retry':>17} {'refused again':>13} {'told not to':>11} "
                f"{'served':>6} {'429s':>5} {'429 p50/p99 ms':>15} {'wait p50 s':>10}",
                flush=True,
            )
            for index, (name, rates) in enumerate(scenarios.items()):
                plan = load(rates, args.seed + index)
                for promises in (True, False):
                    horizon = args.horizon if promises else 0.0
                    folder = work / f"{index}-{'promises' if promises else 'none'}"
                    async with Gateway(folder, upstream.port, horizon) as envoy:
                        started = time.monotonic()
                        outcomes = await send(envoy.url, plan, args.seed)
                        wall = time.monotonic() - started
                    row = figures(name, promises, outcomes, wall)
                    rows.append(row)
                    print(_line(row), flush=True)
    finally:
        await upstream.stop()
    speed_after = host_speed()
    print(f"sum(range(10**7)) takes {speed_after} s at the end")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "retry_envoy.json"
    result = {
        "drain_rate": d,
        "host_sum_range_s": {"start": speed, "end": speed_after},
        "settings": {
            "blocks": BLOCKS,
            "block_size": BLOCK_SIZE,
            "watermark": WATERMARK,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": PROMPT_WORDS,
            "output_tokens": OUTPUT_TOKENS,
            "token_s": TOKEN_S,
            "prompt_token_s": PROMPT_TOKEN_S,
            "steady_s": args.steady_s,
            "retry_after_max_seconds": args.horizon,
            "seed": args.seed,
        },
        "rows": [asdict(r) for r in rows],
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"written to {out.relative_to(ROOT)}")


def _line(row: Figures) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    latency = f"{ms(row.refusal_p50_ms)}/{ms(row.refusal_p99_ms)}"
    wait = "-" if row.retry_after_p50_s is None else f"{row.retry_after_p50_s:.1f}"
    errors = f"  ({row.errors} transport errors)" if row.errors else ""
    return (
        f"{row.scenario:<18} {'yes' if row.promises else 'no':<8} {row.requests:>5} "
        f"{row.refused_first:>7} {row.admitted_on_retry:>17.0%} {row.refused_on_retry:>13.0%} "
        f"{row.told_not_to_retry:>11.0%} {row.served:>6} {row.refusals_429:>5} "
        f"{latency:>15} {wait:>10}{errors}"
    )


if __name__ == "__main__":
    uvloop.run(main())
