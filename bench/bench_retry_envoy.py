"""Refusals people can act on, through the real Envoy: each way of refusing, for each kind of
client, on the same arrivals. (Figures, not a test.)

bench/bench_retry.py's measurement in real time: clients send chat completions without
max_tokens, Poisson arrivals from NOISY tenants and a quiet one (`x-tenant-id`), through Envoy
from envoy/envoy.yaml to kvguard (`kvguard serve` in its own process, so that the 429s' round
trips carry none of the load's work; memory ledger, worst-case reservations) in front of an
upstream that holds each request as an engine would: TOKEN_S per output token plus
PROMPT_TOKEN_S per prompt token, then one JSON answer. The noisy tenants' quota is
NOISY_QUOTA blocks each; the quiet tenant's requests are small and always within its quota.

The ways of refusing (`retry_after_max_seconds`, `queue.max_wait_seconds`): no promise (a 429
says `retry-after: 1`), a promise (`--horizon`, 15 s: time is compressed), the queue for 2 s and
for 5 s, a promise and the queue for 2 s. The clients, as bench_retry.py's: the OpenAI SDK's rule
(kvguard.sim.load.sdk_retry_delay) with 2 retries, with 1, and none.

Time is compressed so that a run fits in a minute: a pool of BLOCKS blocks of 16, answers of
25-150 tokens (0.5-3 s), the burst 0.4 times as long as the simulator's. Each run gets a fresh
kvguard and Envoy; the upstream and the clients live in this process. D, the requests a second
the pool serves when saturated, is measured first (a saturating load without retries, admitted
per second in its second half); the burst is 0.7 D for 10 s, 1.5 D for 10 s, 0.7 D for 20 s
(`--steady` adds 1.5 D for `--steady-s`).

Per row: requests served; first attempts refused; requests started upstream within 2 s of
their first attempt; the quiet tenant's p99 of that time (inf when more than 1 % of its requests
were never served) and its requests served; every 429's round trip through Envoy (p50, p99).
The host's speed (seconds `sum(range(10**7))` takes, at start and at the end) goes with the
figures to bench-results/retry_envoy.json.

    .venv/bin/python bench/bench_retry_envoy.py [--seed 1] [--horizon 15] [--steady [--no-burst]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from kvguard.sim.model.report import percentile  # noqa: E402
from kvguard.testing import free_port  # noqa: E402
from kvguard.testing.envoy import EnvoyProcess, loopback_config  # noqa: E402

RESULTS = ROOT / "bench-results"
TOKENIZER = ROOT / ".cache" / "models" / "qwen"
MODEL = "qwen"
NOISY, NOISY_QUOTA = 8, 64
QUIET, QUIET_RATE, QUIET_MAX_TOKENS = "quiet", 1.0, 40
BLOCKS, BLOCK_SIZE, WATERMARK = 320, 16, 0.1
MAX_TOKENS = 160  # the tier's default and cap: what a request without max_tokens reserves
PROMPT_WORDS = (50, 300)  # one token each, as Qwen counts them
OUTPUT_TOKENS = (25, 150)  # log-uniform: where an answer ends by itself
TOKEN_S = 0.02
PROMPT_TOKEN_S = 0.0002
WORDS = [" the", " cat", " sat", " on", " a", " mat", " and", " it", " was", " good"]
SATURATING_RATE = 30.0  # requests a second: about 3 D
SATURATING_S = 20.0
SLO_S = 2.0
# Way of refusing -> (retry_after_max_seconds, or the horizon when None; queue wait).
WAYS: dict[str, tuple[float | None, float]] = {
    "no promise": (0.0, 0.0),
    "promise": (None, 0.0),
    "queue 2 s": (0.0, 2.0),
    "queue 5 s": (0.0, 5.0),
    "promise + queue 2 s": (None, 2.0),
}
CLIENTS = {"OpenAI SDK": 2, "retries once": 1, "never retries": 0}


def kvguard_config(
    port: int, horizon_s: float, wait_s: float = 0.0, quota: int = NOISY_QUOTA
) -> dict[str, Any]:
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
                    "max_blocks": quota,
                },
                "quiet": {
                    "max_tokens_cap": QUIET_MAX_TOKENS,
                    "default_max_tokens": QUIET_MAX_TOKENS,
                    "max_blocks": 40,
                },
            },
            "tenants": {QUIET: "quiet"},
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
                "queue": {"max_wait_seconds": wait_s},
            }
        ],
    }


class EngineUpstream:
    """Answers each completion after TOKEN_S per output token (the client's `x-bench-tokens`,
    cut to the body's max_tokens) and PROMPT_TOKEN_S per prompt token (kvguard's count);
    `started` notes when each body arrived (time.perf_counter())."""

    def __init__(self) -> None:
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.started: dict[bytes, float] = {}

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
        raw = await request.read()
        body = json.loads(raw)
        self.started.setdefault(body["messages"][0]["content"].encode(), time.perf_counter())
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
    content: bytes = b""  # its message, as the upstream notes it


def load(rate_of: list[tuple[float, float]], seed: int, quiet: bool = True) -> list[Planned]:
    """Poisson arrivals of the noisy tenants at each (seconds, requests a second) in turn, and
    the quiet tenant's at QUIET_RATE over the whole window (small prompts, 5-40 tokens);
    every body differs (its number leads the message)."""
    rng = random.Random(seed)
    out: list[Planned] = []

    def planned(t: float, tenant: str, words: tuple[int, int], tokens: int) -> Planned:
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        content = f"{len(out)}:{text}"
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
        return Planned(t, tenant, body.encode(), tokens, content.encode())

    start = 0.0
    for seconds, rate in rate_of:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            low, high = OUTPUT_TOKENS
            tokens = int(low * ((high / low) ** rng.random()))
            out.append(planned(t, f"t{rng.randrange(NOISY)}", PROMPT_WORDS, tokens))
            t += rng.expovariate(rate)
        start += seconds
    t = rng.expovariate(QUIET_RATE)
    while quiet and t < start:
        out.append(planned(t, QUIET, (20, 60), rng.randint(5, QUIET_MAX_TOKENS)))
        t += rng.expovariate(QUIET_RATE)
    return sorted(out, key=lambda p: p.at_s)


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
    first_at: float = 0.0  # time.perf_counter() of its first attempt

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


async def send(url: str, plan: list[Planned], seed: int, retries: int) -> list[Outcome]:
    """Each planned request at its time, and up to `retries` retries as the SDK makes them."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    start = loop.time()
    target = url + "/v1/chat/completions"

    async def one(http: aiohttp.ClientSession, planned: Planned) -> Outcome:
        outcome = Outcome(planned)
        await asyncio.sleep(max(0.0, start + planned.at_s - loop.time()))
        outcome.first_at = time.perf_counter()
        try:
            for retry in range(retries + 1):
                answer, headers = await attempt(http, target, planned)
                outcome.attempts.append(answer)
                answer.retry_after_s = sdk_retry_delay(answer.status, headers, retry, rng)
                if retry == retries or answer.retry_after_s is None:
                    break
                await asyncio.sleep(answer.retry_after_s)  # the client's own retry timer
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        return list(await asyncio.gather(*(one(http, p) for p in plan)))


