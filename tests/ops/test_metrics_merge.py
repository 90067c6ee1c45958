"""The pod's exposition merged from its workers' (server.workers > 1): the rules of
kvguard.ops.metrics.MERGE_RULES on real expositions, as OpenTelemetry's Prometheus reader writes
them, and the supervisor's endpoint and reads over loopback."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvguard.ops import pod_endpoint
from kvguard.ops.metrics import MERGE_RULES, Metrics
from kvguard.ops.metrics_merge import PodMetrics, exposed_name
from kvguard.ops.pod_endpoint import PodEndpoint, read_expositions
from kvguard.testing import free_port
from tests.clock import Clock
from tests.ops.scrape import serve_the_scrape

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
POOL = (("pool", "qwen"),)
ADMITTED = (
    "kvguard_admissions_total",
    (("outcome", "admitted"), ("pool", "qwen"), ("reason", ""), ("tier", "pro")),
)


def worker(
    *,
    admitted: int = 0,
    durations: tuple[float, ...] = (),
    queued: int = 0,
    reserved: int = 100,
    preemptions: int = 0,
    available: bool = True,
    known: bool = True,
) -> tuple[Metrics, CollectorRegistry]:
    """One worker's instruments, fed, and the registry its exposition is written from."""
    registry = CollectorRegistry()
    metrics = Metrics(
        MeterProvider([PrometheusMetricReader(scope_info_enabled=False, registry=registry)])
    )
    for _ in range(admitted):
        metrics.record_decision(
            pool="qwen", tier="pro", outcome="admitted", reason="", duration_s=None,
            prompt_tokens=None,
        )  # fmt: skip
    for duration in durations:
        metrics.record_decision(
            pool="qwen", tier="pro", outcome="refused", reason="capacity_exhausted",
            duration_s=duration, prompt_tokens=None,
        )  # fmt: skip
    view = metrics.view
    view.capacity, view.reserved, view.queued = {"qwen": 1000}, {"qwen": reserved}, {"qwen": queued}
    view.preemptions, view.capacity_known = {"qwen": preemptions}, {"qwen": int(known)}
    view.ledger_available = int(available)
    return metrics, registry


def text(**fed: Any) -> str:
    return generate_latest(worker(**fed)[1]).decode()


def samples(families: list[Metric]) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def merged(*texts: str) -> Samples:
    """The merge of one read of workers 0, 1... exposing `texts`."""
    pod = PodMetrics()
    pod.read_round(dict(enumerate(texts)))
    return samples(pod.collect())


def test_counters_add_up_and_the_shared_view_does_not() -> None:
    pod = merged(
        text(admitted=3, queued=2, reserved=120, preemptions=7),
        text(admitted=5, queued=1, reserved=100, preemptions=6),
    )
    assert pod[ADMITTED] == 8
    assert pod[("kvguard_queued_requests", POOL)] == 3  # each worker's own queue
    assert pod[("kvguard_capacity_blocks", POOL)] == 1000  # the same pool, not doubled
    assert pod[("kvguard_reserved_blocks", POOL)] == 120  # the one ledger, the latest reading
    # The same vLLM events, counted by each worker: not added up (the first read: worker 0's).
    assert pod[("kvguard_engine_preemptions_total", POOL)] == 7
    assert pod[("kvguard_worker_restarts_total", ())] == 0


def test_histograms_add_up_bucket_by_bucket() -> None:
    pod = merged(text(durations=(0.0007, 0.003)), text(durations=(0.003, 0.3, 3.0)))
    bucket = "kvguard_decision_duration_seconds_bucket"
    assert pod[(bucket, (("le", "0.001"),))] == 1
    assert pod[(bucket, (("le", "0.005"),))] == 3
    assert pod[(bucket, (("le", "0.5"),))] == 4
    assert pod[(bucket, (("le", "+Inf"),))] == 5
    assert pod[("kvguard_decision_duration_seconds_count", ())] == 5
    assert pod[("kvguard_decision_duration_seconds_sum", ())] == pytest.approx(3.3067)


def test_conditions_every_worker_must_see_take_the_lowest() -> None:
    pod = merged(text(available=True, known=True), text(available=False, known=False))
    assert pod[("kvguard_ledger_available", ())] == 0
    assert pod[("kvguard_capacity_known", POOL)] == 0
    assert merged(text(), text())[("kvguard_ledger_available", ())] == 1


def test_target_info_is_one_series_for_the_pod() -> None:
    # Each worker process has its own service_instance_id: the first worker's stands.
    first = text()
    second = re.sub('service_instance_id="[^"]*"', 'service_instance_id="other"', first)
    infos = [key for key in merged(first, second) if key[0] == "target_info"]
    assert infos == [key for key in merged(first) if key[0] == "target_info"]
    assert infos != [key for key in merged(second) if key[0] == "target_info"]


