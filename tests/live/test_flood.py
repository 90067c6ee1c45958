"""The central claim on the real engine: a multi-tenant overload preempts a bare vLLM, and the
same overload through Envoy + kvguard (capacity discovered from vLLM's /metrics) does not.

The overload (tests/live/harness.py, Flood): a noisy tenant sends 8 chat requests of ~1240
prompt + 1000 output tokens (18 blocks of 128 each) and a quiet tenant 5 of ~340 + 150
(4 blocks), all at once, outputs forced to full length (ignore_eos, min_tokens). That is
8 x 18 + 5 x 4 = 164 blocks against vLLM's 63.

Through kvguard (admits up to 53 blocks: 63 x (1 - 0.15)): the noisy tenant's tier holds 36
blocks (2 requests), so 6 of its 8 get 429 tenant_block_quota_exceeded; the quiet tenant's
burst then fits 4 of 5 into the 17 blocks left (the fifth: 429 kv_cache_watermark_exceeded),
and keeps being admitted, wave after wave, while the noisy tenant's retries are refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvguard.admission.capacity import PoolCapacity
from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.live.harness import (
    Flood,
    Result,
    gateway,
    long_chat,
    post,
    preemptions,
    wait_idle,
)

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

NOISY_QUOTA = 36  # two noisy requests of 18 blocks
TENANCY = {
    "header": "x-tenant-id",
    "default_tier": None,
    "tiers": {
        "free": {"max_tokens_cap": 1024, "default_max_tokens": 64, "max_blocks": NOISY_QUOTA},
        "pro": {"max_tokens_cap": 1024, "default_max_tokens": 64, "max_blocks": 53},
    },
    "tenants": {"noisy": "free", "quiet": "pro"},
}
CHAT = "/v1/chat/completions"


def full_output(result: Result, tokens: int) -> bool:
    body = result.body
    return (
        result.status == 200
        and body["usage"]["completion_tokens"] == tokens
        and all(c["finish_reason"] == "length" for c in body["choices"])
    )


@dataclass
class Direct:
    results: list[Result]
    preemptions: float


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def direct(vllm: VllmProcess) -> Direct:
    """The flood sent straight to vLLM."""
    flood = Flood()
    await wait_idle(vllm)
    before = await preemptions(vllm)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        url = vllm.url + CHAT
        results = await asyncio.gather(
            *(post(http, url, flood.noisy(i), "noisy") for i in range(flood.noisy_requests)),
            *(post(http, url, flood.quiet(i), "quiet") for i in range(flood.quiet_requests)),
        )
    return Direct(list(results), await preemptions(vllm) - before)


async def test_straight_to_vllm_the_flood_preempts(direct: Direct) -> None:
    flood = Flood()
    assert direct.preemptions > 0
    # vLLM refuses nothing: every request eventually completes, after recomputation.
    noisy = [r for r in direct.results if r.tenant == "noisy"]
    quiet = [r for r in direct.results if r.tenant == "quiet"]
    assert all(full_output(r, flood.noisy_output) for r in noisy)
    assert all(full_output(r, flood.quiet_output) for r in quiet)


@dataclass
class Guarded:
    gw_capacity: PoolCapacity | None = None
    first_refusals: list[Result] = field(default_factory=list)
    noisy_admitted: list[Result] = field(default_factory=list)
    quiet_waves: list[list[Result]] = field(default_factory=list)
    # Each retry of the noisy tenant, with the blocks it held in the ledger just before.
    noisy_retries: list[tuple[int, Result]] = field(default_factory=list)
    noisy_blocks: list[int] = field(default_factory=list)
    proxied_tenants: list[str] = field(default_factory=list)
    reserved_after: int = -1
    reserved_before_waves: list[int] = field(default_factory=list)
    preemptions: float = -1


def retry(seed: int) -> dict[str, Any]:
    """A noisy retry: a short prompt asking for the same long output (8 blocks): over the quota
    while the two long requests run, within it once one has finished."""
    return long_chat("noisy", seed, 40, Flood().noisy_output)


async def decided(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> asyncio.Task[Result]:
    """Send a noisy retry; return its task once kvguard has decided (a quick 429, or admitted
    and running upstream)."""
    task = asyncio.create_task(post(http, url, body, "noisy"))
    done, _ = await asyncio.wait({task}, timeout=1.0)  # a refusal comes back in milliseconds
    del done
    return task


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def guarded(vllm: VllmProcess, tmp_path_factory: pytest.TempPathFactory) -> Guarded:
    """The flood sent through Envoy + kvguard; what happened, step by step."""
    flood = Flood()
    out = Guarded()
    await wait_idle(vllm)
    before = await preemptions(vllm)
    timeout = aiohttp.ClientTimeout(total=600)
    workdir = tmp_path_factory.mktemp("guarded")
    async with (
        gateway(workdir, vllm, TENANCY) as gw,
        aiohttp.ClientSession(timeout=timeout) as http,
    ):
        out.gw_capacity = await gw.capacity()
        url = gw.url + CHAT
        noisy = [
            asyncio.create_task(post(http, url, flood.noisy(i), "noisy"))
            for i in range(flood.noisy_requests)
        ]

        async def noisy_settled() -> bool:
            refused = sum(t.done() for t in noisy)
            reached = sum(r.headers.get("x-tenant-id") == "noisy" for r in gw.proxy.requests)
            return refused == flood.noisy_requests - 2 and reached == 2

        await wait_until(
            noisy_settled,
            "2 noisy requests upstream, the rest answered",
            timeout_s=60,
            poll_s=0.05,
        )
        out.first_refusals = [t.result() for t in noisy if t.done()]
        out.noisy_blocks = [
            int(r.headers["x-kvguard-blocks"])
            for r in gw.proxy.requests
            if r.headers.get("x-tenant-id") == "noisy"
        ]

        retries = []
        for wave, size in enumerate((flood.quiet_requests, 4, 4)):
            # The noisy tenant retries while its two requests run (not awaited: an admitted
            # retry runs as long as the originals and must not hold the waves back).
            held = await gw.tenant_blocks("noisy")
            retries.append((held, await decided(http, url, retry(100 + wave))))
            out.reserved_before_waves.append(await gw.reserved())
            quiet = [flood.quiet(10 * wave + i) for i in range(size)]
            out.quiet_waves.append(
                list(await asyncio.gather(*(post(http, url, q, "quiet") for q in quiet)))
            )

            async def quiet_released() -> bool:
                # The quiet tenant's leases only: the noisy ones may end any time now.
                return await gw.tenant_blocks("quiet") == 0

            await wait_until(
                quiet_released, "the quiet wave's leases released", timeout_s=10, poll_s=0.05
            )
        held = await gw.tenant_blocks("noisy")
        retries.append((held, await decided(http, url, retry(200))))
        out.noisy_retries = [(held, await task) for held, task in retries]

        out.noisy_admitted = [r for r in await asyncio.gather(*noisy) if r.status == 200]
        out.proxied_tenants = [r.headers.get("x-tenant-id", "") for r in gw.proxy.requests]

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the ledger back at zero", timeout_s=10, poll_s=0.05)
        out.reserved_after = await gw.reserved()
    out.preemptions = await preemptions(vllm) - before
    return out


async def test_capacity_is_discovered_from_vllm_metrics(guarded: Guarded) -> None:
    assert guarded.gw_capacity == PoolCapacity(63, 128)


async def test_through_kvguard_vllm_never_preempts(guarded: Guarded) -> None:
    assert guarded.preemptions == 0


async def test_every_admitted_request_completes_with_its_full_output(guarded: Guarded) -> None:
    flood = Flood()
    assert len(guarded.noisy_admitted) == 2
    assert guarded.noisy_blocks == [18, 18]
    assert all(full_output(r, flood.noisy_output) for r in guarded.noisy_admitted)
    admitted_quiet = [r for wave in guarded.quiet_waves for r in wave if r.status == 200]
    assert all(full_output(r, flood.quiet_output) for r in admitted_quiet)
    retried = [r for _, r in guarded.noisy_retries if r.status == 200]
    assert all(full_output(r, flood.noisy_output) for r in retried)
    # Only admitted requests reached vLLM.
    assert guarded.proxied_tenants.count("noisy") == 2 + len(retried)
    assert guarded.proxied_tenants.count("quiet") == len(admitted_quiet)


def _refused_with(result: Result, code: str) -> bool:
    return (
        result.status == 429
        and result.code == code
        and result.headers.get("x-kvguard-reason") == code
        and int(result.headers.get("retry-after", "0")) >= 1
    )


async def test_refusals_carry_the_right_code(guarded: Guarded) -> None:
    assert len(guarded.first_refusals) == 6
    assert all(_refused_with(r, "tenant_block_quota_exceeded") for r in guarded.first_refusals)
    first_wave = guarded.quiet_waves[0]
    refused = [r for r in first_wave if r.status != 200]
    assert len(refused) <= 1  # 5 x 4 blocks beside the noisy 36: one past the limit of 53
    assert all(_refused_with(r, "kv_cache_watermark_exceeded") for r in refused)


async def test_quiet_tenant_is_admitted_while_the_noisy_one_is_refused(guarded: Guarded) -> None:
    # A noisy retry came before each quiet wave (and one after the last). The first finds both
    # long requests running and is refused for the noisy tenant's own quota; later ones may find
    # one finished (on a fast machine) and be admitted; every refusal names the quota.
    assert len(guarded.noisy_retries) == 4
    first_held, first = guarded.noisy_retries[0]
    assert first_held == sum(guarded.noisy_blocks) == NOISY_QUOTA
    assert _refused_with(first, "tenant_block_quota_exceeded")
    for _, result in guarded.noisy_retries:
        assert result.status == 200 or _refused_with(result, "tenant_block_quota_exceeded")
    # Every quiet wave got in while the noisy tenant was held to its quota; what it could not
    # fit was refused for capacity, never left to vLLM.
    capacity_codes = ("kv_cache_watermark_exceeded", "tenant_block_quota_exceeded")
    for wave in guarded.quiet_waves:
        assert sum(r.status == 200 for r in wave) >= 1
        for result in wave:
            assert result.status == 200 or any(_refused_with(result, c) for c in capacity_codes)


async def test_the_ledger_ends_at_zero(guarded: Guarded) -> None:
    assert guarded.reserved_after == 0
