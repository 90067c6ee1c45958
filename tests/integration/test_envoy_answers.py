"""What the client sees from the shipped envoy/envoy.yaml when Envoy answers by itself: kvguard
unreachable, its message timeout, a body above the buffer limit, vLLM unreachable, each in the
OpenAI error schema with a reason; and kvguard's own answers byte for byte as kvguard built them.

A small ext_proc stand-in plays kvguard where the test needs it to refuse, hang or pass."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from kvguard.errors import Code, Refusal
from kvguard.extproc import responses
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.upstream import RecordingUpstream

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
# Above envoy.yaml's 16 MiB per_connection_buffer_limit_bytes.
ABOVE_ENVOYS_BUFFER = 17 * 1024 * 1024


def refusal_for(code: Code) -> Refusal:
    retry = 1 if code.status in (429, 503) else None
    return Refusal(code, f'refused: {code.value} (é, "quoted")', "model", retry)


class StandIn(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Answers by path: /refuse/<code> gets kvguard's refusal, /hang never gets an answer to its
    body, anything else passes."""

    async def Process(self, requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                path = next(
                    h.raw_value.decode()
                    for h in message.request_headers.headers.headers
                    if h.key == ":path"
                )
                code = path.removeprefix("/refuse/")
                if code != path:
                    await context.write(responses.refusal(refusal_for(Code(code))))
                    continue
                if path == "/hang":
                    await asyncio.Event().wait()  # until Envoy gives up and ends the stream
                await context.write(responses.request_headers([], guarded=True))
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


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    server = RecordingUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def post(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as client,
        client.post(url, data=data, headers={"content-type": "application/json"}) as response,
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
        answer = await post(f"{envoy.url}/hang", json.dumps(CHAT).encode())
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
            answers[code] = await post(f"{envoy.url}/refuse/{code.value}", b"{}")
    for code, (status, headers, body) in answers.items():
        built = responses.refusal(refusal_for(code)).immediate_response
        sent = {h.header.key: h.header.raw_value.decode() for h in built.headers.set_headers}
        assert (status, body) == (built.status.code, built.body), code
        assert {k: headers.get(k) for k in sent} == sent, code
        assert not {k for k in headers if k.startswith("x-kvguard-")} - sent.keys(), code
    assert upstream.requests == []