def test_a_dead_workers_counts_stay_after_its_restart() -> None:
    pod = PodMetrics()
    pod.read_round({0: text(admitted=3, queued=4, durations=(0.003,)), 1: text(admitted=5)})
    pod.read_round(
        {0: text(admitted=3, queued=4, durations=(0.003,)), 1: text(admitted=5, queued=1)}
    )
    pod.died(0)
    pod.restarts += 1
    pod.read_round({0: text(admitted=1), 1: text(admitted=5, queued=1)})  # 0 counts from zero
    seen = samples(pod.collect())
    assert seen[ADMITTED] == 9
    assert seen[("kvguard_decision_duration_seconds_count", ())] == 1
    assert seen[("kvguard_queued_requests", POOL)] == 1  # a queue dies with its process
    assert seen[("kvguard_worker_restarts_total", ())] == 1


def test_a_worker_that_does_not_answer_keeps_its_counts_and_shows_no_view() -> None:
    pod = PodMetrics()
    pod.read_round(
        {0: text(admitted=3, reserved=500, queued=2), 1: text(admitted=5, reserved=100, queued=1)}
    )
    pod.read_round({0: None, 1: "not an exposition {"})  # timed out; garbled
    seen = samples(pod.collect())
    assert seen[ADMITTED] == 8  # totals never go down for a slow scrape
    assert ("kvguard_reserved_blocks", POOL) not in seen
    assert ("kvguard_queued_requests", POOL) not in seen


def test_a_reading_that_counts_less_than_the_last_is_a_bad_one() -> None:
    """A cut or garbled answer that still parses: the last good reading stands, then retires."""
    pod = PodMetrics()
    pod.read_round({0: text(admitted=5, durations=(0.003,), reserved=300), 1: text(admitted=1)})
    pod.read_round({0: text(admitted=4, durations=(0.003,), reserved=200), 1: text(admitted=2)})
    seen = samples(pod.collect())
    assert seen[ADMITTED] == 7
    assert seen[("kvguard_reserved_blocks", POOL)] == 100  # worker 0's view is not shown
    pod.read_round({0: text(admitted=5, durations=(0.003, 0.01)), 1: text(admitted=2)})
    assert samples(pod.collect())[("kvguard_decision_duration_seconds_count", ())] == 2
    pod.died(0)  # what it last counted, not the bad reading, stays
    assert samples(pod.collect())[ADMITTED] == 7


def preemptions(**pools: int) -> str:
    """An exposition with just kvguard_engine_preemptions_total, per pool."""
    lines = ["# TYPE kvguard_engine_preemptions_total counter"]
    lines += [f'kvguard_engine_preemptions_total{{pool="{p}"}} {n}' for p, n in pools.items()]
    return "\n".join(lines) + "\n"


def pod_preemptions(pod: PodMetrics) -> dict[str, float]:
    return {
        dict(labels)["pool"]: value
        for (name, labels), value in samples(pod.collect()).items()
        if name == "kvguard_engine_preemptions_total"
    }


def test_shared_counters_move_by_one_workers_increase_whoever_dies() -> None:
    pod = PodMetrics()
    pod.read_round({0: preemptions(a=100, b=10), 1: preemptions(a=90, b=9)})
    assert pod_preemptions(pod) == {"a": 100, "b": 10}  # the first leader's: worker 0's
    pod.read_round({0: preemptions(a=104, b=10), 1: preemptions(a=93, b=11)})
    assert pod_preemptions(pod) == {"a": 104, "b": 10}  # worker 0's increase, not 1's
    pod.died(0)
    pod.read_round({0: preemptions(a=3, b=0), 1: preemptions(a=97, b=12)})
    assert pod_preemptions(pod) == {"a": 108, "b": 11}  # the restarted 0 is the youngest
    pod.read_round({0: preemptions(a=5, b=0), 1: None})  # 1 misses a read
    assert pod_preemptions(pod) == {"a": 110, "b": 11}  # 0, read twice, leads meanwhile
    pod.read_round({0: preemptions(a=6, b=1), 1: preemptions(a=100, b=14)})
    assert pod_preemptions(pod) == {"a": 111, "b": 12}  # 1 missed the last read: 0's increase
    pod.read_round({0: preemptions(a=9, b=1), 1: preemptions(a=101, b=16)})
    assert pod_preemptions(pod) == {"a": 112, "b": 14}  # 1 leads again, the older one


def test_shared_counters_stand_still_while_no_worker_was_read_twice() -> None:
    pod = PodMetrics()
    pod.read_round({0: None, 1: None})
    assert pod_preemptions(pod) == {}
    pod.read_round({0: preemptions(a=7), 1: None})
    pod.read_round({0: preemptions(a=9), 1: preemptions(a=2)})
    assert pod_preemptions(pod) == {"a": 9}
    pod.died(0)
    pod.died(1)
    pod.read_round({0: preemptions(a=1), 1: preemptions(a=1)})  # every worker is new
    assert pod_preemptions(pod) == {"a": 9}
    pod.read_round({0: preemptions(a=4, c=2), 1: preemptions(a=5, c=1)})  # a pool appears
    assert pod_preemptions(pod) == {"a": 12, "c": 2}


