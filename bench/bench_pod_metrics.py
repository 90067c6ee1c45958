"""What a scrape of the pod's one metrics endpoint costs the supervisor with server.workers N,
beside what one process's own exposition costs (figures, not a test).

Each worker's exposition comes from kvguard's own instruments (kvguard.ops.metrics.Metrics on
OpenTelemetry's Prometheus reader), fed as a busy pod's would be: POOLS pools x TENANTS tenants
with reserved blocks, every refusal reason of two tiers, decision and queue-wait histograms.
A merged scrape parses every worker's text, merges it (kvguard.ops.metrics_merge.PodMetrics) and
writes the pod's text; the reading over loopback is not included (one GET per worker).

    .venv/bin/python bench/bench_pod_metrics.py [--workers 1 2 4 8] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

from kvguard.errors import Code  # noqa: E402
from kvguard.ops.metrics import Metrics  # noqa: E402
from kvguard.ops.metrics_merge import PodMetrics  # noqa: E402

POOLS = 4
TENANTS = 20
TIERS = ("free", "pro")


def busy_worker(worker: int) -> CollectorRegistry:
    """One busy worker's instruments, fed; its registry writes its /metrics text."""
    registry = CollectorRegistry()
    metrics = Metrics(
        MeterProvider([PrometheusMetricReader(scope_info_enabled=False, registry=registry)])
    )
    pools = [f"pool-{i}" for i in range(POOLS)]
    for n, pool in enumerate(pools):
        for tier in TIERS:
            for code in Code:
                metrics.record_decision(
                    pool=pool, tier=tier, outcome="refused", reason=code.value,
                    duration_s=0.001 * (n + 1), prompt_tokens=None,
                )  # fmt: skip
            metrics.record_decision(
                pool=pool, tier=tier, outcome="admitted", reason="", duration_s=0.002,
                prompt_tokens=300 + worker,
            )  # fmt: skip
            metrics.record_completion(pool=pool, tier=tier, completion_tokens=120)
        metrics.record_queued(pool, "admitted", 0.3)
    view = metrics.view
    view.reserved = {pool: 1000 for pool in pools}
    view.capacity = {pool: 4000 for pool in pools}
    view.capacity_known = {pool: 1 for pool in pools}
    view.tenants = {pool: {f"tenant-{t}": 10 * t for t in range(TENANTS)} for pool in pools}
    view.queued = {pool: worker for pool in pools}
    view.ledger_available = 1
    return registry


def per_scrape_ms(scrape: object, scrapes: int) -> float:
    """The median over rounds of the mean CPU ms of one call of `scrape()`."""
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(scrapes):
            scrape()  # type: ignore[operator]
        rounds.append((time.process_time() - start) * 1000 / scrapes)
    return statistics.median(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    registries = [busy_worker(i) for i in range(max(args.workers))]
    texts = [generate_latest(registry).decode() for registry in registries]
    # What a scrape costs a process serving its own endpoint (workers: 1), OpenTelemetry's
    # reader included.
    one_process = per_scrape_ms(lambda: generate_latest(registries[0]), args.scrapes)
    print(f"exposition: {len(texts[0]):,} bytes, {texts[0].count(chr(10)):,} lines per worker")
    print(f"a process's own endpoint: {one_process:.2f} ms CPU a scrape (reference)")
    for workers in args.workers:

        def merged_scrape(n: int = workers) -> bytes:
            pod = PodMetrics()
            pod.read_round(dict(enumerate(texts[:n])))  # one read of every worker
            registry = CollectorRegistry(auto_describe=False)

            class Pod(Collector):
                def collect(self):  # type: ignore[no-untyped-def]
                    return pod.collect()

            registry.register(Pod())
            return generate_latest(registry)

        cost = per_scrape_ms(merged_scrape, args.scrapes)
        print(
            f"workers {workers}: {cost:.2f} ms CPU a merged scrape "
            f"(x{cost / one_process:.1f} the reference, {cost / workers:.2f} ms per worker)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
