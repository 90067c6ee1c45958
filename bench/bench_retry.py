"""Refusals people can act on, in the simulator: each way of refusing, for each kind of client,
on the same arrivals. (Figures, not a test.)

A synthetic load on one pool (worst-case reservations, clients that send no max_tokens) is
replayed by kvguard's own decision on the engine model, in simulated time: NOISY tenants
(prompts of 200-1,200 tokens, answers of 20-500, 512 output tokens injected, a quota of
NOISY_QUOTA blocks each) and a quiet tenant (QUIET_RATE requests a second whatever the load,
prompts of 100-300 tokens, answers of 20-100, 128 injected, a quota of 200: it always fits its
quota). The ways of refusing (`retry_after_max_seconds`, `queue.max_wait_seconds`): no promise
(a 429 says `retry-after: 1`), a promise (30 s), the queue for 2 s and for 5 s, a promise and
the queue for 2 s. The clients: the OpenAI SDK as it is (2 retries, `retry-after-ms` honoured,
none after `x-should-retry: false`), one that retries once, one that never retries.

Scenarios, as multiples of the pool's drain rate D (requests a second it serves when saturated,
measured first with the same load): a burst (0.7 D for 30 s, 1.5 D for 15 s, 0.7 D for 45 s)
and steady overload at 1.5 D for 120 s.

Per row: requests served; first attempts refused; answers within 2 s of the first attempt
(TTFT, refusals and retries included); block-seconds that blocks held for other tenants'
retries kept a request that fits beside the leases refused (the invariant: 0); the quiet
tenant's p99 TTFT from its first attempt (inf when more than 1 % of its requests were not
served) and its requests served.

    .venv/bin/python bench/bench_retry.py [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.config.loading import parse as parse_config  # noqa: E402
from kvguard.sim.model.gate import PolicyGate  # noqa: E402
from kvguard.sim.model.replay import Run, replay  # noqa: E402
from kvguard.sim.model.report import percentile  # noqa: E402
from kvguard.sim.model.trace import TraceRequest  # noqa: E402
from kvguard.sim.simulate import Options, engine_config, pool_capacity  # noqa: E402

RESULTS = ROOT / "bench-results"
NOISY, NOISY_QUOTA = 8, 600
QUIET, QUIET_RATE = "quiet", 1.0
CONFIG = """
tenancy:
  default_tier: chat
  tiers:
    chat: {max_tokens_cap: 512, default_max_tokens: 512, max_blocks: %d}
    quiet: {max_tokens_cap: 128, default_max_tokens: 128, max_blocks: 200}
  tenants: {quiet: quiet}
pools:
  - name: p
    models: [m]
    tokenizer: /nonexistent
    max_model_len: 4096
    watermark: 0.1
    capacity: {blocks: 4000, block_size: 16}
    retry_after_max_seconds: %s
    queue: {max_wait_seconds: %s}
"""
# Way of refusing -> (retry_after_max_seconds, queue.max_wait_seconds).
WAYS = {
    "no promise": (0, 0),
    "promise": (30, 0),
    "queue 2 s": (0, 2),
    "queue 5 s": (0, 5),
    "promise + queue 2 s": (30, 2),
}
# Client -> retries after a 429 (the wait it is told; 1 s when it is told none).
CLIENTS = {"OpenAI SDK": 2, "retries once": 1, "never retries": 0}
SLO_S = 2.0


def load(rate_of: list[tuple[float, float]], seed: int) -> list[TraceRequest]:
    """Poisson arrivals of the noisy tenants at each (seconds, requests a second) in turn,
    and the quiet tenant's at QUIET_RATE over the whole window."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    start = 0.0
    for seconds, rate in rate_of:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            output = int(20 * (25 ** rng.random()))
            out.append(TraceRequest(t, f"t{rng.randrange(NOISY)}", rng.randint(200, 1200), output))
            t += rng.expovariate(rate)
        start += seconds
    t = rng.expovariate(QUIET_RATE)
    while t < start:
        out.append(TraceRequest(t, QUIET, rng.randint(100, 300), int(20 * (5 ** rng.random()))))
        t += rng.expovariate(QUIET_RATE)
    return sorted(out, key=lambda r: r.arrival_s)


