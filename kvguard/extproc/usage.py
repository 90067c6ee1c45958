"""Reading what a response produced from its body, as Envoy copies it to kvguard.

A non-streamed OpenAI answer is one JSON object with `usage.completion_tokens` and each
choice's `finish_reason`. A stream is server-sent events, `data: {...}` per chunk and
`data: [DONE]` at the end; its last chunk carries `usage` only when the client asked
(`stream_options.include_usage`), so without it the count is the events that carried choices
(vLLM sends one per decoded token). Only the events that can say something are parsed as JSON:
the others are counted by their prefix.

The Responses and Messages APIs say `usage.output_tokens`: at the top of a non-streamed answer,
in a stream's last event (Responses' `response.completed`, under `response`; Messages'
`message_delta`). Their streams name each event (`event: …` before its `data:`), and progress
is the delta events (`response.output_text.delta` and the other `response.*.delta`,
`content_block_delta`), about one per decoded token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A non-streamed body larger than this is not kept for reading (a batch of long answers).
MAX_JSON_BYTES = 4 * 1024 * 1024
_EVENT = b"data: "
_NAMED = b"event: "
_WORTH_PARSING = (b'"usage":{', b'"usage": {', b'"finish_reason":"', b'"finish_reason": "')


@dataclass(frozen=True, slots=True)
class Produced:
    """What the body said: completion tokens (None when it did not say), the first choice's
    finish reason, and where the count came from (usage | events)."""

    completion_tokens: int | None
    finish_reason: str | None
    source: str


class BodyReader:
    """Fed a response body chunk by chunk; `done()` says what it produced."""

    def __init__(self) -> None:
        self._kind: str | None = None  # "sse" or "json", from the first bytes
        self._rest = b""  # an SSE line not yet complete, or the JSON body so far
        self._events = 0
        self._usage: int | None = None
        self._finish: str | None = None
        self._too_large = False

    @property
    def events(self) -> int:
        """Events with choices read so far: a stream's output tokens, one event each."""
        return self._events

    def feed(self, chunk: bytes) -> None:
        if self._kind is None:
            start = chunk.lstrip()[:1]
            if not start:
                return  # nothing but whitespace yet
            # A JSON answer is an object; anything else is read as events (`data:` lines).
            self._kind = "json" if start in (b"{", b"[") else "sse"
        if self._kind == "json":
            if not self._too_large:
                self._rest += chunk
                if len(self._rest) > MAX_JSON_BYTES:
                    self._too_large, self._rest = True, b""
            return
        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        if not line.startswith(_EVENT) or line.startswith(b"data: [DONE]"):
            if line.startswith(_NAMED):  # Responses and Messages streams: count their deltas
                name = line[len(_NAMED) :].rstrip()
                if name.endswith(b".delta") or name == b"content_block_delta":
                    self._events += 1
            return
        if any(marker in line for marker in _WORTH_PARSING):
            event = _json(line[len(_EVENT) :])
            if event is None:
                return
            self._read(event)
            if event.get("choices"):
                self._events += 1
        elif b'"choices":[{' in line or b'"choices": [{' in line:
            self._events += 1

    def _read(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._usage = usage["completion_tokens"]
        elif "choices" not in event:
            self._read_other(event)
            return
        if self._finish is None:
            for choice in event.get("choices") or ():
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str):
                    self._finish = reason
                    break

    def _read_other(self, event: dict[str, Any]) -> None:
        """A Responses or Messages answer or event: `usage.output_tokens`, and why it ended
        (Messages' stop_reason; Responses' incomplete reason, else its status)."""
        if event.get("type") == "message_start":
            return  # its usage is the prompt's, before any output
        response = event.get("response")
        answer: dict[str, Any] = response if isinstance(response, dict) else event
        usage = answer.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
            self._usage = usage["output_tokens"]
        delta = event.get("delta")
        stop = delta.get("stop_reason") if isinstance(delta, dict) else event.get("stop_reason")
        incomplete = answer.get("incomplete_details")
        if isinstance(incomplete, dict) and isinstance(incomplete.get("reason"), str):
            stop = incomplete["reason"]
        elif stop is None:
            stop = answer.get("status")
        if isinstance(stop, str):
            self._finish = stop

    def done(self) -> Produced:
        """What the whole body said (call once its last chunk was fed)."""
        if self._kind == "sse":
            if self._rest:
                self._line(self._rest)
                self._rest = b""
            if self._usage is not None:
                return Produced(self._usage, self._finish, "usage")
            return Produced(self._events or None, self._finish, "events" if self._events else "")
        if self._kind == "json" and self._rest:
            answer = _json(self._rest)
            self._rest = b""
            if answer is not None:
                self._read(answer)
        return Produced(self._usage, self._finish, "usage" if self._usage is not None else "")


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None
