"""OTLP export: metrics and decision spans reach a real OTLP/gRPC receiver on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.extproc.harness import body, exchange, headers, running

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}]}


class Receiver(
    metrics_service_pb2_grpc.MetricsServiceServicer, trace_service_pb2_grpc.TraceServiceServicer
):
    """Records what an OTLP exporter sends, as a collector would receive it."""

    def __init__(self) -> None:
        self.metric_names: set[str] = set()
        self.span_names: list[str] = []

    async def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metric_names.update(m.name for m in sm.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                self.span_names.extend(s.name for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_metrics_and_spans_are_exported_over_otlp(tmp_path: Path) -> None:
    receiver = Receiver()
    server = grpc.aio.server()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with running(tmp_path, otlp_endpoint=f"http://127.0.0.1:{port}") as (service, stub):
            call, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
            await call.done_writing()
            await service.stop(0)  # shutting the providers down flushes both exporters
        assert {"kvguard_admissions", "kvguard_decision_duration"} <= receiver.metric_names
        assert receiver.span_names == ["kvguard.decision"]
    finally:
        await server.stop(0)
