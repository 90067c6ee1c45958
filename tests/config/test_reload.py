"""Hot reload: the policy file is watched; a valid change applies to new requests, an invalid
one keeps the last good policy, is logged with file and key, and is counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvguard import config as configs
from kvguard.app import Service
from kvguard.config.reload import PolicyWatcher
from kvguard.ops.telemetry import Providers
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config
from tests.extproc.harness import body, exchange, headers

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}


def configmap_update(folder: Path, version: str, data: dict[str, Any]) -> None:
    """Write the file as the kubelet does: a new timestamped folder, then swap `..data`."""
    target = folder / version
    target.mkdir()
    (target / "kvguard.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    link = folder / "..data_tmp"
    link.symlink_to(version)
    os.replace(link, folder / "..data")


def reloads(reader: InMemoryMetricReader) -> dict[str, int]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        str(p.attributes["result"]): int(p.value)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "kvguard_config_reloads"
        for p in m.data.data_points
    }


async def test_configmap_swap_applies_and_a_bad_change_keeps_the_last_good_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = kvguard_config()
    configmap_update(tmp_path, "v1", data)
    path = tmp_path / "kvguard.yaml"
    path.symlink_to("..data/kvguard.yaml")
    reader = InMemoryMetricReader()
    service = Service(
        configs.load(path, environ={}),
        config_path=path,
        providers=Providers(MeterProvider([reader]), None, None),
        reload_interval_s=0.05,
    )
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    stub = pb_grpc.ExternalProcessorStub(channel)

    async def cap_seen() -> int:
        _, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        return int(json.loads(answer.request_body.response.body_mutation.body)["max_tokens"])

    try:
        assert await cap_seen() == 512
        caplog.set_level(logging.WARNING, logger="kvguard.app")
        data["tenancy"]["tiers"]["pro"]["max_tokens_cap"] = 1000
        data["tenancy"]["tiers"]["pro"]["max_blocks"] = 5000  # above the pool's limit: a warning
        configmap_update(tmp_path, "v2", data)

        async def new_cap() -> bool:
            return await cap_seen() == 1000

        await wait_until(new_cap, "the new max_tokens_cap to apply")
        assert reloads(reader) == {"applied": 1, "rejected": 0}  # both exported from the start
        # A reload warns of what can never admit, as check-config and serve's start do.
        assert f"{path}: tenancy.tiers.pro.max_blocks: 5000 is not below any pool's limit" in (
            caplog.text
        )

        caplog.set_level(logging.ERROR, logger="kvguard.config.reload")
        data["tenancy"]["tiers"]["pro"]["max_tokens_cap"] = -1
        configmap_update(tmp_path, "v3", data)

        async def rejected() -> bool:
            return reloads(reader).get("rejected", 0) == 1

        await wait_until(rejected, "the bad change to be rejected")
        assert await cap_seen() == 1000  # the last good policy still answers
        assert f"{path}: tenancy.tiers.pro.max_tokens_cap: Input should be greater than 0" in (
            caplog.text
        )
        assert service.health.ready
    finally:
        await channel.close()
        await service.stop(0)


async def test_a_change_whose_load_raises_anything_is_rejected_and_watching_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text("v1")
    published: list[str] = []
    results: list[bool] = []

    def load(changed: Path) -> str:
        text = changed.read_text()
        if text == "v2, a file the loader chokes on":
            raise RecursionError("maximum recursion depth exceeded")  # not a ConfigError
        return text

    watcher = PolicyWatcher(path, load, published.append, results.append, interval_s=0.01)
    caplog.set_level(logging.ERROR, logger="kvguard.config.reload")
    task = asyncio.create_task(watcher.run())
    try:
        path.write_text("v2, a file the loader chokes on")

        async def rejected() -> bool:
            assert not task.done(), "the watcher ended"
            return results == [False]

        await wait_until(rejected, "the bad change to be rejected")
        assert published == []
        assert f"{path}: RecursionError: maximum recursion depth exceeded" in caplog.text
        path.write_text("v3, a good one")

        async def applied() -> bool:
            return results == [False, True]

        await wait_until(applied, "the good change to be applied")
        assert published == ["v3, a good one"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
