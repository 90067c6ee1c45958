"""The response side of the protocol: which exchanges are sampled (the request-headers answer),
what an observing stream reads from a response body, and the release record it joins."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from kvguard.admission.record import Completion
from kvguard.extproc.observe import Completions, Sampler
from kvguard.extproc.responses import METADATA_NAMESPACE, OBSERVE_HEADER
from kvguard.extproc.usage import MAX_JSON_BYTES, BodyReader, Produced
from kvguard.testing.wait import wait_until
from tests.extproc.harness import body, exchange, headers, running, set_headers

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def _token(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def _read(*chunks: bytes) -> Produced:
    reader = BodyReader()
    for chunk in chunks:
        reader.feed(chunk)
    return reader.done()


# --- reading a body ---------------------------------------------------------------------------


def test_a_non_streamed_answer_gives_its_usage_and_finish_reason() -> None:
    answer = json.dumps(
        {
            "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 17, "total_tokens": 22},
        }
    ).encode()
    assert _read(answer) == Produced(17, "stop", "usage")
    # In pieces, as Envoy may deliver it.
    assert _read(answer[:7], answer[7:30], answer[30:]) == Produced(17, "stop", "usage")


def test_a_stream_with_usage_gives_it_whatever_the_chunking() -> None:
    stream = _sse(
        _token("a"),
        _token("b"),
        _token("", "length"),
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    )
    for cut in (1, 5, 17, 40, len(stream) - 3):
        assert _read(stream[:cut], stream[cut:]) == Produced(2, "length", "usage")


def test_a_stream_without_usage_counts_its_events() -> None:
    stream = _sse(*[_token("t") for _ in range(9)], _token("", "stop"))
    assert _read(stream) == Produced(10, "stop", "events")
    assert _read(b"data: [DONE]\n\n") == Produced(None, None, "")


def test_what_cannot_be_read_says_nothing() -> None:
    assert _read(b"<html>bad gateway</html>") == Produced(None, None, "")
    assert _read(b'{"error": {"message": "x"}}') == Produced(None, None, "")
    assert _read() == Produced(None, None, "")
    big = BodyReader()
    big.feed(b'{"usage": {"completion_tokens": 3}, "pad": "')
    big.feed(b"x" * MAX_JSON_BYTES)
    big.feed(b'"}')
    assert big.done() == Produced(None, None, "")  # too large to keep: not read


# --- the sample --------------------------------------------------------------------------------


def test_the_sample_is_the_share_asked_for_and_decided_by_the_request_id() -> None:
    ids = [f"{i:08x}-request" for i in range(20000)]
    picked = [i for i in ids if Sampler(0.05).pick(i)]
    assert 0.04 < len(picked) / len(ids) < 0.06
    assert picked == [i for i in ids if Sampler(0.05).pick(i)]  # the same ids every time
    assert not any(Sampler(0).pick(i) for i in ids)
    assert all(Sampler(1).pick(i) for i in ids)
    assert not Sampler(1).pick("")  # no id, no sample
    assert all(zlib.crc32(i.encode()) < 0.05 * 2**32 for i in picked)
    with pytest.raises(ValueError):
        Sampler(1.5)


async def test_a_sampled_exchange_is_marked_in_the_request_headers_answer(tmp_path: Path) -> None:
    async with running(tmp_path, response_sample=1.0) as (_, stub):
        _, (sampled,) = await exchange(
            stub, headers("/v1/chat/completions", {"x-request-id": "r1", OBSERVE_HEADER: "2"})
        )
        common = sampled.request_headers.response
        assert set_headers(common) == {OBSERVE_HEADER: "1"}
        assert OBSERVE_HEADER not in common.header_mutation.remove_headers
        assert not sampled.HasField("mode_override")  # kvguard's own filter keeps its modes

    async with running(tmp_path, response_sample=0.0) as (_, stub):
        _, (plain, marked) = await exchange(
            stub,
            headers("/v1/chat/completions", {"x-request-id": "r1"}),
            headers("/v1/chat/completions", {"x-request-id": "r2", OBSERVE_HEADER: "1"}),
        )
        assert not plain.request_headers.response.HasField("header_mutation")
        # A client's own mark is removed before the observing filter reads the headers.
        common = marked.request_headers.response
        assert list(common.header_mutation.remove_headers) == [OBSERVE_HEADER]
        assert set_headers(common) == {}


async def test_unguarded_paths_are_never_sampled(tmp_path: Path) -> None:
    async with running(tmp_path, response_sample=1.0) as (_, stub):
        _, (answer,) = await exchange(
            stub, headers("/v1/models", {":method": "GET", "x-request-id": "r1"})
        )
        assert set_headers(answer.request_headers.response) == {}


# --- an observing stream -----------------------------------------------------------------------


def _observed(chunk: bytes, lease: str, *, eos: bool) -> pb.ProcessingRequest:
    metadata = Struct()
    metadata.update({"lease": lease, "tenant": "acme"})
    message = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=chunk, end_of_stream=eos), observability_mode=True
    )
    message.metadata_context.filter_metadata[METADATA_NAMESPACE].CopyFrom(metadata)
    return message


async def test_an_observing_stream_is_read_unanswered_and_joined_to_the_release(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with running(tmp_path, response_sample=1.0) as (service, stub):
        call, (_, admitted) = await exchange(
            stub,
            headers("/v1/chat/completions", {"x-request-id": "r1"}),
            body({**CHAT, "stream": True}),
        )
        lease = set_headers(admitted.request_body.response)["x-kvguard-lease"]
        stream = _sse(*[_token("t") for _ in range(4)], _token("", "length"))
        observing = stub.Process()
        for i, chunk in enumerate((stream[:20], stream[20:])):
            await observing.write(_observed(chunk, lease, eos=i == 1))
        await observing.done_writing()
        assert [a async for a in observing] == []  # observability mode: nothing is answered
        await call.done_writing()  # the lease's own stream ends: the release
        await call.code()

        def released() -> list[Any]:
            return [r for r in caplog.records if r.getMessage() == "released"]

        await wait_until(lambda: len(released()) == 1, "the release recorded")
        assert len(service.processor.completions) == 0
    (record,) = released()
    assert record.__dict__["lease"] == lease
    assert record.__dict__["completion_tokens"] == 5
    assert record.__dict__["finish_reason"] == "length"
    assert record.__dict__["reserved_output"] == 20
    assert (record.__dict__["tier"], record.__dict__["pool"]) == ("pro", "qwen")  # acme


async def test_an_unsampled_release_is_recorded_at_once_without_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with running(tmp_path, response_sample=0.0) as (_, stub):
        call, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        await call.done_writing()
        await call.code()
        await wait_until(
            lambda: any(r.getMessage() == "released" for r in caplog.records), "the release"
        )
    (record,) = [r for r in caplog.records if r.getMessage() == "released"]
    assert "completion_tokens" not in record.__dict__
    assert record.__dict__["reserved_output"] == 20


async def test_a_sampled_release_waits_for_its_response_then_goes_without_it() -> None:
    recorded: list[Completion] = []
    completions = Completions(recorded.append, join_wait_s=0.05)

    def admitted(lease: str) -> None:
        completions.admitted(Completion("r", "t", "free", "qwen", lease, 20), observed=True)

    admitted("early")  # its response's last chunk comes before the release
    completions.produced("early", Produced(7, "stop", "usage"))
    assert recorded == []
    completions.released("early")
    assert [(c.lease, c.completion_tokens) for c in recorded] == [("early", 7)]

    admitted("late")  # released first: it waits for the response, which comes
    completions.released("late")
    completions.produced("late", Produced(3, "length", "events"))
    assert [(c.lease, c.completion_tokens) for c in recorded][1:] == [("late", 3)]

    admitted("lost")  # the observing stream never ends: recorded without a count
    completions.released("lost")
    await wait_until(lambda: len(recorded) == 3, "the wait to end")
    assert recorded[2].completion_tokens is None
    completions.produced("lost", Produced(3, "stop", "usage"))  # too late: ignored
    completions.released("lost")
    assert len(recorded) == 3 and len(completions) == 0
    await asyncio.sleep(0)


# --- the Responses and Messages APIs ----------------------------------------------------------


def _named(*events: tuple[str, dict[str, Any]]) -> bytes:
    """Server-sent events as vLLM's Responses and Messages APIs write them: named."""
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
        for name, data in events
    )


