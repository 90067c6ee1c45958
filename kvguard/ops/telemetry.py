"""Metrics, traces and decision logs, set up once per process and fed one decision at a time.

A decision becomes: one `kvguard_admissions_total` increment, one span (a child of the W3C trace
context Envoy forwards, when there is one) and one JSON log line; a released lease one more line
(`released`) and, where its completion tokens are known, one `kvguard_completion_tokens`
observation. None of them ever carries prompt text or credentials.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, start_http_server

from kvguard import __version__
from kvguard.admission.record import Completion, Decision
from kvguard.config.schema import ServerSettings
from kvguard.ops import worker_metrics
from kvguard.ops.metrics import Metrics

log = logging.getLogger("kvguard.decision")
# Release lines on a logger of their own: "kvguard.decision" holds one line per decision.
release_log = logging.getLogger("kvguard.release")
_PROPAGATOR = TraceContextTextMapPropagator()


class Telemetry:
    def __init__(self, metrics: Metrics, tracer_provider: trace.TracerProvider | None = None):
        self.metrics = metrics
        # Without a tracer provider no span is made at all (not even a no-op one): extracting
        # the trace context and a no-op span would cost CPU on every decision for nothing.
        self._tracer = (
            tracer_provider.get_tracer("kvguard", __version__) if tracer_provider else None
        )

    @contextmanager
    def deciding(self, decision: Decision, headers: Mapping[str, str]) -> Iterator[None]:
        """Time, trace and record the decision made inside the block (admitted or refused)."""
        start = time.perf_counter()
        if self._tracer is None:
            try:
                yield
            finally:
                self.record(decision, time.perf_counter() - start)
            return
        parent = _PROPAGATOR.extract(headers)
        with self._tracer.start_as_current_span(
            "kvguard.decision", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            try:
                yield
            finally:
                span.set_attributes(decision.attributes())
                self.record(decision, time.perf_counter() - start)

    def record(self, decision: Decision, duration_s: float | None = None) -> None:
        """Count and log one final decision."""
        self.metrics.record_decision(
            pool=decision.pool,
            tier=decision.tier,
            outcome=decision.outcome,
            reason=decision.reason,
            duration_s=duration_s,
            prompt_tokens=decision.prompt_tokens,
            tenant=decision.metered_tenant,
        )
        if not log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = decision.attributes()
        if duration_s is not None:
            fields["duration_ms"] = round(duration_s * 1000, 3)
        log.info("decision", extra=fields)

    def released(self, completion: Completion) -> None:
        """Count and log one released lease with what its request produced, where known."""
        if completion.completion_tokens is not None:
            self.metrics.record_completion(
                pool=completion.pool,
                tier=completion.tier,
                completion_tokens=completion.completion_tokens,
            )
        if release_log.isEnabledFor(logging.INFO):
            release_log.info("released", extra=completion.attributes())


@dataclass
class Providers:
    """The process's OpenTelemetry providers and the exposition they feed."""

    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None
    metrics_port: int | None  # the Prometheus endpoint's port, when enabled
    _http: Any = None

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
        self.meter_provider.shutdown()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()


def setup(settings: ServerSettings, report_fd: int | None = None) -> Providers:
    """Prometheus exposition at metrics_listen (in a worker of server.workers > 1, `report_fd`
    given: on loopback, its port announced there for the supervisor to merge), OTLP (gRPC) to
    otlp_endpoint, when set."""
    resource = Resource.create({"service.name": "kvguard", "service.version": __version__})
    readers: list[MetricReader] = []
    port, server = None, None
    # A supervised worker serves on loopback; its supervisor serves metrics_listen.
    listen = worker_metrics.listen_address(settings.metrics_listen, report_fd)
    if listen:
        registry = CollectorRegistry()
        # No otel_scope_* labels: the series carry exactly the documented labels.
        readers.append(PrometheusMetricReader(scope_info_enabled=False, registry=registry))
        host, _, wanted = listen.rpartition(":")
        server, _ = start_http_server(int(wanted), addr=host or "0.0.0.0", registry=registry)
        port = int(server.server_address[1])
        worker_metrics.announce(report_fd, port)
    tracer_provider = None
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(settings.otlp_endpoint)))
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(settings.otlp_endpoint))
        )
    return Providers(MeterProvider(readers, resource=resource), tracer_provider, port, server)
