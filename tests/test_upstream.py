"""The streaming upstream (kvguard.testing.streaming_upstream.StreamingUpstream) and the
benchmark's client that times its events (bench/sse_load.py): the streamed-answer figures of
bench_overhead rest on one well-formed event per token, sent as it is made, and read as it
arrives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from bench.sse_load import sse_client, stream_loop
from kvguard.testing.streaming_upstream import StreamingUpstream
from kvguard.testing.upstream import TOKEN_TEXT

GAP_S = 0.05  # between tokens: each stream of TOKENS lasts (TOKENS - 1) * GAP_S
TOKENS = 5


@pytest.fixture
async def streaming() -> AsyncIterator[StreamingUpstream]:
    upstream = StreamingUpstream(tokens=TOKENS, token_gap=GAP_S)
    await upstream.start()
    yield upstream
    await upstream.stop()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], **fields}


def events_of(raw: bytes) -> list[bytes]:
    """The data of each SSE event of a whole stream; fails on anything but `data: ...\\n\\n`."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: ") and b"\n" not in event for event in events), raw
    return [event.removeprefix(b"data: ") for event in events]


async def test_a_stream_is_one_chunk_event_per_token_then_done(
    streaming: StreamingUpstream,
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(streaming.url + "/v1/chat/completions", json=chat(stream=True)) as response,
    ):
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        raw = await response.read()
    *chunks, done = events_of(raw)
    assert done == b"[DONE]"
    parsed = [json.loads(chunk) for chunk in chunks]
    assert len(parsed) == TOKENS
    assert {chunk["object"] for chunk in parsed} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in parsed}) == 1
    deltas = [chunk["choices"][0]["delta"] for chunk in parsed]
    assert deltas[0] == {"role": "assistant", "content": TOKEN_TEXT}
    assert deltas[1:] == [{"content": TOKEN_TEXT}] * (TOKENS - 1)
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in parsed]
    assert finishes == [None] * (TOKENS - 1) + ["stop"]  # no limit: the answer ends itself
    assert (streaming.requests, streaming.streams_done, streaming.events_sent) == (1, 1, TOKENS + 1)


async def test_the_client_reads_the_first_event_before_the_last_is_sent(
    streaming: StreamingUpstream,
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(streaming.url + "/v1/chat/completions", json=chat(stream=True)) as response,
    ):
        first = await response.content.readuntil(b"\n\n")
        sent_then = streaming.events_sent, streaming.streams_done
        rest = await response.read()
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
    # The first token's event is read while the upstream still waits its gaps for the others.
    assert sent_then[0] < TOKENS and sent_then[1] == 0
    assert len(events_of(rest)) == TOKENS  # the other tokens and [DONE]
    assert streaming.streams_done == 1


async def test_a_limit_cuts_the_answer_and_usage_comes_before_done(
    streaming: StreamingUpstream,
) -> None:
    body = chat(stream=True, max_tokens=3, stream_options={"include_usage": True})
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            streaming.url + "/v1/chat/completions",
            json=body,
            headers={"x-kvguard-prompt-tokens": "12"},
        ) as response,
    ):
        raw = await response.read()
    *chunks, usage, done = events_of(raw)
    assert done == b"[DONE]"
    assert len(chunks) == 3
    assert json.loads(chunks[-1])["choices"][0]["finish_reason"] == "length"
    assert json.loads(usage)["choices"] == []
    assert json.loads(usage)["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
    }


async def test_an_answer_not_streamed_is_one_completion_with_its_usage(
    streaming: StreamingUpstream,
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            streaming.url + "/v1/chat/completions", json=chat(max_completion_tokens=2)
        ) as response,
    ):
        answer = await response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == TOKEN_TEXT * 2
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 2
    assert streaming.streams_done == 0


async def test_a_chunked_request_is_read_and_answered_on_a_kept_connection(
    streaming: StreamingUpstream,
) -> None:
    body = json.dumps(chat(stream=True, max_tokens=2)).encode()
    half = len(body) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        half,
        body[:half],
        len(body) - half,
        body[half:],
    )
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", streaming.port)
    try:
        for _ in range(2):  # the second request waits in the buffer until the first stream ends
            writer.write(head + chunked)
        answers = []
        for _ in range(2):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK\r\n")
            answers.append(await read_chunked(reader))
    finally:
        writer.close()
    for raw in answers:
        assert len(events_of(raw)) == 3  # two tokens and [DONE]
    assert streaming.streams_done == 2


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    assert await reader.readexactly(2) == b"\r\n"
    return body


async def test_the_bench_client_times_every_event_in_order(streaming: StreamingUpstream) -> None:
    client = sse_client(streaming.url)
    try:
        body = json.dumps(chat(stream=True)).encode()
        reads = [await client.post("/v1/chat/completions", body, {}) for _ in range(2)]
    finally:
        client.close()
    for read in reads:
        assert (read.status, len(read.event_times), read.done) == (200, TOKENS, True)
        assert read.event_times == sorted(read.event_times)
    assert reads[0].event_times[-1] <= reads[1].event_times[0]
    assert len(client.opened) == 1


async def test_the_stream_loop_counts_streams_events_and_gaps(
    streaming: StreamingUpstream,
) -> None:
    body = json.dumps(chat(stream=True)).encode()
    result = await stream_loop(streaming.url, lambda i: body, rate=10.0, seconds=0.3)
    assert (result["streams"], result["statuses"], result["unfinished"]) == (3, {"200": 3}, 0)
    assert result["events_per_stream"] == {str(TOKENS): 3}
    assert result["gaps"] == 3 * (TOKENS - 1)
    assert result["ttft_p50_ms"] <= result["stream_p50_ms"]
