"""Many processes, one pool, one real Redis: the ledger never over-admits.

PROCESSES separate processes (spawned: nothing shared but Redis) each run rounds of CYCLES
reserve/release cycles, CONCURRENCY at a time, against one pool whose limit and tenant quotas are
far below what they ask for together. Meanwhile this process samples the pool's usage (one atomic
script read) as often as it can: at no sampled instant may the reserved blocks pass the pool limit
(capacity x (1 - watermark)) or any tenant's quota, and every reservation's own answer says the
same. The workers go on with another round until the sampler has seen the pool busy BUSY_SAMPLES
times (a starved sampler on a loaded host only makes the run longer). At the end nothing is
reserved.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvguard.admission.capacity import pool_limit
from kvguard.ledger import Claim, Outcome
from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.testing.redis import RedisServer
from kvguard.testing.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

PROCESSES = 4
CYCLES = 400  # per process
CONCURRENCY = 16  # cycles in flight per process
CAPACITY = 150
WATERMARK = 0.2
LIMIT = pool_limit(CAPACITY, WATERMARK)  # 120 blocks: what a claim's pool_limit carries
QUOTAS = {"t0": 60, "t1": 60, "t2": 45}
POOL = "shared"
BUSY_SAMPLES = 50  # samples with blocks reserved before the workers may stop
DEADLINE_S = 120.0


def _worker(url: str, index: int) -> dict[str, Any]:
    """One process: CYCLES reserve/hold/release cycles; returns its counts and violations."""
    return asyncio.run(_cycles(url, index))


async def _cycles(url: str, index: int) -> dict[str, Any]:
    # Patient: this proves atomicity; a loaded machine must not fail it with a timeout.
    ledger = RedisLedger.from_url(url, timeout_s=5.0)
    rng = random.Random(index)
    counts = {"admitted": 0, "tenant_quota": 0, "pool_watermark": 0}
    violations: list[str] = []
    cycles = 0
    try:
        # Start together: wait (with a deadline) until every process has connected and the
        # sampler says go (it samples from then on, its connection and scripts warm).
        client = ledger._client
        await client.incr("test:ready")

        async def all_ready() -> bool:
            return await client.get("test:go") is not None

        await wait_until(all_ready, "the other processes to connect", timeout_s=60)

        async def cycle(n: int) -> None:
            tenant = rng.choice(list(QUOTAS))
            claim = Claim(
                f"w{index}-{n}", POOL, tenant, rng.randint(1, 16), LIMIT, QUOTAS[tenant], 60
            )
            reservation = await ledger.reserve(claim)
            counts[reservation.outcome.value] += 1
            if reservation.pool_reserved > LIMIT:
                violations.append(f"{claim.lease_id}: pool at {reservation.pool_reserved}")
            if reservation.tenant_reserved > QUOTAS[tenant]:
                violations.append(f"{claim.lease_id}: {tenant} at {reservation.tenant_reserved}")
            if reservation.outcome is Outcome.ADMITTED:
                assert reservation.lease is not None
                # The request's work: a random short hold, so that leases overlap.
                await asyncio.sleep(rng.uniform(0.001, 0.008))
                await ledger.release(reservation.lease)

        semaphore = asyncio.Semaphore(CONCURRENCY)

        async def bounded(n: int) -> None:
            async with semaphore:
                await cycle(n)

        # Rounds of CYCLES until the sampler has seen enough (it sets test:stop).
        deadline = time.monotonic() + DEADLINE_S / 2
        while True:
            await asyncio.gather(*(bounded(n) for n in range(cycles, cycles + CYCLES)))
            cycles += CYCLES
            if await client.get("test:stop") is not None:
                break
            if time.monotonic() >= deadline:
                violations.append(f"worker {index}: the sampler never saw the pool busy enough")
                break
    finally:
        await ledger.close()
    return {"counts": counts, "violations": violations, "cycles": cycles}


async def test_processes_never_over_admit_one_pool(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        sampler = RedisLedger.from_url(server.url, timeout_s=5.0)
        context = multiprocessing.get_context("spawn")
        samples = 0
        busy_samples = 0
        peak = 0
        tenant_peaks = dict.fromkeys(QUOTAS, 0)
        bad: list[str] = []
        started = time.monotonic()
        try:
            with ProcessPoolExecutor(PROCESSES, mp_context=context) as pool:
                futures = [
                    asyncio.wrap_future(pool.submit(_worker, server.url, i))
                    for i in range(PROCESSES)
                ]
                done = asyncio.gather(*futures)
                # Spawning the workers takes the CPU for seconds on a small host: the sampler
                # lets them start only once they all wait, so that it samples the whole run.
                await sampler.usage(POOL)
                client = sampler._client

                async def all_waiting() -> bool:
                    return int(await client.get("test:ready") or 0) >= PROCESSES

                await wait_until(all_waiting, "the workers to connect", timeout_s=60)
                await client.set("test:go", 1)

                async def sample_unless_finished() -> bool:
                    """True once the workers are done; until then, take one sample."""
                    nonlocal samples, busy_samples, peak
                    if done.done():
                        return True
                    usage = await sampler.usage(POOL)
                    samples += 1
                    busy_samples += usage.reserved > 0
                    if busy_samples == BUSY_SAMPLES:
                        await client.set("test:stop", 1)
                    peak = max(peak, usage.reserved)
                    if usage.reserved > LIMIT:
                        bad.append(f"pool reserved {usage.reserved} > {LIMIT}")
                    if sum(usage.tenants.values()) != usage.reserved:
                        bad.append(f"tenants {usage.tenants} do not add up to {usage.reserved}")
                    for tenant, blocks in usage.tenants.items():
                        tenant_peaks[tenant] = max(tenant_peaks[tenant], blocks)
                        if blocks > QUOTAS[tenant]:
                            bad.append(f"{tenant} reserved {blocks} > {QUOTAS[tenant]}")
                    return False

                # Samples back to back (a turn of the event loop between two) until the end.
                await wait_until(
                    sample_unless_finished, "the workers to finish", timeout_s=DEADLINE_S, poll_s=0
                )
                results = await done
            final = await sampler.usage(POOL)
        finally:
            await sampler.close()
    elapsed = time.monotonic() - started

    totals = {"admitted": 0, "tenant_quota": 0, "pool_watermark": 0}
    cycles = sum(result["cycles"] for result in results)
    for result in results:
        for key, value in result["counts"].items():
            totals[key] += value
        bad.extend(result["violations"])
    print(
        f"\n{PROCESSES} processes, {cycles} cycles ({CONCURRENCY} in flight each) in "
        f"{elapsed:.1f}s: {totals['admitted']} admitted, {totals['pool_watermark']} refused "
        f"(pool watermark), {totals['tenant_quota']} refused (tenant quota); "
        f"{samples} samples ({busy_samples} with blocks reserved), peak {peak} of limit {LIMIT}, "
        f"tenant peaks {tenant_peaks} of quotas {QUOTAS}; at the end {final.reserved} reserved"
    )
    assert bad == []
    assert sum(totals.values()) == cycles >= PROCESSES * CYCLES
    # The pool was really contended, and sampled while it was.
    assert totals["admitted"] > 0 and totals["pool_watermark"] > 0 and totals["tenant_quota"] > 0
    assert busy_samples >= BUSY_SAMPLES
    assert peak > LIMIT // 2
    assert (final.reserved, final.leases, final.tenants) == (0, 0, {})
