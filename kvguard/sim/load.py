"""A load generator for OpenAI-compatible servers: planned arrivals, measured answers.

Used by `kvguard demo` and bench/bench_sim_fidelity.py. Each planned request is sent at its
offset from the start (a schedule, not a synchronisation), and its answer is timed: the first
streamed token, the end, the status and kvguard's refusal reason. A 429 may be retried as the
OpenAI SDK does: after `retry-after-ms` (else `retry-after`), unless `x-should-retry: false`.
"""

from __future__ import annotations

import asyncio
import json
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
    """Send every planned request at its time, retrying a 429 up to `retries` times; returns
    the answers (the last attempt's) in plan order."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # no client-side queueing: arrivals are the plan

    async def one(session: aiohttp.ClientSession, index: int, planned: Planned) -> Answer:
        await asyncio.sleep(max(0.0, start + planned.at_s - loop.time()))
        answer = Answer(planned, index, sent_at=loop.time() - start)
        headers = {tenant_header: planned.tenant, **planned.headers}
        while True:
            answer.reason, wait_s = "", None
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
                    wait_s = _retry_after_s(response.headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                answer.error = f"{type(exc).__name__}: {exc}"
            if answer.status != 429 or wait_s is None or answer.attempts > retries:
                break
            answer.attempts += 1
            await asyncio.sleep(wait_s)  # what the server asked for, as the SDK does
        answer.done_at = loop.time() - start
        if on_done is not None:
            on_done(answer)
        return answer

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        return list(await asyncio.gather(*(one(session, i, p) for i, p in enumerate(plan))))


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    """When a refused request may come back, as the OpenAI SDK reads it; None: not at all."""
    if headers.get("x-should-retry") == "false":
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return None


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
