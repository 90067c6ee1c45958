"""The benchmarks' load of streamed answers: a lean HTTP/1.1 client that times each SSE event as
it arrives, and an open loop of streams that reports time to first token and the gaps between
tokens as the client sees them.

Like bench/http_load.py, it sends prebuilt request bytes on raw asyncio protocols and parses
only what it needs (a status line, a chunked or Content-Length body, the `\\n\\n` that ends an
event), so that it takes little of the CPU it shares with Envoy and the upstream. An event's
time is when the read that completes it returns: events that arrive together share a time.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from bench.http_load import Http1Client, at_rate

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
_DONE = b"data: [DONE]"


class StreamError(Exception):
    """The server answered something this client does not read, or hung up mid-response."""


@dataclass
class StreamRead:
    """One response as the client read it: its status, when each SSE event other than [DONE]
    arrived (perf_counter seconds), and whether [DONE] ended it."""

    status: int
    event_times: list[float] = field(default_factory=list)
    done: bool = False


class _StreamConnection(asyncio.Protocol):
    """One keep-alive connection, one response at a time, read as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reusable = True
        self._buffer = bytearray()
        self._events = bytearray()  # body bytes not yet split into events
        self._read: StreamRead | None = None  # the response under way, once its head is in
        self._chunked = False
        self._left = 0  # Content-Length bytes still to come
        self._waiter: asyncio.Future[StreamRead] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(StreamError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        try:
            finished = self._consume(time.perf_counter())
        except (StreamError, ValueError) as exc:
            self.reusable = False
            self._waiter.set_exception(StreamError(str(exc)))
            return
        if finished:
            assert self._read is not None
            self._waiter.set_result(self._read)

    def _consume(self, now: float) -> bool:
        """Read what the buffer holds of the response; True once it is complete."""
        if self._read is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(self._buffer[:end])
            del self._buffer[: end + 4]
            self._read = StreamRead(int(head[9:12]))
            self.reusable = not _CLOSE.search(head)
            self._chunked = bool(_CHUNKED.search(head))
            match = _CONTENT_LENGTH.search(head)
            if not self._chunked and match is None:
                raise StreamError(f"a response without a length: {head[:200]!r}")
            self._left = 0 if match is None else int(match[1])
        if not self._chunked:
            taken = min(self._left, len(self._buffer))
            self._body(bytes(self._buffer[:taken]), now)
            del self._buffer[:taken]
            self._left -= taken
            return self._left == 0
        while True:
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                return False
            size = int(bytes(self._buffer[:line_end]).split(b";")[0], 16)
            if size == 0:  # then trailers, if any, and an empty line
                end = self._buffer.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return False
                del self._buffer[: end + 4]
                return True
            if len(self._buffer) < line_end + 2 + size + 2:
                return False
            self._body(bytes(self._buffer[line_end + 2 : line_end + 2 + size]), now)
            del self._buffer[: line_end + 2 + size + 2]

    def _body(self, data: bytes, now: float) -> None:
        assert self._read is not None
        self._events += data
        while (end := self._events.find(b"\n\n")) >= 0:
            if self._events.startswith(_DONE):
                self._read.done = True
            else:
                self._read.event_times.append(now)
            del self._events[: end + 2]

    async def request(self, data: bytes) -> StreamRead:
        assert self.transport is not None
        self._read, self._events = None, bytearray()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self._waiter


def sse_client(url: str) -> Http1Client:
    """bench/http_load.py's client, reading each answer event by event."""
    return Http1Client(url, _StreamConnection)


def percentiles(values: list[float], prefix: str) -> dict[str, float]:
    """{prefix}_p50_ms, _p99_ms, _p999_ms and _max_ms of `values` (seconds), nan when empty."""
    values = sorted(values)

    def pct(q: float) -> float:
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    quantiles = {"p50": 0.50, "p99": 0.99, "p999": 0.999, "max": 1.0}
    return {f"{prefix}_{name}_ms": pct(q) for name, q in quantiles.items()}


async def stream_loop(
    url: str,
    bodies: Callable[[int], bytes],
    rate: float,
    seconds: float,
    load_client: str = "http1",
) -> dict[str, Any]:
    """Stream i starts at i / rate, whatever happened to the others (open loop). Reports the
    time to first token (request sent to first event read), the gaps between consecutive
    events of a stream, each stream's length, and this process's CPU per stream.
    `load_client` is accepted for the benchmark's calling convention; this client is the
    only one."""
    del load_client
    ttfts: list[float] = []
    gaps: list[float] = []
    durations: list[float] = []
    statuses: Counter[int] = Counter()
    events: Counter[int] = Counter()  # events per answered stream: how many streams had each
    unfinished = 0  # 200 answers that ended without [DONE]
    client = sse_client(url)

    async def one(i: int) -> None:
        nonlocal unfinished
        start = time.perf_counter()
        read = await client.post("/v1/chat/completions", bodies(i), _headers(i))
        statuses[read.status] += 1
        if read.status != 200:
            return
        events[len(read.event_times)] += 1
        unfinished += not read.done
        times = read.event_times
        if times:
            ttfts.append(times[0] - start)
            durations.append(times[-1] - start)
            gaps.extend(b - a for a, b in itertools.pairwise(times))

    try:
        cpu0 = time.process_time()
        await at_rate(rate, seconds, one)
        cpu = time.process_time() - cpu0
    finally:
        client.close()
    streams = sum(statuses.values())
    return {
        "streams": streams,
        "rate": rate,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "events_per_stream": {str(k): v for k, v in sorted(events.items())},
        "unfinished": unfinished,
        "gaps": len(gaps),
        **percentiles(ttfts, "ttft"),
        **percentiles(gaps, "itl"),
        **percentiles(durations, "stream"),
        "client_cpu_ms_per_stream": cpu * 1000 / streams if streams else float("nan"),
    }


def _headers(i: int) -> dict[str, str]:
    return {"content-type": "application/json", "x-tenant-id": f"t{i % 8}"}
