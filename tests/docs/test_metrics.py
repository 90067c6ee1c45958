"""docs/operations.md's metrics table names exactly the metrics kvguard exports, with their types.

The exported names are read from a real Prometheus exposition, as `kvguard serve` sets it up
(kvguard.ops.telemetry): OpenTelemetry's Prometheus reader on a registry of its own, fed by
`kvguard.ops.metrics.Metrics`. Every instrument Metrics creates is given a value, so that each
one appears whatever feeds it in a running process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from prometheus_client import CollectorRegistry, generate_latest

from kvguard.ops.metrics import Metrics
from tests.docs.markdown import DOCS, code_spans, read, tables_headed

PAGE = DOCS / "operations.md"


def _one(_: CallbackOptions) -> Iterable[Observation]:
    return [Observation(1)]


class _FeedingMeter:
    """The real meter's instruments, each given a value: synchronous ones once `feed()` is
    called, observable ones by a callback that always observes 1."""

    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self._feeds: list[Callable[[], None]] = []
        self.created: list[str] = []  # the names of the instruments created

    def feed(self) -> None:
        for feed in self._feeds:
            feed()

    def create_counter(self, name: str, **kwargs: Any) -> Any:
        self.created.append(name)
        instrument = self._meter.create_counter(name, **kwargs)
        self._feeds.append(lambda: instrument.add(1))
        return instrument

    def create_up_down_counter(self, name: str, **kwargs: Any) -> Any:
        self.created.append(name)
        instrument = self._meter.create_up_down_counter(name, **kwargs)
        self._feeds.append(lambda: instrument.add(1))
        return instrument

    def create_histogram(self, name: str, **kwargs: Any) -> Any:
        self.created.append(name)
        instrument = self._meter.create_histogram(name, **kwargs)
        self._feeds.append(lambda: instrument.record(1))
        return instrument

    def create_gauge(self, name: str, **kwargs: Any) -> Any:
        self.created.append(name)
        instrument = self._meter.create_gauge(name, **kwargs)
        self._feeds.append(lambda: instrument.set(1))
        return instrument

    def create_observable_gauge(self, name: str, callbacks: Any = None, **kwargs: Any) -> Any:
        self.created.append(name)
        return self._meter.create_observable_gauge(name, callbacks=[_one], **kwargs)

    def create_observable_counter(self, name: str, callbacks: Any = None, **kwargs: Any) -> Any:
        self.created.append(name)
        return self._meter.create_observable_counter(name, callbacks=[_one], **kwargs)

    def create_observable_up_down_counter(
        self, name: str, callbacks: Any = None, **kwargs: Any
    ) -> Any:
        self.created.append(name)
        return self._meter.create_observable_up_down_counter(name, callbacks=[_one], **kwargs)


class _FeedingProvider:
    def __init__(self, provider: MeterProvider) -> None:
        self._provider = provider
        self.meters: list[_FeedingMeter] = []

    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> _FeedingMeter:
        meter = _FeedingMeter(self._provider.get_meter(name, *args, **kwargs))
        self.meters.append(meter)
        return meter


def exported_metrics() -> tuple[dict[str, str], int]:
    """Prometheus name -> type of every metric kvguard exports, and how many instruments
    kvguard created."""
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(scope_info_enabled=False, registry=registry)
    provider = SdkMeterProvider([reader])
    try:
        feeding = _FeedingProvider(provider)
        Metrics(cast(MeterProvider, feeding))
        for meter in feeding.meters:
            meter.feed()
        exposition = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    types = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if name != "target_info":  # OpenTelemetry's resource, not one of kvguard's metrics
                types[name] = kind
    return types, sum(len(meter.created) for meter in feeding.meters)


def documented_metrics(text: str) -> dict[str, str]:
    """Metric name -> type from the `| metric | type | ...` tables of a page's `text`."""
    documented = {}
    for table in tables_headed(text, "metric", "type"):
        for row in table:
            (name,) = code_spans(row[0])
            assert name not in documented, f"{name} is documented twice"
            documented[name] = row[1]
    return documented


def table_differences(text: str) -> dict[str, tuple[str | None, str | None]]:
    """Metric name -> (documented type, exported type) for each metric where the two differ;
    None where the table does not name it or kvguard does not export it."""
    documented, exported = documented_metrics(text), exported_metrics()[0]
    return {
        name: (documented.get(name), exported.get(name))
        for name in sorted(documented.keys() | exported.keys())
        if documented.get(name) != exported.get(name)
    }


def test_the_metrics_table_names_exactly_what_kvguard_exports() -> None:
    assert table_differences(read(PAGE)) == {}


def test_every_instrument_is_exported_by_its_prometheus_name() -> None:
    exported, instruments = exported_metrics()
    assert len(exported) == instruments
    assert exported["kvguard_admissions_total"] == "counter"
    assert exported["kvguard_decision_duration_seconds"] == "histogram"
    assert exported["kvguard_capacity_age_seconds"] == "gauge"


def test_a_table_that_differs_is_caught() -> None:
    # Mutations of the real page, so that a checker that stops reading the table fails here.
    page = read(PAGE)

    def row(name: str) -> str:
        (line,) = [x for x in page.splitlines() if x.startswith(f"| `{name}` |")]
        return line

    errors, capacity = row("kvguard_ledger_errors_total"), row("kvguard_capacity_blocks")
    dropped = page.replace(errors + "\n", "")
    assert table_differences(dropped) == {"kvguard_ledger_errors_total": (None, "counter")}
    retyped = page.replace(capacity, capacity.replace("| gauge |", "| counter |"))
    assert table_differences(retyped) == {"kvguard_capacity_blocks": ("counter", "gauge")}
    unknown = capacity.replace("kvguard_capacity_blocks", "kvguard_unknown")
    added = page.replace(capacity, capacity + "\n" + unknown)
    assert table_differences(added) == {"kvguard_unknown": ("gauge", None)}
