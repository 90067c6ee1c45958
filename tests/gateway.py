"""kvguard behind a real Envoy started from envoy/envoy.yaml, in front of a recording upstream,
with kvguard as its ext_proc service in this process (so that tests read the ledger directly)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvguard import config as configs
from kvguard.app import Service
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordingUpstream
from tests.conftest import kvguard_config, write_config


@dataclass
class Gateway:
    envoy: EnvoyProcess
    service: Service
    upstream: RecordingUpstream
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.envoy.url

    async def reserved(self, pool: str = "qwen") -> int:
        return (await self.service.ledger.usage(pool)).reserved

    async def post(
        self, path: str, payload: Any, tenant: str | None = "acme", **headers: str
    ) -> tuple[int, dict[str, str], Any]:
        hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
        if tenant is not None:
            hdrs["x-tenant-id"] = tenant
        async with self.http.post(self.url + path, json=payload, headers=hdrs) as response:
            body = await response.read()
            try:
                parsed: Any = await response.json(content_type=None)
            except ValueError:
                parsed = body
            return response.status, {k.lower(): v for k, v in response.headers.items()}, parsed


@asynccontextmanager
async def gateway(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None = None, **config: Any
) -> AsyncIterator[Gateway]:
    """kvguard_config(**config), changed in place by `edit` when given, behind the real Envoy."""
    data = kvguard_config(**config)
    if edit is not None:
        edit(data)
    path = write_config(tmp_path, data)
    service = Service(configs.load(path, environ={}))
    await service.start()
    upstream = RecordingUpstream()
    await upstream.start()
    rendered = loopback_config(service.grpc.port, upstream.port)
    envoy = EnvoyProcess(rendered, tmp_path)
    try:
        await envoy.start()
        await envoy.wait_cluster_healthy("kvguard")
        async with aiohttp.ClientSession() as http:
            yield Gateway(envoy, service, upstream, http)
    finally:
        await envoy.stop()
        await upstream.stop()
        await service.stop(0)
        await service.keeper.settle()
