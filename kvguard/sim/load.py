"""A load generator for OpenAI-compatible servers: planned arrivals, measured answers.

Used by `kvguard demo` and bench/bench_sim_fidelity.py. Each planned request is sent at its
offset from the start (a schedule, not a synchronisation), and its answer is timed: the first
streamed token, the end, the status and kvguard's refusal reason. A refused request may be
retried as the OpenAI SDK does (`sdk_retry_delay`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Planned:
    at_s: float  # offset from the start of the run
    tenant: str
    path: str  # /v1/chat/completions or /v1/completions
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Answer:
    planned: Planned
    index: int
    status: int = 0
    reason: str = ""  # x-kvguard-reason, or the error's code
    sent_at: float = 0.0  # seconds from the start of the run
    first_token_at: float | None = None
    done_at: float = 0.0
    completion_tokens: int | None = None
    error: str | None = None  # a transport failure
    attempts: int = 1  # sends, retries included

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def latency_s(self) -> float:
        return self.done_at - self.sent_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


async def send_all(
    base_url: str,
    plan: list[Planned],
    *,
    tenant_header: str = "x-tenant-id",
    on_done: Callable[[Answer], None] | None = None,
    timeout_s: float = 600.0,
    retries: int = 0,
) -> list[Answer]:
    """Send every planned request at its time, retrying up to `retries` times as the OpenAI
    SDK does (`sdk_retry_delay`); returns the answers (the last attempt's) in plan order."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    rng = random.Random(0)  # the backoff's jitter, when an answer says nothing of when
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # no client-side queueing: arrivals are the plan

    async def one(session: aiohttp.ClientSession, index: int, planned: Planned) -> Answer:
        await asyncio.sleep(max(0.0, start + planned.at_s - loop.time()))
        answer = Answer(planned, index, sent_at=loop.time() - start)
        headers = {tenant_header: planned.tenant, **planned.headers}
        while True:
            answer.reason = ""
            headers_seen: Mapping[str, str] = {}
            try:
                async with session.post(
                    base_url + planned.path, json=dict(planned.body), headers=headers
                ) as response:
                    answer.status = response.status
                    answer.reason = response.headers.get("x-kvguard-reason", "")
                    if response.status == 200 and planned.body.get("stream") is True:
                        await _read_stream(response, answer, lambda: loop.time() - start)
                    else:
                        _read_whole(await response.read(), answer)
                    headers_seen = response.headers
            except (aiohttp.ClientError, TimeoutError) as exc:
                answer.error = f"{type(exc).__name__}: {exc}"
            if answer.error is not None or answer.attempts > retries:
                break
            wait_s = sdk_retry_delay(answer.status, headers_seen, answer.attempts - 1, rng)
            if wait_s is None:
                break
            answer.attempts += 1
            await asyncio.sleep(wait_s)  # as the SDK does
        answer.done_at = loop.time() - start
        if on_done is not None:
            on_done(answer)
        return answer

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        return list(await asyncio.gather(*(one(session, i, p) for i, p in enumerate(plan))))


# Statuses the OpenAI SDK retries when the answer says nothing (x-should-retry), besides 5xx.
RETRY_STATUSES = frozenset({408, 409, 429})


def sdk_retry_delay(
    status: int, headers: Mapping[str, str], retries: int, rng: random.Random
) -> float | None:
    """What the OpenAI SDK waits before retrying an answer, its `retries`-th retry next; None
    when it would not retry: `x-should-retry` first, else the status. The wait:
    retry-after-ms, else retry-after, when within 60 s; else its backoff (0.5 s doubling, at
    most 8 s, less up to 25 % jitter)."""
    should = headers.get("x-should-retry")
    if should == "false" or status == 200:
        return None
    if should != "true" and status not in RETRY_STATUSES and status < 500:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if 0 < seconds <= 60:
            return seconds
        break
    return min(0.5 * 2.0**retries, 8.0) * (1 - 0.25 * rng.random())


async def _read_stream(
    response: aiohttp.ClientResponse, answer: Answer, now: Callable[[], float]
) -> None:
    tokens = 0
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                tokens += 1
                if answer.first_token_at is None:
                    answer.first_token_at = now()
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            tokens = int(usage.get("completion_tokens", tokens))
    answer.completion_tokens = tokens


def _read_whole(body: bytes, answer: Answer) -> None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return
    if not isinstance(parsed, dict):
        return
    if answer.status == 200:
        usage = parsed.get("usage") or {}
        answer.completion_tokens = usage.get("completion_tokens")
    elif not answer.reason:
        error = parsed.get("error") or {}
        answer.reason = str(error.get("code", "")) if isinstance(error, dict) else ""