async def replayed(
    requests: list[TraceRequest], way: str, retries: int, quota: int = NOISY_QUOTA
) -> tuple[Run, PolicyGate]:
    horizon, wait = WAYS[way]
    config = parse_config(CONFIG % (quota, horizon, wait), "bench.yaml", environ={})
    options = Options("t", "c")
    capacity = pool_capacity(config, options)
    engine = engine_config(config, capacity, options)
    gates: list[PolicyGate] = []

    def gate(clock: object) -> PolicyGate:
        gates.append(PolicyGate(config, capacity, clock))  # type: ignore[arg-type]
        return gates[-1]

    run = await replay(requests, engine, gate, label=way, retries=retries)
    gates[0].ended(run.end_s)
    return run, gates[0]


@dataclass
class Figures:
    scenario: str
    way: str
    client: str
    requests: int
    served: int
    refused_first: int
    within_2s: int
    fitting_refused_block_s: float
    quiet_requests: int
    quiet_served: int
    quiet_p99_s: float


def figures(scenario: str, way: str, client: str, run: Run, gate: PolicyGate) -> Figures:
    first_refused = [o for o in run.outcomes if o.attempts > 1 or o.verdict.refused is not None]
    ttfts = [o.ttft_s for o in run.outcomes if o.ttft_s is not None]
    quiet = [o for o in run.outcomes if o.request.tenant == QUIET]
    quiet_ttfts = [o.ttft_s if o.ttft_s is not None else math.inf for o in quiet]
    return Figures(
        scenario,
        way,
        client,
        len(run.outcomes),
        sum(1 for o in run.outcomes if o.seq is not None),
        len(first_refused),
        sum(1 for t in ttfts if t <= SLO_S),
        round(gate.fitting_refused_block_s, 1),
        len(quiet),
        sum(1 for o in quiet if o.seq is not None),
        round(percentile(quiet_ttfts, 0.99) or 0.0, 2),
    )


async def drain_rate(seed: int) -> float:
    """Noisy requests a second the pool serves when saturated: 60 a second for 120 s, no
    retries and no promise, counted over its second half."""
    requests = [r for r in load([(120.0, 60.0)], seed) if r.tenant != QUIET]
    run, _ = await replayed(requests, "no promise", 0, quota=4000)
    done = [o for o in run.outcomes if o.seq is not None and o.seq.arrival >= 60.0]
    return len(done) / 60.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    d = await drain_rate(args.seed)
    print(f"drain rate D = {d:.1f} requests/s (worst case, 4,000 blocks of 16)", flush=True)
    scenarios = {
        "burst 1.5D x 15 s": [(30.0, 0.7 * d), (15.0, 1.5 * d), (45.0, 0.7 * d)],
        "steady 1.5D": [(120.0, 1.5 * d)],
    }
    rows: list[Figures] = []
    print(
        f"{'scenario':<18} {'way':<20} {'client':<14} {'served':>6} {'refused':>7} "
        f"{'<= 2 s':>6} {'held blk-s':>10} {'quiet served':>12} {'quiet p99 s':>11}",
        flush=True,
    )
    for name, rates in scenarios.items():
        requests = load(rates, args.seed)
        for way in WAYS:
            for client, retries in CLIENTS.items():
                row = figures(name, way, client, *await replayed(requests, way, retries))
                rows.append(row)
                print(
                    f"{name:<18} {way:<20} {client:<14} {row.served:>6} {row.refused_first:>7} "
                    f"{row.within_2s:>6} {row.fitting_refused_block_s:>10g} "
                    f"{row.quiet_served:>5}/{row.quiet_requests:<6} {row.quiet_p99_s:>11g}",
                    flush=True,
                )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "retry_sim.json"
    out.write_text(json.dumps({"drain_rate": d, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
