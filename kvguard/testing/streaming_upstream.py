"""A small OpenAI-compatible upstream that streams as vLLM does, for the benchmarks and the tests
of streamed answers: `StreamingUpstream` streams every answer token by token, with a real gap
between tokens, and takes little CPU doing it (see its docstring).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, cast

from kvguard.testing.upstream import TOKEN_TEXT, Loopback, completion_limit


class StreamingUpstream(Loopback):
    """A model server on 127.0.0.1 that streams as vLLM does, on raw asyncio protocols so that
    it takes little of the CPU it shares with Envoy in the benchmarks.

    Every POST is answered as a chat completion of `tokens` tokens (TOKEN_TEXT each), cut to
    the request's limit (`max_completion_tokens`, else `max_tokens`; finish_reason "length",
    else "stop"). With `"stream": true` the answer is text/event-stream, one HTTP chunk per
    event: one chat.completion.chunk per token, `token_gap` seconds apart (the first at once,
    the last carrying finish_reason), the usage when `stream_options.include_usage` asks for
    it, then `data: [DONE]`. Otherwise one chat.completion with its usage. `prompt_tokens` is
    kvguard's `x-kvguard-prompt-tokens` (0 without it). Other methods get 200 "ok". Nothing is
    recorded beyond the counts.
    """

    def __init__(self, *, tokens: int = 200, token_gap: float = 0.005) -> None:
        if tokens < 1 or token_gap < 0:
            raise ValueError("tokens must be at least 1 and token_gap at least 0")
        self.tokens = tokens
        self.token_gap = token_gap
        self.requests = 0  # requests answered or being answered
        self.streams_done = 0  # streams whose [DONE] has been written
        self.events_sent = 0  # SSE events written, [DONE] included
        self.connections: set[_Streaming] = set()  # open now
        self._server: asyncio.AbstractServer | None = None
        self._port: int | None = None

    async def start(self, port: int = 0) -> None:
        """Listen on 127.0.0.1:`port` (0: any free port, see `.port`)."""
        if self._server is not None:
            raise RuntimeError("upstream is already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Streaming(self), "127.0.0.1", port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Close the listener and every open connection (streams under way are cut)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for connection in list(self.connections):
                connection.abort()
            await server.wait_closed()
        self._port = None


_HEAD_END = b"\r\n\r\n"
_CHUNKED_REQUEST = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_LENGTH_OF_REQUEST = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_PROMPT_TOKENS = re.compile(rb"\r\nx-kvguard-prompt-tokens:[ \t]*(\d+)", re.IGNORECASE)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_DONE = b"data: [DONE]\n\n"


def _http_request(buffer: bytearray) -> tuple[bytes, bytes, int] | None:
    """(head, body, bytes used) of the complete HTTP/1.1 request at the start of `buffer`, or
    None while it is incomplete. The body has a content-length, is chunked, or is empty."""
    end = buffer.find(_HEAD_END)
    if end < 0:
        return None
    head, at = bytes(buffer[:end]), end + 4
    if not _CHUNKED_REQUEST.search(head):
        match = _LENGTH_OF_REQUEST.search(head)
        length = int(match[1]) if match else 0
        if len(buffer) < at + length:
            return None
        return head, bytes(buffer[at : at + length]), at + length
    body = bytearray()
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).split(b";")[0], 16)
        if size == 0:  # then trailers, if any, and an empty line
            last = buffer.find(_HEAD_END, line_end)
            return None if last < 0 else (head, bytes(body), last + 4)
        at = line_end + 2
        if len(buffer) < at + size + 2:
            return None
        body += buffer[at : at + size]
        at += size + 2


def _http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _plain(status: str, content_type: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        content_type.encode(),
        len(body),
        body,
    )


class _StreamedAnswer:
    """The answer to one request: its tokens, why it ends, and its events or its whole body."""

    def __init__(self, upstream: StreamingUpstream, body: dict[str, Any], prompt_tokens: int):
        limit = completion_limit(body)  # 0: none
        self.tokens = limit if 0 < limit < upstream.tokens else upstream.tokens
        self.finish = "length" if 0 < limit <= upstream.tokens else "stop"
        self.prompt_tokens = prompt_tokens
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self._envelope = {
            "id": f"chatcmpl-{upstream.requests:012d}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", ""),
        }

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": total,
        }

    def whole(self) -> bytes:
        message = {"role": "assistant", "content": TOKEN_TEXT * self.tokens}
        choice = {"index": 0, "message": message, "finish_reason": self.finish}
        answer = self._envelope | {"object": "chat.completion", "choices": [choice]}
        return json.dumps(answer | {"usage": self.usage()}).encode()

    def token_events(self) -> list[bytes]:
        """One event per token: the first names the role, the last gives finish_reason."""

        def event(first: bool, last: bool) -> bytes:
            delta = (
                {"role": "assistant", "content": TOKEN_TEXT} if first else {"content": TOKEN_TEXT}
            )
            choice = {"index": 0, "delta": delta, "logprobs": None}
            choice["finish_reason"] = self.finish if last else None
            return _sse(self._envelope | {"choices": [choice]})

        if self.tokens == 1:
            return [event(True, True)]
        middle = event(False, False)
        return [event(True, False), *[middle] * (self.tokens - 2), event(False, True)]

    def tail_events(self) -> list[bytes]:
        """What follows the last token at once: the usage when asked for, and [DONE]."""
        usage = [_sse(self._envelope | {"choices": [], "usage": self.usage()})]
        return [*(usage if self.include_usage else []), _DONE]


class _Streaming(asyncio.Protocol):
    """One connection: its requests answered one at a time, a stream's tokens on a timer."""

    def __init__(self, upstream: StreamingUpstream) -> None:
        self._upstream = upstream
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._tokens: list[bytes] = []  # the stream's token events still to send, last first
        self._tail: list[bytes] = []  # the events that follow its last token
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it
        self._upstream.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        self._upstream.connections.discard(self)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._answer_waiting()

    def _answer_waiting(self) -> None:
        """Answer the complete requests in the buffer, up to the first that streams."""
        while not self._tokens and self._transport is not None:
            request = _http_request(self._buffer)
            if request is None:
                return
            head, body, used = request
            del self._buffer[:used]
            self._upstream.requests += 1
            self._answer(self._transport, head, body)

    def _answer(self, transport: asyncio.Transport, head: bytes, body: bytes) -> None:
        if not head.startswith(b"POST "):
            transport.write(_plain("200 OK", "text/plain", b"ok"))
            return
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            error = json.dumps({"error": {"message": "body is not a JSON object"}}).encode()
            transport.write(_plain("400 Bad Request", "application/json", error))
            return
        match = _PROMPT_TOKENS.search(head)
        answer = _StreamedAnswer(self._upstream, parsed, int(match[1]) if match else 0)
        if parsed.get("stream") is not True:
            transport.write(_plain("200 OK", "application/json", answer.whole()))
            return
        self._tokens = answer.token_events()[::-1]
        self._tail = answer.tail_events()
        transport.write(_SSE_HEAD)
        self._send_token()

    def _send_token(self) -> None:
        """Write the next token's event and wait the gap; after the last, end the stream."""
        self._timer = None
        if self._transport is None:
            return
        events = [self._tokens.pop()]
        if not self._tokens:
            events += self._tail
        self._upstream.events_sent += len(events)
        data = b"".join(_http_chunk(event) for event in events)
        if self._tokens:
            self._transport.write(data)
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._upstream.token_gap, self._send_token)
            return
        self._transport.write(data + b"0\r\n\r\n")
        self._upstream.streams_done += 1
        self._answer_waiting()