class Gateway:
    """A fresh kvguard (`kvguard serve`) and Envoy in front of the upstream, for one run."""

    def __init__(
        self,
        work: Path,
        upstream_port: int,
        horizon_s: float,
        wait_s: float = 0.0,
        quota: int = NOISY_QUOTA,
    ) -> None:
        self._work = work
        self._upstream_port = upstream_port
        self._config = kvguard_config(0, horizon_s, wait_s, quota)
        self._kvguard: subprocess.Popen[bytes] | None = None
        self.envoy: EnvoyProcess | None = None

    async def __aenter__(self) -> EnvoyProcess:
        self._work.mkdir(parents=True)
        port = free_port()
        config = self._work / "kvguard.yaml"
        self._config["server"]["grpc_listen"] = f"127.0.0.1:{port}"
        config.write_text(yaml.safe_dump(self._config, sort_keys=False))
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
    way: str
    client: str
    requests: int
    served: int
    refused_first: int
    within_2s: int  # started upstream within SLO_S of the first attempt
    quiet_requests: int
    quiet_served: int
    quiet_p99_s: float
    refusals_429: int  # every 429 answered, retries included
    refusal_p50_ms: float | None
    refusal_p99_ms: float | None
    reasons: dict[str, int]  # first refusals by status and x-kvguard-reason
    errors: int
    wall_s: float


