"""The lean ends of the benchmarks' HTTP path: a load client (keep-alive HTTP/1.1 connections
on raw asyncio protocols, one request per connection at a time) and an upstream that answers
every request at once.

The load process shares CPUs with Envoy and the upstream, so what it spends per request is
taken from them: aiohttp's client spent 0.9-1.7 ms of CPU per request there, about what Envoy
itself spends, and its own scheduling delays landed in every latency it measured. This one
sends prebuilt request bytes and reads a status line, headers and a Content-Length body (or
chunks), nothing else.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)


class ResponseError(Exception):
    """The server answered something this client does not read, or hung up mid-response."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reusable = True
        self._buffer = bytearray()
        self._waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ResponseError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        try:
            status = self._complete()
        except ResponseError as exc:
            self.reusable = False
            self._waiter.set_exception(exc)
            return
        if status is not None:
            self._waiter.set_result(status)

    def _complete(self) -> int | None:
        """The status once the whole response is in the buffer (and drop it), else None."""
        message = _message(self._buffer, request=False)
        if message is None:
            return None
        head, size = message
        self.reusable = not _CLOSE.search(head)
        del self._buffer[:size]
        return int(head[9:12])

    async def request(self, data: bytes) -> int:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self._waiter


def _message(buffer: bytearray, *, request: bool) -> tuple[bytes, int] | None:
    """(head, size in bytes) of the complete HTTP/1.1 message at the start of `buffer`, or None
    while it is incomplete. A request without a length has no body; a response without one is
    refused (this client never reads to the end of the connection)."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head, body_at = bytes(buffer[:end]), end + 4
    if _CHUNKED.search(head):
        length = _chunked_length(buffer, body_at)
        if length is None:
            return None
    elif match := _CONTENT_LENGTH.search(head):
        length = int(match[1])
        if len(buffer) < body_at + length:
            return None
    elif request:
        length = 0
    else:
        raise ResponseError(f"a response without a length: {head[:200]!r}")
    return head, body_at + length


def _chunked_length(buffer: bytearray, start: int) -> int | None:
    """The length of a complete chunked body starting at `start`, or None while incomplete."""
    at = start
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).split(b";")[0], 16)
        if size == 0:  # then trailers, if any, and an empty line
            end = buffer.find(b"\r\n\r\n", line_end)
            return None if end < 0 else end + 4 - start
        at = line_end + 2 + size + 2
        if len(buffer) < at:
            return None


class Http1Client:
    """POSTs to one host:port over a pool of keep-alive connections, opened as needed.

    `connection` reads one answer per request: by default its status code (_Connection);
    bench/sse_load.py gives one that times each event of a stream."""

    def __init__(self, url: str, connection: Callable[[], Any] = lambda: _Connection()) -> None:
        host_port = url.removeprefix("http://").rstrip("/")
        self._host, _, port = host_port.rpartition(":")
        self._port = int(port)
        self._protocol = connection
        self._idle: list[Any] = []
        self.opened: list[Any] = []  # every connection, in the order opened

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Any:
        """What the connection reads of the answer (_Connection: its status code)."""
        connection = self._idle.pop() if self._idle else await self._connect()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        data = (
            f"POST {path} HTTP/1.1\r\nhost: {self._host}\r\n{head}"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        answer = await connection.request(data)
        if connection.reusable:
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        return answer

    async def _connect(self) -> Any:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(self._protocol, self._host, self._port)
        self.opened.append(connection)
        return connection

    def close(self) -> None:
        for connection in self.opened:
            if connection.transport is not None:
                connection.transport.close()


# What the upstream answers to every request: a small chat completion.
_COMPLETION = (
    b'{"id":"cmpl-bench","object":"chat.completion","created":0,"model":"qwen","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_COMPLETION),
    _COMPLETION,
)


class _Answering(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (message := _message(self._buffer, request=True)) is not None:
            del self._buffer[: message[1]]
            assert self._transport is not None
            self._transport.write(_ANSWER)


class LeanUpstream:
    """The benchmark's upstream: every HTTP/1.1 request on 127.0.0.1 is answered at once with
    the same small chat completion, and nothing is recorded."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(_Answering, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def at_rate(rate: float, seconds: float, one: Callable[[int], Awaitable[None]]) -> None:
    """Start `one(i)` at t0 + i / rate for `seconds` (open loop: whatever happened to the
    others), and return once every one has ended."""
    t0 = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
