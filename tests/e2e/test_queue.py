"""The short queue before a 429, through the shipped envoy/envoy.yaml on the memory ledger:
queued requests are admitted as blocks free, the tenant this process holds fewer blocks for
first and first in, first out within a tenant; a wait that ends gives the 429 with its promise,
Envoy holding the message that long; a client gone while queued reserves nothing; a full queue
refuses at once."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.admission.promises import JITTER_S
from kvguard.ledger import Claim, Lease
from kvguard.testing.upstream import RecordedRequest
from kvguard.testing.wait import wait_until
from tests.gateway import Gateway, gateway

pytestmark = pytest.mark.integration

# A pool whose blocks hold a whole context (4096 tokens): every request here needs one block.
ONE_BLOCK_EACH: dict[str, Any] = {"block_size": 4096, "watermark": 0.0}
LONG_WAIT_S = 20.0  # a queue wait no test here reaches
# What the upstream waits before answering a request that must stay in flight (its lease
# held) until the test cancels it: longer than any test here.
IN_FLIGHT = {"x_test_delay": "60"}
# When the fillers' leases are expected to end: what the 429s' times are told from.
FILLER_ENDS_S = 4.0


def queue(max_wait_seconds: float, max_queued: int = 1000) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["pools"][0]["queue"] = {
            "max_wait_seconds": max_wait_seconds,
            "max_queued": max_queued,
        }

    return edit


def chat(label: str) -> dict[str, Any]:
    """A one-block chat request the upstream tells apart by its message."""
    return {"model": "qwen", "messages": [{"role": "user", "content": label}]}


def label(request: RecordedRequest) -> str:
    content: str = request.json()["messages"][0]["content"]
    return content


async def fill(gw: Gateway, blocks: int) -> list[Lease]:
    """Reserve `blocks` of pool qwen, one lease each, directly in the ledger (no stream of this
    process holds them): the leases, to free one at a time."""
    leases = []
    for _ in range(blocks):
        claim = Claim(
            uuid.uuid4().hex, "qwen", "filler", 1, 10**6, 10**6, 60, ends_in_s=FILLER_ENDS_S
        )
        lease = (await gw.service.ledger.reserve(claim)).lease
        assert lease is not None
        leases.append(lease)
    return leases


async def free(gw: Gateway, lease: Lease) -> None:
    """Release a lease held directly in the ledger and wake the pool's queue, as the keeper's
    release does."""
    await gw.service.ledger.release(lease)
    gw.service.queue.notify("qwen")


async def queued(gw: Gateway, n: int) -> None:
    def waiting() -> bool:
        return gw.service.queue.queued("qwen") == n

    await wait_until(waiting, lambda: f"{n} queued, not {gw.service.queue.queued('qwen')}")


EXTENDED = "http.gateway.ext_proc.override_message_timeout_received"


async def extended(gw: Gateway, n: int) -> None:
    """Wait until kvguard has asked Envoy for more time for `n` messages in all."""

    async def asked() -> bool:
        return (await gw.envoy.stats(EXTENDED)).get(EXTENDED, 0) >= n

    await wait_until(asked, f"{n} messages given more time")


def send(gw: Gateway, name: str, tenant: str, **headers: str) -> asyncio.Task[Any]:
    return asyncio.create_task(gw.post("/v1/chat/completions", chat(name), tenant, **headers))


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cut the clients of requests still in flight: their leases are released."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_queued_requests_are_admitted_in_fairness_order(tmp_path: Path) -> None:
    """acme holds one block through a stream in flight; acme-1, acme-2, globex-1 and globex-2
    queue in that order on a full pool, then blocks free one at a time. globex (none held)
    goes first; then both hold one and acme-1, first in, goes; then globex holds fewer."""
    async with gateway(tmp_path, queue(LONG_WAIT_S), blocks=5, **ONE_BLOCK_EACH) as gw:
        in_flight = [send(gw, "acme-streaming", "acme", **IN_FLIGHT)]
        try:
            await gw.upstream.wait_for_requests(1)
            fillers = await fill(gw, 4)
            waiting = [("acme-1", "acme"), ("acme-2", "acme"), ("globex-1", "globex")]
            waiting.append(("globex-2", "globex"))
            for n, (name, tenant) in enumerate(waiting, 1):
                in_flight.append(send(gw, name, tenant, **IN_FLIGHT))
                await queued(gw, n)  # each one queued before the next: their order is known
            assert len(gw.upstream.requests) == 1
            for admitted, filler in enumerate(fillers, 2):
                await free(gw, filler)
                await gw.upstream.wait_for_requests(admitted)
                await queued(gw, len(waiting) + 1 - admitted)  # one block: one admitted
            order = [label(request) for request in gw.upstream.requests]
            held = [gw.service.keeper.held_blocks("qwen", t) for t in ("acme", "globex")]
            assert not any(task.done() for task in in_flight)
        finally:
            await cancel(in_flight)
    assert order == ["acme-streaming", "globex-1", "acme-1", "globex-2", "acme-2"]
    assert held == [3, 2]


async def test_a_wait_past_max_wait_ends_in_a_promised_429(tmp_path: Path) -> None:
    """The wait outlasts Envoy's 200 ms message timeout: kvguard's extension covers it."""
    max_wait_s = 1.5
    async with gateway(tmp_path, queue(max_wait_s), blocks=1, **ONE_BLOCK_EACH) as gw:
        filled = time.monotonic()
        await fill(gw, 1)
        started = time.monotonic()
        status, headers, body = await gw.post("/v1/chat/completions", chat("late"), "acme")
        answered = time.monotonic()
        elapsed = answered - started
        usage = await gw.service.ledger.usage("qwen")
        stats = await gw.envoy.stats(r"ext_proc\.")
    assert (status, headers["x-kvguard-reason"]) == (429, "kv_cache_watermark_exceeded")
    assert body["error"]["code"] == "kv_cache_watermark_exceeded"
    assert max_wait_s <= elapsed < max_wait_s + 10
    # The promise of the last try: when the filler's lease is expected to end, plus jitter.
    milliseconds = int(headers["retry-after-ms"])
    soonest, latest = FILLER_ENDS_S - (answered - filled), FILLER_ENDS_S - (started - filled)
    assert 1000 * soonest - 1 <= milliseconds <= 1000 * (latest + JITTER_S) + 1
    assert headers["retry-after"] == str(math.ceil(milliseconds / 1000))
    assert headers["x-should-retry"] == "true"
    assert (usage.reserved, usage.promises, usage.promised) == (1, 1, 1)
    assert stats.get(EXTENDED) == 1
    for unused in ("message_timeouts", "override_message_timeout_ignored"):  # used ones only
        assert f"http.gateway.ext_proc.{unused}" not in stats
    assert gw.upstream.requests == []


async def test_a_client_gone_while_queued_reserves_nothing(tmp_path: Path) -> None:
    """The request queued after it takes the block that frees; the ledger then holds only the
    filler."""
    async with gateway(tmp_path, queue(LONG_WAIT_S), blocks=2, **ONE_BLOCK_EACH) as gw:
        fillers = await fill(gw, 2)
        gone = send(gw, "gone", "acme")
        await queued(gw, 1)
        await extended(gw, 1)  # its wait under way, Envoy asked to hold it
        await cancel([gone])
        await queued(gw, 0)
        after = send(gw, "next", "globex")
        await queued(gw, 1)
        await extended(gw, 2)
        await free(gw, fillers[0])
        status, _, _ = await asyncio.wait_for(after, LONG_WAIT_S)

        async def only_the_filler() -> bool:
            return (await gw.service.ledger.usage("qwen")).reserved == 1

        await wait_until(only_the_filler, "the next request's lease released")
        leases = await gw.service.ledger.leases("qwen")
        usage = await gw.service.ledger.usage("qwen")
    assert status == 200
    assert [held.lease for held in leases] == [fillers[1]]
    assert (usage.promises, usage.promised) == (0, 0)
    assert [label(request) for request in gw.upstream.requests] == ["next"]


async def test_a_full_queue_refuses_at_once(tmp_path: Path) -> None:
    """With one request waiting in a queue of one, the next is refused at once, told when to
    retry with nothing held (a promise would go before the one waiting), while the first
    still waits."""
    edit = queue(LONG_WAIT_S, max_queued=1)
    async with gateway(tmp_path, edit, blocks=1, **ONE_BLOCK_EACH) as gw:
        filled = time.monotonic()
        await fill(gw, 1)
        first = send(gw, "first", "acme")
        try:
            await queued(gw, 1)
            started = time.monotonic()
            status, headers, _ = await gw.post("/v1/chat/completions", chat("second"), "globex")
            answered = time.monotonic()
            elapsed = answered - started
            still_waiting = gw.service.queue.queued("qwen"), first.done()
            usage = await gw.service.ledger.usage("qwen")
        finally:
            await cancel([first])
    assert (status, headers["x-kvguard-reason"]) == (429, "kv_cache_watermark_exceeded")
    milliseconds = int(headers["retry-after-ms"])
    soonest, latest = FILLER_ENDS_S - (answered - filled), FILLER_ENDS_S - (started - filled)
    assert 1000 * soonest - 1 <= milliseconds <= 1000 * (latest + JITTER_S) + 1
    assert elapsed < LONG_WAIT_S
    assert still_waiting == (1, False)
    assert "x-kvguard-retry-token" not in headers
    assert (usage.reserved, usage.promises) == (1, 0)  # the filler's, and nothing promised
    assert gw.upstream.requests == []