def test_a_family_without_a_rule_merges_by_its_type() -> None:
    unknown = (
        "# TYPE other_events_total counter\nother_events_total 2\n"
        '# TYPE other_level gauge\nother_level{a="x"} 4\n'
    )
    lower = unknown.replace(" 2\n", " 3\n").replace(" 4\n", " 1\n")
    pod = merged(unknown, lower)
    assert pod[("other_events_total", ())] == 5
    assert pod[("other_level", (("a", "x"),))] == 4


def test_every_exposed_family_has_its_rule() -> None:
    """Every instrument declares how workers merge it, in MERGE_RULES, and only they are there."""
    metrics, registry = worker(admitted=1, durations=(0.01,), preemptions=1)
    metrics.record_decision(
        pool="qwen", tier="pro", outcome="admitted", reason="", duration_s=0.01, prompt_tokens=9
    )
    metrics.record_completion(pool="qwen", tier="pro", completion_tokens=20)
    metrics.record_queued("qwen", "admitted", 0.2)
    metrics.record_ledger_error()
    metrics.record_reload(True)
    metrics.record_drain_cut(1)
    view = metrics.view
    view.used, view.waiting, view.trust = {"qwen": 5}, {"qwen": 1}, {"qwen": 0.5}
    view.promised, view.capacity_age_s = {"qwen": 3}, {"qwen": 2.0}
    view.tenants, view.replicas = {"qwen": {"acme": 8}}, 2
    view.pods = {"qwen": {"10.0.0.1:8000": 8}}
    families = text_string_to_metric_families(generate_latest(registry).decode())
    assert {exposed_name(f) for f in families} == set(MERGE_RULES)


def test_both_reload_series_exist_at_zero_from_the_start() -> None:
    """So that increase() sees a process's first rejected reload."""
    reader = InMemoryMetricReader()
    Metrics(MeterProvider([reader]))
    data = reader.get_metrics_data()
    assert data is not None
    reloads = {
        point.attributes["result"]: point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "kvguard_config_reloads"
        for point in metric.data.data_points
    }
    assert reloads == {"applied": 0, "rejected": 0}
    result = "kvguard_config_reloads_total"
    pod = merged(text(), text())
    assert {k: v for k, v in pod.items() if k[0] == result} == {
        (result, (("result", "applied"),)): 0,
        (result, (("result", "rejected"),)): 0,
    }


def test_ledger_replicas_shows_no_series_while_unknown() -> None:
    metrics, registry = worker()
    exposed = generate_latest(registry).decode()
    assert "kvguard_ledger_replicas" not in exposed
    metrics.view.replicas = 3
    assert merged(generate_latest(registry).decode())[("kvguard_ledger_replicas", ())] == 3


@pytest.fixture
def exposing() -> Iterator[list[int]]:
    """Two workers' expositions on loopback ports, as telemetry.setup serves them."""
    servers = []
    for admitted in (2, 3):
        server, thread = start_http_server(0, "127.0.0.1", worker(admitted=admitted)[1])
        servers.append((server, thread))
    yield [int(server.server_address[1]) for server, _ in servers]
    for server, thread in servers:
        server.shutdown()
        thread.join()


def test_the_workers_are_read_at_once_and_a_gone_one_is_none(exposing: list[int]) -> None:
    answers = read_expositions({0: exposing[0], 1: exposing[1], 2: free_port()}, 2.0)
    assert answers[2] is None
    assert merged(answers[0] or "", answers[1] or "")[ADMITTED] == 5


def test_the_endpoint_serves_the_merge_from_the_callers_loop(exposing: list[int]) -> None:
    endpoint = PodEndpoint("127.0.0.1:0")
    try:
        endpoint.serving(0, exposing[0])
        endpoint.serving(1, exposing[1])
        got: list[str] = []

        def scrape() -> None:
            url = f"http://127.0.0.1:{endpoint.port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as answer:
                got.append(answer.read().decode())

        scraper = threading.Thread(target=scrape)
        scraper.start()
        serve_the_scrape(endpoint)
        scraper.join(5)
        (exposition,) = got
        assert samples(list(text_string_to_metric_families(exposition)))[ADMITTED] == 5
    finally:
        endpoint.close()


def test_the_workers_are_read_between_scrapes_too() -> None:
    clock = Clock(100.0)
    reads: list[dict[int, int]] = []

    def read(ports: Any, _timeout_s: float) -> dict[int, str | None]:
        reads.append(dict(ports))
        return {worker: text(admitted=1) for worker in ports}

    endpoint = PodEndpoint("127.0.0.1:0", read=read, clock=clock)
    try:
        endpoint.serving(0, 1234)
        assert endpoint.seconds_to_read() == pod_endpoint.READ_EVERY_S
        clock.now += pod_endpoint.READ_EVERY_S
        assert endpoint.seconds_to_read() == 0
        endpoint.read_workers()
        assert reads == [{0: 1234}]
        assert endpoint.seconds_to_read() == pod_endpoint.READ_EVERY_S
        endpoint.died(0)  # what it had counted when last read stays
        assert samples(endpoint.pod.collect())[ADMITTED] == 1
    finally:
        endpoint.close()
