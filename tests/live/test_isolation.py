"""Tenant isolation on the real engine (issue 31's quiet-tenant flood), with kvguard's default
configuration and with promises on (`retry_after_max_seconds: 30`, the case the issue saw fail):
one tenant's refused requests never cost another tenant a request that fits.

vLLM with 48 blocks of 128 (47 usable; kvguard may reserve 39 with the 0.15 watermark). Two
noisy tenants, each with a quota of 24 blocks, send 12-block requests that run to their limit,
three at once each, and retry their 429s as the OpenAI SDK does (retry-after-ms, 2 retries):
together they can hold 36 blocks at most (a third 12-block lease never fits beside two), and
with promises on, the requests refused meanwhile are promised their retries. A quiet tenant
(quota 4) sends one 2-3-block request at a time: it fits beside the noisy leases every time,
and must be served every time, whatever was promised to the noisy tenants. vLLM never
preempts, and the ledger ends at 0.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvguard.sim.load import sdk_retry_delay
from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.live.harness import Result, gateway, long_chat, post, preemptions, vllm_env, wait_idle

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

BLOCKS = 48  # --num-gpu-blocks-override: 47 usable blocks of 128
NOISY_QUOTA, QUIET_QUOTA = 24, 4
TENANCY = {
    "header": "x-tenant-id",
    "default_tier": None,
    "tiers": {
        "noisy": {"max_tokens_cap": 2048, "default_max_tokens": 64, "max_blocks": NOISY_QUOTA},
        "quiet": {"max_tokens_cap": 2048, "default_max_tokens": 64, "max_blocks": QUIET_QUOTA},
    },
    "tenants": {"noisy-a": "noisy", "noisy-b": "noisy", "quiet": "quiet"},
}
CHAT = "/v1/chat/completions"
NOISY_AT_ONCE = 3  # each noisy tenant's requests, sent together
SDK_RETRIES = 2  # the OpenAI SDK's default max_retries
QUIET_REQUESTS = 6
# The pool's settings of each run: the defaults, and promises on.
SETTINGS = {"default": {}, "promises": {"retry_after_max_seconds": 30}}


def noisy(tenant: str, i: int) -> dict[str, Any]:
    """~340 prompt tokens + 1 100 output tokens: 12 blocks of 128."""
    return long_chat(tenant, 3000 + 100 * ord(tenant[-1]) + i, 300, 1100)


def quiet(i: int) -> dict[str, Any]:
    """2 or 3 blocks: ~60 or ~110 prompt tokens + 150 or 200 output tokens."""
    return long_chat("quiet", 4000 + i, 40 if i % 2 else 80, 150 if i % 2 else 200)


@dataclass
class Flood:
    settings: str
    noisy_attempts: list[Result] = field(default_factory=list)  # every attempt, retries too
    quiet: list[Result] = field(default_factory=list)
    noisy_blocks: set[int] = field(default_factory=set)
    quiet_blocks: set[int] = field(default_factory=set)
    reserved_after: int = -1
    preemptions: float = -1


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_vllm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = vllm_env()
    async with VllmProcess(
        env.python, env.model, tmp_path_factory.mktemp("vllm48"), blocks=BLOCKS
    ) as server:
        yield server


async def sdk_client(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], tenant: str, out: list[Result]
) -> None:
    """One request as the OpenAI SDK sends it: its 429s retried after retry-after-ms."""
    rng = random.Random(tenant)
    for retries in range(SDK_RETRIES + 1):
        result = await post(http, url, body, tenant)
        out.append(result)
        delay = sdk_retry_delay(result.status, result.headers, retries, rng)
        if delay is None or retries == SDK_RETRIES:
            return
        await asyncio.sleep(delay)  # the client's own retry timer


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=list(SETTINGS))
async def flood(
    request: pytest.FixtureRequest,
    small_vllm: VllmProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Flood:
    out = Flood(request.param)
    await wait_idle(small_vllm)
    before = await preemptions(small_vllm)
    workdir: Path = tmp_path_factory.mktemp("isolation")
    timeout = aiohttp.ClientTimeout(total=900)
    async with (
        gateway(workdir, small_vllm, TENANCY, pool=SETTINGS[out.settings]) as gw,
        aiohttp.ClientSession(timeout=timeout) as http,
    ):
        url = gw.url + CHAT
        clients = [
            asyncio.create_task(sdk_client(http, url, noisy(tenant, i), tenant, out.noisy_attempts))
            for i in range(NOISY_AT_ONCE)
            for tenant in ("noisy-a", "noisy-b")
        ]

        async def noisy_running() -> bool:
            # Both noisy tenants' first leases in vLLM, the rest answered (and promised).
            held = (await gw.usage()).reserved_blocks_by_tenant
            return bool(held.get("noisy-a", 0) + held.get("noisy-b", 0) == 36)

        await wait_until(noisy_running, "36 noisy blocks reserved", timeout_s=60, poll_s=0.05)
        for i in range(QUIET_REQUESTS):
            out.quiet.append(await post(http, url, quiet(i), "quiet"))
        await asyncio.gather(*clients)
        out.noisy_blocks = {
            int(r.headers["x-kvguard-blocks"])
            for r in gw.proxy.requests
            if r.headers.get("x-tenant-id", "").startswith("noisy")
        }
        out.quiet_blocks = {
            int(r.headers["x-kvguard-blocks"])
            for r in gw.proxy.requests
            if r.headers.get("x-tenant-id") == "quiet"
        }

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the ledger back at zero", timeout_s=30, poll_s=0.05)
        out.reserved_after = await gw.reserved()
    out.preemptions = await preemptions(small_vllm) - before
    return out


async def test_the_requests_are_the_sizes_of_the_scenario(flood: Flood) -> None:
    assert flood.noisy_blocks == {12}
    assert flood.quiet_blocks == {2, 3}


async def test_the_quiet_tenant_is_served_every_time(flood: Flood) -> None:
    assert [r.status for r in flood.quiet] == [200] * QUIET_REQUESTS
    if flood.settings != "promises":
        return
    # ...while promises made to the noisy tenants' refused requests were outstanding: each
    # quiet request sent after a promise was made and before its time.
    promises = [
        (r.ended, r.ended + int(r.headers["retry-after-ms"]) / 1000)
        for r in flood.noisy_attempts
        if r.status == 429 and "x-kvguard-retry-token" in r.headers
    ]
    beside = [q for q in flood.quiet if any(made < q.started < due for made, due in promises)]
    assert beside


async def test_the_noisy_tenants_are_refused_for_their_quota_and_the_pool(flood: Flood) -> None:
    refused = [r for r in flood.noisy_attempts if r.status == 429]
    codes = {r.code for r in refused}
    assert len(refused) >= 2 * NOISY_AT_ONCE - 3  # at most 3 noisy leases fit at once
    assert codes <= {"tenant_block_quota_exceeded", "kv_cache_watermark_exceeded"}
    assert all(r.status in (200, 429) for r in flood.noisy_attempts)


async def test_vllm_never_preempts(flood: Flood) -> None:
    assert flood.preemptions == 0


async def test_the_ledger_ends_at_zero(flood: Flood) -> None:
    assert flood.reserved_after == 0
