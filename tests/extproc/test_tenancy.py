"""Tenancy fails closed: a configuration without `default_tier` refuses unknown tenants with 401
unknown_tenant, whatever its tiers are called (a tier named `free` included)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.app import Service
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers, refusal, set_headers

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
OWN_TIERS = {
    "bulk": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 400},
    "lite": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 40},
}
FREE_AND_PRO = {
    "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 40},
    "pro": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 400},
}


@asynccontextmanager
async def without_default_tier(tmp_path: Path, tiers: dict[str, Any]) -> AsyncIterator[Any]:
    """A Service whose file has no `default_tier` key at all (acme is mapped to the first
    tier), and an ext_proc stub on it."""
    data = kvguard_config(tiers=tiers, tenants={"acme": next(iter(tiers))})
    del data["tenancy"]["default_tier"]
    service = Service(configs.load(write_config(tmp_path, data), environ={}))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await service.stop(0)


@pytest.mark.parametrize("tiers", [OWN_TIERS, FREE_AND_PRO], ids=["own_tiers", "free_and_pro"])
async def test_without_default_tier_unknown_tenants_get_401(
    tmp_path: Path, tiers: dict[str, Any]
) -> None:
    async with without_default_tier(tmp_path, tiers) as stub:
        for tenant in ("stranger", None):
            _, (answer,) = await exchange(stub, headers("/v1/chat/completions", tenant=tenant))
            status, _, error = refusal(answer)
            assert (status, error["error"]["code"]) == (401, "unknown_tenant")
        # A mapped tenant is admitted on its tier (its default injected).
        _, (_, on_body) = await exchange(
            stub, headers("/v1/chat/completions", tenant="acme"), body(CHAT)
        )
        admitted = on_body.request_body.response
        assert "x-kvguard-lease" in set_headers(admitted)
        sent = json.loads(admitted.body_mutation.body)
        assert sent["max_tokens"] == next(iter(tiers.values()))["default_max_tokens"]
