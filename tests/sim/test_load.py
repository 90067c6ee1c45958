"""The benchmark's lean HTTP/1.1 load client and upstream (bench/http_load.py): the figures
of bench_overhead rest on them reading every response whole, however it arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from bench.http_load import Http1Client, LeanUpstream, ResponseError


@asynccontextmanager
async def serving(answer: Callable[[asyncio.StreamWriter], None]) -> AsyncIterator[str]:
    """A server on 127.0.0.1 that reads a request's head and lets `answer` write the reply;
    yields its URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            answer(writer)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@asynccontextmanager
async def client_of(url: str) -> AsyncIterator[Http1Client]:
    client = Http1Client(url)
    try:
        yield client
    finally:
        client.close()


async def test_requests_reuse_one_connection_to_the_lean_upstream() -> None:
    upstream = LeanUpstream()
    await upstream.start()
    try:
        async with client_of(f"http://127.0.0.1:{upstream.port}") as client:
            statuses = [await client.post("/v1/chat/completions", b"{}", {}) for _ in range(3)]
            assert statuses == [200, 200, 200]
            assert len(client.opened) == 1
    finally:
        await upstream.stop()


async def test_a_chunked_response_with_trailers_is_read_whole_across_writes() -> None:
    def answer(writer: asyncio.StreamWriter) -> None:
        parts = [
            b"HTTP/1.1 429 Too Many Requests\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
            b"lo\r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n",
            b"\r\n",
        ]
        for part in parts:
            writer.write(part)

    async with serving(answer) as url, client_of(url) as client:
        assert await client.post("/", b"x", {}) == 429
        assert await client.post("/", b"y", {}) == 429  # the buffer held nothing more
        assert len(client.opened) == 1


async def test_connection_close_is_honoured() -> None:
    def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")

    async with serving(answer) as url, client_of(url) as client:
        assert await client.post("/", b"", {}) == 200
        assert await client.post("/", b"", {}) == 200
        assert len(client.opened) == 2


async def test_a_response_without_a_length_is_an_error() -> None:
    def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nok")

    async with serving(answer) as url, client_of(url) as client:
        with pytest.raises(ResponseError, match="without a length"):
            await client.post("/", b"", {})
