"""kvguard_ledger_available and kvguard_capacity_known, read back exactly from a running Service
(the SDK's in-memory reader): what the alert rules on them see."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvguard import config as configs
from kvguard.app import Service
from kvguard.ops.telemetry import Providers
from kvguard.testing import free_port
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import running


def values(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    """pool (or "" for an unlabelled series) -> value; empty before anything was observed."""
    data = reader.get_metrics_data()
    return {
        str(point.attributes.get("pool", "")): point.value
        for resource in (data.resource_metrics if data else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    }


async def test_a_memory_ledger_is_available_and_a_static_capacity_known(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    providers = Providers(MeterProvider([reader]), None, None)
    async with running(tmp_path, providers=providers):

        async def shown() -> bool:
            return values(reader, "kvguard_ledger_available") == {"": 1}

        await wait_until(shown, "kvguard_ledger_available 1")
        assert values(reader, "kvguard_capacity_known") == {"qwen": 1}
        assert values(reader, "kvguard_ledger_replicas") == {}  # not known: no series


async def test_an_unreachable_ledger_and_an_undiscovered_capacity_read_zero(
    tmp_path: Path,
) -> None:
    reader = InMemoryMetricReader()
    nothing = free_port()  # no Redis there, and no vLLM
    data = kvguard_config()
    data["ledger"] = {"url": f"redis://127.0.0.1:{nothing}/0", "on_unavailable": "allow"}
    data["pools"][0]["capacity"] = {
        "endpoints": [f"http://127.0.0.1:{nothing}"],
        "refresh_seconds": 10,
    }
    config = configs.load(write_config(tmp_path, data), environ={})
    service = Service(config, providers=Providers(MeterProvider([reader]), None, None))
    await service.start()
    try:

        async def shown() -> bool:
            return values(reader, "kvguard_ledger_available") == {"": 0}

        await wait_until(shown, "kvguard_ledger_available 0", timeout_s=10)
        assert values(reader, "kvguard_capacity_known") == {"qwen": 0}
    finally:
        await service.stop(0)
