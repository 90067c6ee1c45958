"""What the client sees from the shipped envoy/envoy.yaml when Envoy answers by itself: kvguard
unreachable, its message timeout, a body above the buffer limit, vLLM unreachable, and any other
error of Envoy's own, each in the OpenAI error schema with a reason; and kvguard's and vLLM's own
answers byte for byte as they built them.

A small ext_proc stand-in plays kvguard where the test needs it to refuse, hang or pass."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from kvguard.errors import Code, Refusal
from kvguard.extproc import responses
from kvguard.testing.envoy import (
    EnvoyProcess,
    http_connection_manager,
    loopback_config,
    virtual_hosts,
)
from kvguard.testing.upstream import RecordingUpstream

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
GUARDED = "/v1/chat/completions"  # a path the gateway routes to vLLM; tests pick by query
# Above envoy.yaml's 16 MiB per_connection_buffer_limit_bytes.
ABOVE_ENVOYS_BUFFER = 17 * 1024 * 1024


def refusal_for(code: Code) -> Refusal:
    retry = 1 if code.status in (429, 503) else None
    return Refusal(code, f'refused: {code.value} (é, "quoted")', "model", retry)


def longer_body_than_its_length() -> ProcessingResponse:
    """A body rewritten without its content-length: Envoy refuses to forward it (a 503 of its
    own that is not vLLM's absence)."""
    response = ProcessingResponse()
    response.request_body.response.body_mutation.body = b'{"model": "qwen", "longer": true}'
    return response


class StandIn(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Answers by the query string of a guarded path (the gateway routes no other path to
    vLLM): `refuse=<code>` gets kvguard's refusal, `hang` never gets an answer to its body,
    `bad-length`'s body grows without its content-length, anything else passes."""

    async def Process(self, requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        path = ""
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                path = next(
                    h.raw_value.decode()
                    for h in message.request_headers.headers.headers
                    if h.key == ":path"
                )
                query = path.partition("?")[2]
                code = query.removeprefix("refuse=")
                if code != query:
                    await context.write(responses.refusal(refusal_for(Code(code))))
                    continue
                if query == "hang":
                    await asyncio.Event().wait()  # until Envoy gives up and ends the stream
                await context.write(responses.request_headers([], guarded=True))
            elif kind == "request_body" and path == GUARDED + "?bad-length":
                await context.write(longer_body_than_its_length())
            else:
                await context.write(responses.continue_response(str(kind)))


@pytest.fixture
async def stand_in() -> AsyncIterator[int]:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(StandIn(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(0)


async def post(
    url: str, data: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    sent = {"content-type": "application/json", **(headers or {})}
    async with (
        aiohttp.ClientSession() as client,
        client.post(url, data=data, headers=sent) as response,
    ):
        headers = {k.lower(): v for k, v in response.headers.items()}
        return response.status, headers, await response.read()


def assert_envoy_answer(
    answer: tuple[int, dict[str, str], bytes], status: int, code: str, error_type: str
) -> None:
    got_status, headers, body = answer
    assert got_status == status, body
    assert headers["content-type"] == "application/json"
    assert headers["x-kvguard-reason"] == code
    error = json.loads(body)["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (code, error_type, None)
    assert error["message"]


async def test_kvguard_unreachable_is_a_503_in_the_openai_schema(
    tmp_path: Path, upstream: RecordingUpstream, refusing_port: int
) -> None:
    config = loopback_config(refusing_port, upstream.port)
    async with EnvoyProcess(config, tmp_path) as envoy:
        answer = await post(f"{envoy.url}/v1/chat/completions", json.dumps(CHAT).encode())
        client = openai.AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(**CHAT)
        await client.close()
    assert_envoy_answer(answer, 503, "kvguard_unavailable", "server_error")
    assert answer[1]["retry-after"] == "1"
    assert (raised.value.code, raised.value.type) == ("kvguard_unavailable", "server_error")
    assert upstream.requests == []


async def test_kvguards_message_timeout_is_a_504_in_the_openai_schema(
    tmp_path: Path, upstream: RecordingUpstream, stand_in: int
) -> None:
    async with EnvoyProcess(loopback_config(stand_in, upstream.port), tmp_path) as envoy:
        answer = await post(f"{envoy.url}{GUARDED}?hang", json.dumps(CHAT).encode())
    assert_envoy_answer(answer, 504, "kvguard_timeout", "server_error")
    assert upstream.requests == []


async def test_a_body_above_envoys_buffer_is_a_413_in_the_openai_schema(
    tmp_path: Path, upstream: RecordingUpstream, stand_in: int
) -> None:
    async with EnvoyProcess(loopback_config(stand_in, upstream.port), tmp_path) as envoy:
        answer = await post(f"{envoy.url}/v1/completions", b"x" * ABOVE_ENVOYS_BUFFER)
    assert_envoy_answer(answer, 413, "request_too_large", "invalid_request_error")
    assert upstream.requests == []


async def test_vllm_unreachable_is_a_503_in_the_openai_schema(
    tmp_path: Path, stand_in: int, refusing_port: int
) -> None:
    async with EnvoyProcess(loopback_config(stand_in, refusing_port), tmp_path) as envoy:
        answer = await post(f"{envoy.url}/v1/chat/completions", json.dumps(CHAT).encode())
    assert_envoy_answer(answer, 503, "upstream_unavailable", "server_error")


async def test_kvguards_own_answers_pass_byte_for_byte(
    tmp_path: Path, upstream: RecordingUpstream, stand_in: int
) -> None:
    """Envoy's mappers leave every refusal kvguard makes as kvguard built it: status, body and
    kvguard's headers, and no header of Envoy's own answers."""
    answers = {}
    async with EnvoyProcess(loopback_config(stand_in, upstream.port), tmp_path) as envoy:
        for code in Code:
            answers[code] = await post(f"{envoy.url}{GUARDED}?refuse={code.value}", b"{}")
    for code, (status, headers, body) in answers.items():
        built = responses.refusal(refusal_for(code)).immediate_response
        sent = {h.header.key: h.header.raw_value.decode() for h in built.headers.set_headers}
        assert (status, body) == (built.status.code, built.body), code
        assert {k: headers.get(k) for k in sent} == sent, code
        assert not {k for k in headers if k.startswith("x-kvguard-")} - sent.keys(), code
    assert upstream.requests == []


# vLLM's own error answers (its OpenAI server: a JSONResponse of its ErrorResponse), and a bare
# 503 as a proxy or an overloaded server may send it.
VLLM_ERRORS = {
    "400": b'{"error":{"message":"max_tokens must be at least 1, got 0.",'
    b'"type":"BadRequestError","param":null,"code":400}}',
    "404": b'{"error":{"message":"The model `qwen` does not exist.",'
    b'"type":"NotFoundError","param":null,"code":404}}',
    "500": b'{"error":{"message":"EngineCore encountered an issue.",'
    b'"type":"InternalServerError","param":null,"code":500}}',
    "503": b'{"error":{"message":"The engine is sleeping.",'
    b'"type":"ServiceUnavailableError","param":null,"code":503}}',
}
REASONS = {"400": "Bad Request", "404": "Not Found", "500": "Internal Server Error"}


def upstream_answer(path: str) -> bytes | None:
    """The raw answer of the upstream below to `path` (by its query); None: no answer at all."""
    query = path.partition("?")[2]
    if query == "upstream=garbage":
        return b"NOT HTTP AT ALL\r\n\r\n"
    name = query.removeprefix("vllm=")
    if name == "bare-503":
        return b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
    if name in VLLM_ERRORS:
        body = VLLM_ERRORS[name]
        head = f"HTTP/1.1 {name} {REASONS.get(name, 'Service Unavailable')}\r\n"
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        return head.encode() + body
    return None


async def answer_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request per connection, answered with exactly upstream_answer's bytes, or never
    (reading until the peer closes)."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b"\r\n", 1)[0].split(b" ")[1].decode()
        answer = upstream_answer(path)
        if answer is None:
            await reader.read()
        else:
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            await reader.readexactly(int(length[1]) if length else 0)
            writer.write(answer)
            await writer.drain()
    writer.close()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[int]:
    server = await asyncio.start_server(answer_raw, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def headers_only(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    """Send a request's headers and never its body; Envoy's answer, read until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def test_every_other_error_envoy_answers_itself_is_in_the_openai_schema(
    tmp_path: Path, stand_in: int, raw_upstream: int
) -> None:
    """A last pair of mappers catches every error Envoy answers by itself: server_error for 5xx,
    invalid_request_error for 4xx, code gateway_error, Envoy's response code details in the
    message."""
    config = loopback_config(stand_in, raw_upstream)
    # 1 s timeouts stand for the shipped ones (the route's idle_timeout is 600 s, the request
    # timeout unset) so that Envoy gives up within the test.
    virtual_hosts(config)[0]["routes"][0]["route"]["idle_timeout"] = "1s"
    http_connection_manager(config)["request_timeout"] = "1s"
    chat = json.dumps(CHAT).encode()
    async with EnvoyProcess(config, tmp_path) as envoy:
        answers = {
            "stream_idle_timeout": await post(f"{envoy.url}{GUARDED}?upstream=silent", chat),
            "upstream_reset_before_response_started{protocol_error}": await post(
                f"{envoy.url}{GUARDED}?upstream=garbage", chat
            ),
            "mismatch_between_content_length_and_the_length_of_the_mutated_body": await post(
                f"{envoy.url}{GUARDED}?bad-length", chat
            ),
            "http1.headers_too_large": await post(
                f"{envoy.url}/v1/chat/completions", chat, {"x-large": "a" * 70 * 1024}
            ),
            "request_overall_timeout": await headers_only(
                envoy.listener_port, "/v1/chat/completions"
            ),
        }
    statuses = {details: answer[0] for details, answer in answers.items()}
    assert list(statuses.values()) == [504, 502, 503, 431, 408]
    for details, answer in answers.items():
        server = answer[0] >= 500
        error_type = "server_error" if server else "invalid_request_error"
        assert_envoy_answer(answer, answer[0], "gateway_error", error_type)
        verb = "failed" if server else "refused"
        message = json.loads(answer[2])["error"]["message"]
        assert message == f"the gateway {verb} this request: {details}"


async def test_vllms_own_answers_pass_byte_for_byte(
    tmp_path: Path, stand_in: int, raw_upstream: int
) -> None:
    """vLLM's error answers are not Envoy's local replies: no mapper touches them, the 503s
    and the bare 503 included (status, body and content-type as vLLM sent them)."""
    direct, through = {}, {}
    chat = json.dumps(CHAT).encode()
    async with EnvoyProcess(loopback_config(stand_in, raw_upstream), tmp_path) as envoy:
        for name in [*VLLM_ERRORS, "bare-503"]:
            direct[name] = await post(f"http://127.0.0.1:{raw_upstream}{GUARDED}?vllm={name}", chat)
            through[name] = await post(f"{envoy.url}{GUARDED}?vllm={name}", chat)
    assert [status for status, _, _ in through.values()] == [400, 404, 500, 503, 503]
    for name, (status, headers, body) in through.items():
        assert (status, body) == direct[name][:1] + direct[name][2:], name
        assert body == VLLM_ERRORS.get(name, b""), name
        assert headers.get("content-type") == direct[name][1].get("content-type"), name
        assert "x-kvguard-reason" not in headers and "retry-after" not in headers, name