def figures(
    scenario: str,
    way: str,
    client: str,
    outcomes: list[Outcome],
    started: dict[bytes, float],
    wall_s: float,
) -> Figures:
    refused = [o for o in outcomes if o.attempts and o.attempts[0].status != 200]
    ms_429 = [1000 * a.seconds for o in outcomes for a in o.attempts if a.status == 429]
    reasons = Counter(f"{o.attempts[0].status} {o.attempts[0].reason}" for o in refused)

    def waited(o: Outcome) -> float:
        at = started.get(o.planned.content)
        return at - o.first_at if o.served and at is not None else math.inf

    quiet = [waited(o) for o in outcomes if o.planned.tenant == QUIET]
    return Figures(
        scenario,
        way,
        client,
        len(outcomes),
        sum(1 for o in outcomes if o.served),
        len(refused),
        sum(1 for o in outcomes if waited(o) <= SLO_S),
        len(quiet),
        sum(1 for w in quiet if math.isfinite(w)),
        _p99(quiet),
        len(ms_429),
        _round(percentile(ms_429, 0.5)),
        _round(percentile(ms_429, 0.99)),
        dict(reasons.most_common()),
        sum(1 for o in outcomes if o.error is not None),
        round(wall_s, 1),
    )


def _p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile, in s: inf when more than 1 % never started."""
    value = percentile(values, 0.99)
    return math.inf if value is None or not math.isfinite(value) else round(value, 2)


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 2)


def host_speed() -> float:
    """Seconds this host takes for sum(range(10**7)): the figures' yardstick."""
    start = time.perf_counter()
    sum(range(10**7))
    return round(time.perf_counter() - start, 3)


async def drain_rate(work: Path, upstream: EngineUpstream, seed: int) -> float:
    """Requests a second the pool serves when saturated: SATURATING_RATE for SATURATING_S,
    without retries, admitted per second over its second half."""
    plan = load([(SATURATING_S, SATURATING_RATE)], seed, quiet=False)
    async with Gateway(work / "drain", upstream.port, 0, quota=BLOCKS) as envoy:
        outcomes = await send(envoy.url, plan, seed, 0)
    half = SATURATING_S / 2
    return sum(1 for o in outcomes if o.served and o.planned.at_s >= half) / half


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steady", action="store_true", help="also steady overload at 1.5D")
    parser.add_argument("--no-burst", action="store_true", help="leave the burst out")
    parser.add_argument("--steady-s", type=float, default=45.0, help="seconds of the steady run")
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
            scenarios = {}
            if not args.no_burst:
                scenarios["burst 1.5D x 10 s"] = [(10.0, 0.7 * d), (10.0, 1.5 * d), (20.0, 0.7 * d)]
            if args.steady:
                scenarios["steady 1.5D"] = [(args.steady_s, 1.5 * d)]
            print(
                f"{'scenario':<18} {'way':<20} {'client':<14} {'sent':>5} {'served':>6} "
                f"{'refused':>7} {'<= 2 s':>6} {'quiet served':>12} {'quiet p99 s':>11} "
                f"{'429 p50/p99 ms':>15}",
                flush=True,
            )
            for index, (name, rates) in enumerate(scenarios.items()):
                plan = load(rates, args.seed + index)
                for way, (horizon, wait) in WAYS.items():
                    for client, retries in CLIENTS.items():
                        folder = work / f"{index}-{way}-{client}".replace(" ", "_")
                        upstream.started = {}
                        promise = args.horizon if horizon is None else horizon
                        async with Gateway(folder, upstream.port, promise, wait) as envoy:
                            started = time.monotonic()
                            outcomes = await send(envoy.url, plan, args.seed, retries)
                            wall = time.monotonic() - started
                        row = figures(name, way, client, outcomes, upstream.started, wall)
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
            "noisy_quota": NOISY_QUOTA,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": PROMPT_WORDS,
            "output_tokens": OUTPUT_TOKENS,
            "token_s": TOKEN_S,
            "prompt_token_s": PROMPT_TOKEN_S,
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
    quiet = f"{row.quiet_served}/{row.quiet_requests}"
    p99 = f"{row.quiet_p99_s:g}"
    errors = f"  ({row.errors} transport errors)" if row.errors else ""
    return (
        f"{row.scenario:<18} {row.way:<20} {row.client:<14} {row.requests:>5} {row.served:>6} "
        f"{row.refused_first:>7} {row.within_2s:>6} {quiet:>12} {p99:>11} {latency:>15}{errors}"
    )


if __name__ == "__main__":
    uvloop.run(main())
