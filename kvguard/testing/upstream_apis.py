"""RecordingUpstream's answers to vLLM's other generation APIs, in the shapes vLLM 0.32 sends:
OpenAI's Responses (`POST /v1/responses`) and Anthropic's Messages (`POST /v1/messages`).

The answer is `tokens` tokens (TOKEN_TEXT each): the request's limit (`max_output_tokens`,
Messages' `max_tokens`; none: 0), or `x-test-tokens` when that stops it first (a model that
meets its end of sequence). `input_tokens` is kvguard's `x-kvguard-prompt-tokens` (0 without).
Non-streamed: one JSON answer with `usage.output_tokens`. Streamed (`"stream": true`): named
server-sent events, one delta event per token `x-test-token-delay` (or the upstream's delay)
apart, and the usage in the last event (Responses' `response.completed`, Messages'
`message_delta` then `message_stop`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

API_PATHS = frozenset({"/v1/responses", "/v1/messages"})
TOKEN_TEXT = "tok "


async def answer(
    request: web.Request, headers: dict[str, str], body: dict[str, Any], token_delay: float
) -> web.StreamResponse:
    """The answer to a Responses or Messages request (`request.path` says which)."""
    messages = request.path == "/v1/messages"
    limit = body.get("max_tokens" if messages else "max_output_tokens")
    tokens = limit if type(limit) is int and limit > 0 else 0
    natural = headers.get("x-test-tokens")
    stopped = natural is not None and (tokens == 0 or int(natural) < tokens)
    if stopped:
        tokens = max(int(natural or 0), 0)
    prompt = int(headers.get("x-kvguard-prompt-tokens", "0"))
    shape = (
        _Messages(body, tokens, prompt, stopped)
        if messages
        else _Responses(body, tokens, prompt, stopped)
    )
    if body.get("stream") is not True:
        return web.json_response(shape.whole())
    delay = float(headers.get("x-test-token-delay", token_delay))
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for name, event in shape.head():
        await _send(response, name, event)
    for _ in range(tokens):
        await _send(response, *shape.delta())
        await asyncio.sleep(delay)
    for name, event in shape.tail():
        await _send(response, name, event)
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, name: str, event: dict[str, Any]) -> None:
    data = json.dumps(event, separators=(",", ":"))
    await response.write(f"event: {name}\ndata: {data}\n\n".encode())


class _Responses:
    def __init__(self, body: dict[str, Any], tokens: int, prompt: int, stopped: bool) -> None:
        self.tokens, self.prompt = tokens, prompt
        self.complete = stopped or tokens == 0
        self.id = f"resp_{time.monotonic_ns()}"
        self.model = body.get("model", "")
        self.sequence = 0

    def _response(self, status: str, text: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        incomplete = None if status != "incomplete" else {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "status": status,
            "incomplete_details": incomplete,
            "output": [message] if text else [],
            "usage": usage,
        }

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt + self.tokens,
        }

    def whole(self) -> dict[str, Any]:
        status = "completed" if self.complete else "incomplete"
        return self._response(status, TOKEN_TEXT * self.tokens, self._usage())

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.sequence += 1
        return kind, {**fields, "sequence_number": self.sequence, "type": kind}

    def head(self) -> list[tuple[str, dict[str, Any]]]:
        started = self._response("in_progress", "", None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def delta(self) -> tuple[str, dict[str, Any]]:
        return self._event(
            "response.output_text.delta",
            content_index=0,
            delta=TOKEN_TEXT,
            item_id="msg_1",
            logprobs=[],
            output_index=0,
        )

    def tail(self) -> list[tuple[str, dict[str, Any]]]:
        return [self._event("response.completed", response=self.whole())]


class _Messages:
    def __init__(self, body: dict[str, Any], tokens: int, prompt: int, stopped: bool) -> None:
        self.tokens, self.prompt = tokens, prompt
        self.stop = "end_turn" if stopped else "max_tokens"
        self.id = f"msg_{time.monotonic_ns()}"
        self.model = body.get("model", "")

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": TOKEN_TEXT * self.tokens}],
            "model": self.model,
            "stop_reason": self.stop,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt, "output_tokens": self.tokens},
        }

    def head(self) -> list[tuple[str, dict[str, Any]]]:
        started = {**self.whole(), "content": [], "stop_reason": None}
        started["usage"] = {"input_tokens": self.prompt, "output_tokens": 0}
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        return [
            ("message_start", {"type": "message_start", "message": started}),
            ("content_block_start", block),
        ]

    def delta(self) -> tuple[str, dict[str, Any]]:
        delta = {"type": "text_delta", "text": TOKEN_TEXT}
        return "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0}

    def tail(self) -> list[tuple[str, dict[str, Any]]]:
        stop = {"stop_reason": self.stop, "stop_sequence": None}
        usage = {"input_tokens": self.prompt, "output_tokens": self.tokens}
        return [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}),
            ("message_stop", {"type": "message_stop"}),
        ]
