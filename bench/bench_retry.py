"""Refusals people can act on, in the simulator: does a 429's Retry-After keep its promise?
(Figures, not a test.)

A synthetic load on one pool (worst-case reservations, clients that send no max_tokens) is
replayed by kvguard's own decision on the engine model, in simulated time. Every client refused
with a 429 retries once, after its retry-after (in ms, as the OpenAI SDK reads it), unless the
answer says `x-should-retry: false`; as the OpenAI SDK does. Each scenario runs twice, side by
side: with promises (`retry_after_max_seconds` 30, the default) and without (0: a 429 says
`retry-after: 1`, holding nothing).

Scenarios, as multiples of the pool's drain rate D (requests a second it serves when saturated,
measured first with the same load):
- burst: 0.7 D for 30 s, 1.5 D for 15 s, 0.7 D for 45 s;
- steady 1.0 D and 1.05 D, and heavier overload at 1.5 D and 2 D, for 120 s each.

Per scenario: of the requests refused at their first attempt, the share told to retry that was
admitted on the retry, refused on it, and the share told not to retry; requests served, goodput
(TTFT within 2 s, counted from the first attempt) and the KV blocks reserved on average.

    .venv/bin/python bench/bench_retry.py [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.config.loading import parse as parse_config  # noqa: E402
from kvguard.config.schema import Config  # noqa: E402
from kvguard.errors import Code  # noqa: E402
from kvguard.sim.engine import EngineConfig  # noqa: E402
from kvguard.sim.policies import POLICIES  # noqa: E402
from kvguard.sim.replay import Run  # noqa: E402
from kvguard.sim.simulate import Options, engine_config, pool_capacity  # noqa: E402
from kvguard.sim.sweep import replay_policy  # noqa: E402
from kvguard.sim.trace import TraceRequest  # noqa: E402

RESULTS = ROOT / "bench-results"
CONFIG = """
tenancy:
  default_tier: chat
  tiers:
    chat: {max_tokens_cap: 512, default_max_tokens: 512, max_blocks: 4000}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 4096
    watermark: 0.1
    capacity: {blocks: 4000, block_size: 16}
    retry_after_max_seconds: %s
"""
TENANTS = 8
SLO_S = 2.0


def load(rate_of: list[tuple[float, float]], seed: int) -> list[TraceRequest]:
    """Poisson arrivals at each (seconds, requests a second) in turn; prompts of 200-1,200
    tokens, answers of 20-500 (log-uniform), from TENANTS tenants."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    start = 0.0
    for seconds, rate in rate_of:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            prompt = rng.randint(200, 1200)
            output = int(20 * (25 ** rng.random()))
            out.append(TraceRequest(t, f"t{rng.randrange(TENANTS)}", prompt, output))
            t += rng.expovariate(rate)
        start += seconds
    return out


def setting(promises: bool) -> tuple[Config, EngineConfig]:
    config = parse_config(CONFIG % (30 if promises else 0), "bench.yaml", environ={})
    engine = engine_config(config, pool_capacity(config, Options("t", "c")), Options("t", "c"))
    return config, engine


async def replayed(requests: list[TraceRequest], promises: bool) -> Run:
    config, engine = setting(promises)
    capacity = pool_capacity(config, Options("t", "c"))
    return await replay_policy(requests, POLICIES["worst_case"], config, capacity, engine, 1)


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
    goodput: int
    reserved_mean: float


def figures(scenario: str, promises: bool, run: Run) -> Figures:
    first_refused = [o for o in run.outcomes if o.attempts > 1 or o.verdict.refused is not None]
    retried = [o for o in first_refused if o.attempts > 1]
    admitted = sum(1 for o in retried if o.seq is not None)
    not_told = sum(
        1
        for o in first_refused
        if o.attempts == 1 and o.verdict.refused and Code(o.verdict.refused).status == 429
    )
    n = max(1, len(first_refused))
    ttfts = [o.ttft_s for o in run.outcomes if o.ttft_s is not None]
    return Figures(
        scenario,
        promises,
        len(run.outcomes),
        len(first_refused),
        admitted / n,
        (len(retried) - admitted) / n,
        not_told / n,
        sum(1 for o in run.outcomes if o.seq is not None),
        sum(1 for t in ttfts if t <= SLO_S),
        run.kv.reserved_mean,
    )


async def drain_rate(seed: int) -> float:
    """Requests a second the pool serves when saturated: 3x a guess for 120 s, counted over
    its second half."""
    requests = load([(120.0, 60.0)], seed)
    run = await replayed(requests, promises=False)
    done = [o for o in run.outcomes if o.seq is not None and o.seq.arrival >= 60.0]
    return len(done) / 60.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    d = await drain_rate(args.seed)
    print(f"drain rate D = {d:.1f} requests/s (worst case, 4,000 blocks of 16)")
    scenarios = {
        "burst 1.5D x 15 s": [(30.0, 0.7 * d), (15.0, 1.5 * d), (45.0, 0.7 * d)],
        "steady 1.0D": [(120.0, 1.0 * d)],
        "steady 1.05D": [(120.0, 1.05 * d)],
        "steady 1.5D": [(120.0, 1.5 * d)],
        "steady 2D": [(120.0, 2.0 * d)],
    }
    rows: list[Figures] = []
    print(
        f"{'scenario':<20} {'promises':<8} {'refused':>8} {'admitted on retry':>18} "
        f"{'refused again':>14} {'told not to':>12} {'served':>7} {'goodput':>8} "
        f"{'KV reserved':>12}"
    )
    for name, rates in scenarios.items():
        requests = load(rates, args.seed)
        for promises in (True, False):
            row = figures(name, promises, await replayed(requests, promises))
            rows.append(row)
            print(
                f"{name:<20} {'yes' if promises else 'no':<8} {row.refused_first:>8} "
                f"{row.admitted_on_retry:>17.0%} {row.refused_on_retry:>14.0%} "
                f"{row.told_not_to_retry:>12.0%} {row.served:>7} {row.goodput:>8} "
                f"{row.reserved_mean:>12.0f}"
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "retry_sim.json"
    out.write_text(json.dumps({"drain_rate": d, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
