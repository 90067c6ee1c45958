"""A small OpenAI-compatible upstream that stands in for vLLM in the tests and the benchmarks,
recording what reaches it (the one that streams at little CPU: kvguard.testing.streaming_upstream).

`RecordingUpstream` records every request reaching it and answers POST /v1/chat/completions and
/v1/completions (JSON or SSE streams), /v1/responses and /v1/messages
(kvguard.testing.upstream_apis), and any other path with 200 "ok". Tests steer its single
requests with headers:

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
`Loopback`, `TOKEN_TEXT` and `completion_limit` are shared with the streaming upstream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

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


class Loopback:
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


class RecordingUpstream(Loopback):
    """An aiohttp server on 127.0.0.1; `requests` holds what arrived, in order of arrival."""

    def __init__(self, *, token_delay: float = 0.0, metrics: str | None = None) -> None:
        self.token_delay = token_delay
        # What GET /metrics answers, as a vLLM server's (not recorded); None: no such path.
        self.metrics = metrics
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
        if self.metrics is not None and request.method == "GET" and request.path == "/metrics":
            return web.Response(text=self.metrics, content_type="text/plain")
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
        self.tokens = completion_limit(body)
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


def completion_limit(body: dict[str, Any]) -> int:
    """The request's output limit: `max_completion_tokens`, else `max_tokens`; 0 for none."""
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
