"""What calibrated reservation adds to a decision, side by side with the worst case (figures,
not a test).

`Admission.admit` in process on the memory ledger, its counter given the prompt's count (no
tokenizer: counting is measured by bench_tokens.py), for a chat request without max_tokens, in
a pool in `worst_case` mode and in the same pool in `calibrated` mode with 2,000 learnt samples
per tier and tenant; each lease is released at once. Also the pick of the pod (`routing: pick`,
worst case): the same decision in a pool of 1, 4, 16 and 64 pods that all fit, against the pool
without pods. And the growth step: `LeaseKeeper.grow_all` over 1,000 open growing leases.
Rounds alternate between the variants, so that a noisy host slows them alike.

    .venv/bin/python bench/bench_reservation.py [--decisions 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvguard.admission.admit import Admission, AdmissionRequest, AdmissionSettings  # noqa: E402
from kvguard.admission.calibration import Calibration, Growth  # noqa: E402
from kvguard.admission.capacity import Capacities, PodCapacity, PoolCapacity  # noqa: E402
from kvguard.admission.leases import LeaseKeeper  # noqa: E402
from kvguard.admission.policy import Policy, PoolPolicy, identify_request  # noqa: E402
from kvguard.admission.record import Decision  # noqa: E402
from kvguard.config.schema import (  # noqa: E402
    CapacityConfig,
    Config,
    PoolConfig,
    ReservationConfig,
    TenancyConfig,
    TierConfig,
)
from kvguard.ledger import Claim  # noqa: E402
from kvguard.ledger.memory import MemoryLedger  # noqa: E402
from kvguard.tokens.counting import PromptCounter  # noqa: E402
from kvguard.tokens.tokenizer import PoolTokenizer  # noqa: E402

RESULTS = ROOT / "bench-results"
MODEL = "qwen"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


class GivenCount:
    async def count(self, *_args: Any, **_kwargs: Any) -> list[int]:
        return [1000]


PICK_PODS = (1, 4, 16, 64)


def pod_urls(pods: int) -> list[str]:
    return [f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(pods)]


def config(mode: str, pods: int = 0) -> Config:
    """A pool in `mode`; with `pods`, discovered from that many endpoints and picking."""
    tier = TierConfig(max_tokens_cap=1024, default_max_tokens=1024, max_blocks=10**9)
    capacity = CapacityConfig(blocks=10**9, block_size=16)
    if pods:
        capacity = CapacityConfig(endpoints=pod_urls(pods))
    pool = PoolConfig(
        name="p",
        models=[MODEL],
        tokenizer="/models/p",
        max_model_len=8192,
        capacity=capacity,
        reservation=ReservationConfig(mode=mode),  # type: ignore[arg-type]
        routing="pick" if pods else None,
    )
    return Config(tenancy=TenancyConfig(default_tier="chat", tiers={"chat": tier}), pools=[pool])


def admission(mode: str, pods: int = 0) -> tuple[Admission, Policy, Calibration]:
    cfg = config(mode, pods)
    pool = cfg.pools[0]
    each = tuple(PodCapacity(url.split("//")[1], 10**9) for url in pod_urls(pods))
    capacity = PoolCapacity(10**9 * max(pods, 1), 16, each)
    pooled = PoolPolicy(pool, cast(PoolTokenizer, None), capacity)
    policy = Policy(cfg.tenancy, False, {pool.name: pooled}, {MODEL: pooled})
    capacities = Capacities()
    capacities.set(pool.name, capacity)
    calibration = Calibration()
    for i in range(2000):
        calibration.observe(pool, "chat", "acme", 50 + i % 400, 0.0)
    settings = AdmissionSettings(max_body_bytes=1 << 20, lease_seconds=60.0)
    counter = cast(PromptCounter, GivenCount())
    return (
        Admission(MemoryLedger(), counter, capacities, settings, calibration, lambda: 0.0),
        policy,
        calibration,
    )


async def decisions(mode: str, count: int, pods: int = 0) -> float:
    """Seconds of CPU per decision (admit + release), in a pool of `pods` picked pods."""
    admitting, policy, _ = admission(mode, pods)
    identity = identify_request(policy, {"x-tenant-id": "acme"})
    started = time.process_time()
    for _ in range(count):
        request = AdmissionRequest(policy, "chat", identity, BODY, Decision())
        admitted = await admitting.admit(request)
        assert admitted.lease is not None and bool(admitted.lease.pod) == bool(pods)
        await admitting.ledger.release(admitted.lease)
    return (time.process_time() - started) / count


async def growth(leases: int, rounds: int) -> float:
    """Seconds of CPU per grow_all over `leases` growing leases."""
    ledger = MemoryLedger()
    now = [0.0]
    keeper = LeaseKeeper(ledger, 60.0, clock=lambda: now[0], decode_rate=lambda _p: 30.0)
    for i in range(leases):
        claim = Claim(f"l{i}", "p", "acme", 70, 10**9, 10**9, 60.0)
        reservation = await ledger.reserve(claim)
        assert reservation.lease is not None
        keeper.hold(reservation.lease, Growth("p", (1000,), 1, 16, 1024, 100, 0.0))
    started = time.process_time()
    for step in range(rounds):
        now[0] = 1.0 + step
        await keeper.grow_all()
    return (time.process_time() - started) / rounds


async def main(count: int, rounds: int) -> dict[str, Any]:
    per_mode: dict[str, list[float]] = {"worst_case": [], "calibrated": []}
    per_pods: dict[int, list[float]] = {pods: [] for pods in PICK_PODS}
    for _ in range(rounds):
        for mode in per_mode:
            per_mode[mode].append(await decisions(mode, count))
        for pods in per_pods:
            per_pods[pods].append(await decisions("worst_case", count, pods))
    median = {mode: statistics.median(values) for mode, values in per_mode.items()}
    picks = {pods: statistics.median(values) for pods, values in per_pods.items()}
    grow = await growth(1000, 20)
    started = time.perf_counter()
    sum(range(10**8))
    host = time.perf_counter() - started
    return {
        "host_sum_range_1e8_s": round(host, 2),
        "decision_us": {mode: round(value * 1e6, 1) for mode, value in median.items()},
        "calibrated_over_worst_case": round(median["calibrated"] / median["worst_case"], 3),
        "pick_decision_us": {str(pods): round(value * 1e6, 1) for pods, value in picks.items()},
        "pick_over_no_pods": {
            str(pods): round(value / median["worst_case"], 3) for pods, value in picks.items()
        },
        "grow_all_1000_leases_ms": round(grow * 1e3, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    figures = asyncio.run(main(args.decisions, args.rounds))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reservation.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
