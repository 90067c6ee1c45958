"""Small OpenAI-compatible upstreams that stand in for vLLM in the tests and the benchmarks.

`StreamingUpstream` streams every answer token by token, with a real gap between tokens, and
takes little CPU doing it (see its docstring). `RecordingUpstream` records every request
reaching it and answers POST /v1/chat/completions and /v1/completions (JSON or SSE streams),
/v1/responses and /v1/messages (kvguard.testing.upstream_apis), and any other path with 200
"ok". Tests steer its single requests with headers:

- `x-test-status: 500`: answer with that status (an OpenAI error body);
- `x-test-delay: 0.5`: wait that many seconds before answering;
- `x-test-token-delay: 0.01`: seconds between streamed tokens (default: the constructor's);
- `x-test-reset: 1`: reset the connection without answering;
- `x-test-reset-after: 3`: stream that many tokens, then reset the connection;
- `x-test-tokens: 37`: answer that many tokens per sequence when the limit is higher (or
  absent), finish_reason "stop", as a model that meets its end of sequence; at most the limit
  ("length"). A stream then gives the finish reason on its last token's event, as vLLM does,
  so that it has one event with choices per token.

Its usage follows vLLM: `prompt_tokens` is kvguard's `x-kvguard-prompt-tokens` header (0 without
it), `completion_tokens` is the request's limit (`max_completion_tokens`, else `max_tokens`,
else 0), or `x-test-tokens` when that stops it first, for each sequence (`n` of each prompt).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from kvguard.testing import upstream_apis

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
TOKEN_TEXT = "tok "
_MAX_BODY_BYTES = 64 * 1024 * 1024  # above any body Envoy lets through


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the upstream received it."""

    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # names in lowercase; repeated headers joined with ", "
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


