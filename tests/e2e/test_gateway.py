"""End to end through the real Envoy: client -> Envoy (envoy/envoy.yaml) -> kvguard -> upstream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from kvguard.testing.wait import wait_until
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


async def zero(gw: Gateway) -> bool:
    return await gw.reserved() == 0


async def test_upstream_sees_clamped_limit_and_consistent_length(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        status, _, answer = await gw.post(
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 100000},
            x_kvguard_lease="spoofed-by-client",
        )
        assert status == 200, answer
        (seen,) = gw.upstream.requests
        assert seen.json()["max_tokens"] == 512  # the pro tier's cap
        assert int(seen.headers["content-length"]) == len(seen.body)
        assert seen.headers["x-kvguard-lease"] != "spoofed-by-client"
        assert int(seen.headers["x-kvguard-blocks"]) > 0
        assert answer["usage"]["prompt_tokens"] == int(seen.headers["x-kvguard-prompt-tokens"])
        await wait_until(lambda: zero(gw), "every lease to be released")


async def test_absent_limit_is_injected_with_the_tier_default(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        status, _, _ = await gw.post("/v1/chat/completions", CHAT, tenant="someone-free")
        assert status == 200
        status, _, _ = await gw.post(
            "/v1/completions?x=1", {"model": "qwen", "prompt": "Once upon"}, tenant="acme"
        )
        assert status == 200
        chat, completion = gw.upstream.requests
        assert chat.json()["max_tokens"] == 32  # free default
        assert completion.json()["max_tokens"] == 128  # pro default
        assert int(completion.headers["content-length"]) == len(completion.body)


async def test_flood_from_one_tenant_is_refused_while_another_gets_through(tmp_path: Path) -> None:
    # free tier: quota 40 blocks; each request holds 3 blocks while the upstream delays it.
    async with gateway(tmp_path, blocks=10000) as gw:
        flood = [
            asyncio.create_task(
                gw.post("/v1/chat/completions", CHAT, tenant="noisy", x_test_delay="2")
            )
            for _ in range(30)
        ]
        await gw.upstream.wait_for_requests(13, timeout=10)
        status, _, _ = await gw.post("/v1/chat/completions", CHAT, tenant="quiet")
        assert status == 200
        results = await asyncio.gather(*flood)
        statuses = [status for status, _, _ in results]
        assert statuses.count(200) == 13
        assert statuses.count(429) == 17
        for status, headers, body in results:
            if status == 429:
                assert headers["x-kvguard-reason"] == "tenant_block_quota_exceeded"
                assert body["error"]["code"] == "tenant_block_quota_exceeded"
                assert int(headers["retry-after"]) >= 1
        await wait_until(lambda: zero(gw), "every lease to be released")


async def test_pool_watermark_refuses_every_tenant(tmp_path: Path) -> None:
    # 20 blocks, watermark 0.5: 10 may be reserved, three requests of 3 blocks fit.
    async with gateway(tmp_path, blocks=20, watermark=0.5) as gw:
        held = [
            asyncio.create_task(
                gw.post("/v1/chat/completions", CHAT, tenant=f"t{i}", x_test_delay="2")
            )
            for i in range(3)
        ]
        await gw.upstream.wait_for_requests(3, timeout=10)
        status, headers, body = await gw.post("/v1/chat/completions", CHAT, tenant="late")
        assert (status, body["error"]["code"]) == (429, "kv_cache_watermark_exceeded")
        assert headers["x-kvguard-reason"] == "kv_cache_watermark_exceeded"
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200, 200]
        await wait_until(lambda: zero(gw), "every lease to be released")


async def test_ledger_returns_to_zero_however_the_exchange_ends(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        status, _, _ = await gw.post("/v1/chat/completions", CHAT)
        assert status == 200
        await wait_until(lambda: zero(gw), "every lease to be released")

        status, _, _ = await gw.post("/v1/chat/completions", CHAT, x_test_status="500")
        assert status == 500
        await wait_until(lambda: zero(gw), "every lease to be released")

        status, _, _ = await gw.post("/v1/chat/completions", CHAT, x_test_reset="1")
        assert status in (502, 503)
        await wait_until(lambda: zero(gw), "every lease to be released")

        # A stream that the upstream resets half way.
        async with gw.http.post(
            gw.url + "/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 50},
            headers={
                "x-tenant-id": "acme",
                "x-test-reset-after": "3",
                "x-test-token-delay": "0.01",
            },
        ) as response:
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        await wait_until(lambda: zero(gw), "every lease to be released")


async def test_client_cancelling_mid_stream_releases_the_lease(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        response = await gw.http.post(
            gw.url + "/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 500},
            headers={"x-tenant-id": "acme", "x-test-token-delay": "0.05"},
        )
        assert response.status == 200
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        assert await gw.reserved() > 0  # held while the stream runs
        response.close()  # the client goes away mid-stream
        await wait_until(lambda: zero(gw), "every lease to be released")
        await wait_until(lambda: _no_upstream_in_flight(gw), "the upstream to be idle")


async def _no_upstream_in_flight(gw: Gateway) -> bool:
    return gw.upstream.in_flight == 0


async def test_request_that_can_never_fit_and_malformed_bodies_get_400(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        status, headers, body = await gw.post(
            "/v1/chat/completions", {**CHAT, "max_tokens": 512, "n": 50}
        )
        assert (status, body["error"]["code"]) == (400, "request_exceeds_capacity")
        assert headers["content-type"] == "application/json"
        repeated = b'{"model": "qwen", "prompt": "hi", "max_tokens": 99999, "max_tokens": 5}'
        for raw in (b"{oops", b'{"model": "qwen"}', b'{"model": "qwen", "prompt": 5}', repeated):
            path = "/v1/completions"
            async with gw.http.post(
                gw.url + path,
                data=raw,
                headers={"x-tenant-id": "acme", "content-type": "application/json"},
            ) as response:
                error = await response.json(content_type=None)
                assert response.status == 400
                assert response.headers["x-kvguard-reason"] == "invalid_request"
                assert set(error["error"]) == {"message", "type", "param", "code"}
        assert gw.upstream.requests == []
        assert await gw.reserved() == 0


async def test_body_between_kvguard_and_envoy_limits_gets_kvguard_413(tmp_path: Path) -> None:
    async with gateway(tmp_path, max_body_bytes=4096) as gw:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 8000}]}
        status, headers, body = await gw.post("/v1/chat/completions", big)
        assert (status, body["error"]["code"]) == (413, "request_too_large")
        assert headers["x-kvguard-reason"] == "request_too_large"


async def test_read_only_paths_pass_untouched(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        raw = json.dumps({"model": "qwen", "prompt": "count me"}).encode()
        async with gw.http.post(
            gw.url + "/tokenize",
            data=raw,
            headers={"x-kvguard-blocks": "999", "content-type": "application/json"},
        ) as response:
            assert response.status == 200
        async with gw.http.get(gw.url + "/v1/models") as response:
            assert response.status == 200
        tokenize, models = gw.upstream.requests
        assert tokenize.body == raw
        assert "x-kvguard-blocks" not in tokenize.headers
        assert (models.method, models.path) == ("GET", "/v1/models")
        assert await gw.reserved() == 0


async def test_unknown_tenant_without_default_tier_gets_401(tmp_path: Path) -> None:
    async with gateway(tmp_path, default_tier=None) as gw:
        status, _headers, body = await gw.post("/v1/chat/completions", CHAT, tenant="stranger")
        assert (status, body["error"]["code"]) == (401, "unknown_tenant")
        assert gw.upstream.requests == []