def test_responses_answers_give_their_output_tokens() -> None:
    usage = {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18}
    whole = {"object": "response", "status": "completed", "incomplete_details": None}
    assert _read(json.dumps({**whole, "usage": usage}).encode()) == Produced(
        7, "completed", "usage"
    )
    cut = {**whole, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    assert _read(json.dumps({**cut, "usage": usage}).encode()) == Produced(
        7, "max_output_tokens", "usage"
    )
    started = {"status": "in_progress", "usage": None}
    delta = {"delta": "tok ", "type": "response.output_text.delta"}
    stream = _named(
        ("response.created", {"response": started, "type": "response.created"}),
        *[("response.output_text.delta", delta)] * 5,
        ("response.reasoning_text.delta", {"delta": "hm", "type": "response.reasoning_text.delta"}),
        ("response.output_text.done", {"text": "…", "type": "response.output_text.done"}),
        ("response.completed", {"response": {**cut, "usage": usage}, "type": "response.completed"}),
    )
    for cut_at in (1, 9, 60, len(stream) // 2, len(stream) - 2):
        reader = BodyReader()
        reader.feed(stream[:cut_at])
        reader.feed(stream[cut_at:])
        assert reader.events == 6  # its deltas, one a token
        assert reader.done() == Produced(7, "max_output_tokens", "usage")
    # Cut before its last event: what streamed is all it says.
    assert _read(stream[: stream.index(b"event: response.output_text.done")]) == Produced(
        6, None, "events"
    )


def test_messages_answers_give_their_output_tokens() -> None:
    whole = {
        "type": "message",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 11, "output_tokens": 3},
    }
    assert _read(json.dumps(whole).encode()) == Produced(3, "end_turn", "usage")
    start = {"type": "message_start", "message": {**whole, "content": [], "stop_reason": None}}
    start["usage"] = {"input_tokens": 11, "output_tokens": 0}  # the prompt's: nothing produced
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "a"},
    }
    final = {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 11, "output_tokens": 4},
    }
    stream = _named(
        ("message_start", start),
        ("content_block_start", {"type": "content_block_start", "index": 0}),
        *[("content_block_delta", delta)] * 4,
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", final),
        ("message_stop", {"type": "message_stop"}),
    )
    assert _read(stream) == Produced(4, "max_tokens", "usage")
    assert _read(stream[: stream.index(b"event: message_delta")]) == Produced(4, None, "events")
    # With CRLF line ends, as other servers write them.
    assert _read(stream.replace(b"\n", b"\r\n")).completion_tokens == 4
