"""Bodies up to server.max_body_bytes through the real Envoy (envoy/envoy.yaml): each one is
admitted or refused with a code from docs/design.md's status table, in good time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvguard.testing.wait import wait_until
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
MAX_BODY = 6 * MIB
PROSE = "the quick brown fox jumps over the lazy dog while the gateway decides "


def sized(chat: dict[str, Any], field: list[Any], size: int) -> bytes:
    """`chat` as exactly `size` bytes of JSON, padded with prose at `field` (a path)."""
    *parents, last = field
    holder = chat
    for key in parents:
        holder = holder[key]
    holder[last] = ""
    pad = size - len(json.dumps(chat).encode())
    holder[last] = (PROSE * (pad // len(PROSE) + 1))[:pad]
    raw = json.dumps(chat).encode()
    assert len(raw) == size
    return raw


def padded_chat(size: int) -> bytes:
    """A valid chat whose bulk is a field vLLM and kvguard ignore (`user`)."""
    chat = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello."}]}
    return sized(chat, ["user"], size)


def long_prompt(size: int) -> bytes:
    chat = {"model": "qwen", "messages": [{"role": "user", "content": ""}]}
    return sized(chat, ["messages", 0, "content"], size)


async def post(gw: Gateway, raw: bytes) -> tuple[int, str | None]:
    async with gw.http.post(
        gw.url + "/v1/chat/completions",
        data=raw,
        headers={"x-tenant-id": "acme", "content-type": "application/json"},
    ) as response:
        await response.read()
        return response.status, response.headers.get("x-kvguard-reason")


async def test_bodies_near_the_limit_are_admitted_or_refused_from_the_table(
    tmp_path: Path,
) -> None:
    """The issue's two bodies: a 4 MiB + 1 KiB chat padded in an ignored field, sent while a
    prompt 1 KiB under max_body_bytes is being decided. That prompt used to be tokenized
    whole (~5 s here, Envoy's max_message_timeout), and the padded body meanwhile got 503
    internal_error as 'busy counting'; now counting stops once the prompt passes
    max_model_len."""
    async with gateway(tmp_path, max_body_bytes=MAX_BODY) as gw:
        first = asyncio.create_task(post(gw, long_prompt(MAX_BODY - 1024)))

        async def counting_or_done() -> bool:
            return first.done() or gw.service.counter.pending_bytes > 0

        await wait_until(counting_or_done, "the first body to be counted", timeout_s=30)
        assert await post(gw, padded_chat(4 * MIB + 1024)) == (200, None)
        assert await first == (400, "context_length_exceeded")
        # One after the other, too, and the padded body at the limit itself.
        assert await post(gw, long_prompt(MAX_BODY)) == (400, "context_length_exceeded")
        assert await post(gw, padded_chat(MAX_BODY)) == (200, None)
        assert await post(gw, padded_chat(MAX_BODY + 1)) == (413, "request_too_large")
        assert len(gw.upstream.requests) == 2