class _Loopback:
    """An upstream listening on 127.0.0.1: its port and base URL once started."""

    _port: int | None = None

    @property
    def port(self) -> int:
        """The bound port (after start)."""
        if self._port is None:
            raise RuntimeError("upstream is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RecordingUpstream(_Loopback):
    """An aiohttp server on 127.0.0.1; `requests` holds what arrived, in order of arrival."""

    def __init__(self, *, token_delay: float = 0.0) -> None:
        self.token_delay = token_delay
        self.requests: list[RecordedRequest] = []
        self._in_flight = 0
        self._peak_in_flight = 0
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def in_flight(self) -> int:
        """Requests being answered now (a stream counts until its last chunk)."""
        return self._in_flight

    @property
    def peak_in_flight(self) -> int:
        """The highest `in_flight` seen since start (or the last clear())."""
        return self._peak_in_flight

    async def start(self, port: int = 0) -> None:
        """Listen on 127.0.0.1:`port` (0: any free port, see `.port`)."""
        if self._runner is not None:
            raise RuntimeError("upstream is already started")
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that goes away ends its handler (and in_flight) at once.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Close the listener and any open connections."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._port = None

    def clear(self) -> None:
        """Forget recorded requests and the peak."""
        self.requests.clear()
        self._peak_in_flight = self._in_flight

    async def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Wait until at least `n` requests have arrived; returns them all."""
        try:
            async with asyncio.timeout(timeout), self._arrived:
                await self._arrived.wait_for(lambda: len(self.requests) >= n)
        except TimeoutError:
            raise TimeoutError(
                f"{len(self.requests)} of {n} requests arrived within {timeout}s"
            ) from None
        return list(self.requests)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self._in_flight += 1
        self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
        try:
            recorded = RecordedRequest(
                method=request.method,
                path=request.path,
                query=request.query_string,
                headers=_lowercase_headers(request),
                body=await request.read(),
            )
            async with self._arrived:
                self.requests.append(recorded)
                self._arrived.notify_all()
            return await self._answer(request, recorded)
        finally:
            self._in_flight -= 1

    async def _answer(self, request: web.Request, recorded: RecordedRequest) -> web.StreamResponse:
        headers = recorded.headers
        if headers.get("x-test-reset"):
            _reset(request)
            return web.Response()  # never sent: the connection is gone
        await asyncio.sleep(float(headers.get("x-test-delay", "0")))
        status = int(headers.get("x-test-status", "200"))
        if status != 200:
            return _error(status, f"x-test-status asked for {status}")
        api = recorded.path in upstream_apis.API_PATHS
        if request.method != "POST" or not (api or recorded.path in COMPLETION_PATHS):
            return web.Response(text="ok")
        try:
            body = recorded.json()
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body is not a JSON object")
        if api:
            return await upstream_apis.answer(request, headers, body, self.token_delay)
        completion = _Completion(recorded, body)
        if body.get("stream") is True:
            delay = float(headers.get("x-test-token-delay", self.token_delay))
            reset_after = headers.get("x-test-reset-after")
            return await completion.stream(
                request, delay, None if reset_after is None else int(reset_after)
            )
        return web.json_response(completion.whole())


class _Completion:
    """The answer to one completion request: `tokens` tokens for each of `sequences`."""

    def __init__(self, recorded: RecordedRequest, body: dict[str, Any]) -> None:
        self.chat = recorded.path == "/v1/chat/completions"
        self.model = body.get("model", "")
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{time.monotonic_ns()}"
        self.created = int(time.time())
        self.tokens = _limit(body)
        self.finish = "length"
        # x-test-tokens: the answer meets its end first; its stream's last token event ends it.
        natural = recorded.headers.get("x-test-tokens")
        self.natural = natural is not None
        if natural is not None and (self.tokens == 0 or int(natural) < self.tokens):
            self.tokens, self.finish = max(int(natural), 0), "stop"
        n = body.get("n", 1)
        self.sequences = (n if isinstance(n, int) and n > 0 else 1) * _prompt_count(body, self.chat)
        self.prompt_tokens = int(recorded.headers.get("x-kvguard-prompt-tokens", "0"))
        stream_options = body.get("stream_options")
        self.include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )

    def usage(self) -> dict[str, int]:
        completion_tokens = self.tokens * self.sequences
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def whole(self) -> dict[str, Any]:
        text = TOKEN_TEXT * self.tokens
        choices = [
            {"index": i, "message": {"role": "assistant", "content": text}}
            if self.chat
            else {"index": i, "text": text}
            for i in range(self.sequences)
        ]
        for choice in choices:
            choice["finish_reason"] = self.finish
        return self._envelope(choices, "chat.completion" if self.chat else "text_completion") | {
            "usage": self.usage()
        }

    async def stream(
        self, request: web.Request, token_delay: float, reset_after: int | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for step in range(self.tokens):
            if reset_after is not None and step >= reset_after:
                _reset(request)
                return response
            last = self.natural and step == self.tokens - 1
            for index in range(self.sequences):
                finish = self.finish if last else None
                await _send(response, self._chunk(index, TOKEN_TEXT, finish, first=step == 0))
            await asyncio.sleep(token_delay)
        if reset_after is not None and self.tokens <= reset_after:
            _reset(request)
            return response
        if not (self.natural and self.tokens > 0):  # else the last token's event said it
            for index in range(self.sequences):
                await _send(response, self._chunk(index, "", self.finish, first=self.tokens == 0))
        if self.include_usage:
            usage = {"usage": self.usage()}
            await _send(response, self._envelope([], self._chunk_object()) | usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _chunk(self, index: int, text: str, finish: str | None, *, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        return self._envelope([choice], self._chunk_object())

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _limit(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return max(value, 0)
    return 0


def _prompt_count(body: dict[str, Any], chat: bool) -> int:
    """Prompts in a batch completion (a list of strings or of token lists); 1 otherwise."""
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1  # one prompt given as token ids


def _lowercase_headers(request: web.Request) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "upstream_error", "param": None, "code": status}
    return web.json_response({"error": error}, status=status)


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


def _reset(request: web.Request) -> None:
    """Reset the TCP connection (RST, not FIN); what the handler returns then is never sent."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


class StreamingUpstream(_Loopback):
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
        limit = _limit(body)  # 0: none
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
