"""Protocol tests: ProcessingRequests in, ProcessingResponses out, over a real gRPC stream
to a kvguard service running in this process (memory ledger, real Qwen tokenizer)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvguard import config as configs
from kvguard.server import Service
from tests.conftest import kvguard_config, write_config


@asynccontextmanager
async def running(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Service, Any]]:
    path = write_config(tmp_path, kvguard_config(**overrides))
    service = Service(configs.load(path, environ={}))
    await service.grpc.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    try:
        yield service, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await service.grpc.stop(0)


def headers(
    path: str,
    extra: dict[str, str] | None = None,
    *,
    eos: bool = False,
    tenant: str | None = "acme",
) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": path, "content-type": "application/json"}
    if tenant is not None:
        values["x-tenant-id"] = tenant
    values.update(extra or {})
    header_map = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=eos)
    )


def body(payload: Any) -> pb.ProcessingRequest:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def response_headers(status: int) -> pb.ProcessingRequest:
    header_map = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map))


async def exchange(stub: Any, *messages: pb.ProcessingRequest) -> tuple[Any, list[Any]]:
    """Send messages one at a time, reading one answer each (as Envoy does)."""
    call = stub.Process()
    answers = []
    for message in messages:
        await call.write(message)
        answers.append(await call.read())
    return call, answers


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def refusal(answer: pb.ProcessingResponse) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, hdrs, json.loads(immediate.body)


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.01)


async def reserved(service: Service) -> int:
    return (await service.ledger.usage("qwen")).reserved


HI = '{"model": "qwen", "messages": [{"role": "user", "content": "hi"}]'
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


async def test_admitted_chat_is_clamped_and_released_at_the_end(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        call, (on_headers, on_body) = await exchange(
            stub,
            headers("/v1/chat/completions", {"x-kvguard-lease": "spoofed"}),
            body({**CHAT, "max_tokens": 100000}),
        )
        removed = on_headers.request_headers.response.header_mutation.remove_headers
        assert list(removed) == ["x-kvguard-lease"]
        common = on_body.request_body.response
        sent = json.loads(common.body_mutation.body)
        assert sent["max_tokens"] == 512  # the pro tier's cap
        hdrs = set_headers(common)
        assert hdrs["content-length"] == str(len(common.body_mutation.body))
        expected_prompt = service.policy.pools["qwen"].tokenizer.count(
            service.policy.pools["qwen"].tokenizer.render_chat(CHAT), False
        )
        assert hdrs["x-kvguard-prompt-tokens"] == str(expected_prompt)
        blocks = math.ceil((expected_prompt + 512) / 16)
        assert hdrs["x-kvguard-blocks"] == str(blocks)
        assert await reserved(service) == blocks

        await call.write(response_headers(200))
        assert (await call.read()).WhichOneof("response") == "response_headers"
        assert await reserved(service) == blocks  # held until the exchange ends
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await wait_until(lambda: _is_zero(service))


async def _is_zero(service: Service) -> bool:
    return await reserved(service) == 0


async def test_cancelled_stream_releases_its_lease(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        call, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        assert await reserved(service) > 0
        call.cancel()
        await wait_until(lambda: _is_zero(service))


async def test_limits_within_the_cap_leave_the_body_untouched(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, stub):
        _, (_, on_body) = await exchange(
            stub, headers("/v1/chat/completions?stream=1"), body({**CHAT, "max_tokens": 10})
        )
        common = on_body.request_body.response
        assert not common.HasField("body_mutation")
        assert "x-kvguard-lease" in set_headers(common)


async def test_unguarded_path_is_not_buffered(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        _, (answer,) = await exchange(stub, headers("/v1/models", {"x-kvguard-blocks": "9"}))
        assert answer.mode_override.request_body_mode == answer.mode_override.NONE
        assert answer.mode_override.response_header_mode == answer.mode_override.SKIP
        removed = answer.request_headers.response.header_mutation.remove_headers
        assert list(removed) == ["x-kvguard-blocks"]
        assert await reserved(service) == 0


async def test_completion_batch_counts_each_prompt(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        tokenizer = service.policy.pools["qwen"].tokenizer
        prompts = ["Once upon a time", "The quick brown fox jumps"]
        _, (_, on_body) = await exchange(
            stub,
            headers("/v1/completions"),
            body({"model": "qwen", "prompt": prompts, "max_tokens": 20, "n": 2}),
        )
        counts = [tokenizer.count(p, True) for p in prompts]
        hdrs = set_headers(on_body.request_body.response)
        assert hdrs["x-kvguard-prompt-tokens"] == str(sum(counts))
        assert hdrs["x-kvguard-blocks"] == str(2 * sum(math.ceil((c + 20) / 16) for c in counts))
        _, (_, on_ids) = await exchange(
            stub,
            headers("/v1/completions"),
            body({"model": "qwen", "prompt": [[1, 2, 3], [4] * 30], "max_tokens": 2}),
        )
        hdrs = set_headers(on_ids.request_body.response)
        assert (hdrs["x-kvguard-prompt-tokens"], hdrs["x-kvguard-blocks"]) == ("33", "3")
        _, (_, mixed) = await exchange(
            stub, headers("/v1/completions"), body({"model": "qwen", "prompt": ["a", [1, 2]]})
        )
        assert refusal(mixed)[2]["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": "qwen", "messages": [], "max_tokens": 5}', "messages"),
        (
            b'{"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
            "max_tokens",
        ),
        (
            (HI + ', "max_tokens": 2.5}').encode(),
            "max_tokens",
        ),
        (b'{"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "n": true}', "n"),
        (
            (HI + ', "max_tokens": NaN}').encode(),
            None,
        ),
        (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b"\xff\xfe not utf-8", None),
    ],
)
async def test_malformed_bodies_get_400_and_reserve_nothing(
    tmp_path: Path, payload: bytes, param: str | None
) -> None:
    async with running(tmp_path) as (service, stub):
        _, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(payload))
        status, hdrs, error = refusal(answer)
        assert (status, hdrs["x-kvguard-reason"], error["error"]["code"]) == (
            400,
            "invalid_request",
            "invalid_request",
        )
        assert hdrs["content-type"] == "application/json"
        assert error["error"]["param"] == param
        assert error["error"]["type"] == "invalid_request_error"
        assert await reserved(service) == 0


async def test_guarded_request_without_body_is_invalid(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, stub):
        _, (answer,) = await exchange(stub, headers("/v1/completions", eos=True))
        assert refusal(answer)[0] == 400


async def test_unknown_tenant_without_default_tier_gets_401(tmp_path: Path) -> None:
    async with running(tmp_path, default_tier=None) as (_, stub):
        _, (answer,) = await exchange(stub, headers("/v1/chat/completions", tenant="stranger"))
        status, _hdrs, error = refusal(answer)
        assert (status, error["error"]["code"]) == (401, "unknown_tenant")
        _, (missing,) = await exchange(stub, headers("/v1/chat/completions", tenant=None))
        assert refusal(missing)[0] == 401


async def test_body_over_the_limit_gets_413(tmp_path: Path) -> None:
    async with running(tmp_path, max_body_bytes=1000) as (_, stub):
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
        _, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(big))
        assert refusal(answer)[:2][0] == 413
        assert refusal(answer)[2]["error"]["code"] == "request_too_large"


async def test_unknown_model_and_too_long_prompt(tmp_path: Path) -> None:
    async with running(tmp_path, max_model_len=64) as (_, stub):
        _, (_, unknown) = await exchange(
            stub, headers("/v1/chat/completions"), body({**CHAT, "model": "gpt-9"})
        )
        assert refusal(unknown)[2]["error"]["code"] == "model_not_found"
        long = {"model": "qwen", "prompt": "word " * 100}
        _, (_, too_long) = await exchange(stub, headers("/v1/completions"), body(long))
        assert refusal(too_long)[:1] == (400,)
        assert refusal(too_long)[2]["error"]["code"] == "context_length_exceeded"


async def test_request_that_can_never_fit_gets_400(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        # pro: 512 tokens x n=20 -> far more than the 400-block quota.
        _, (_, answer) = await exchange(
            stub, headers("/v1/chat/completions"), body({**CHAT, "max_tokens": 512, "n": 20})
        )
        status, hdrs, error = refusal(answer)
        assert (status, error["error"]["code"]) == (400, "request_exceeds_capacity")
        assert "retry-after" not in hdrs
        assert await reserved(service) == 0


async def test_tenant_quota_then_watermark_give_429(tmp_path: Path) -> None:
    # free tier: 40 blocks; each request: prompt ~14 + 32 tokens = 3 blocks of 16.
    async with running(tmp_path, blocks=100, watermark=0.5) as (service, stub):
        calls = []
        for _ in range(13):
            call, (_, answer) = await exchange(
                stub, headers("/v1/chat/completions", tenant="freeloader"), body(CHAT)
            )
            assert answer.WhichOneof("response") == "request_body"
            calls.append(call)
        _, (_, over) = await exchange(
            stub, headers("/v1/chat/completions", tenant="freeloader"), body(CHAT)
        )
        status, hdrs, error = refusal(over)
        assert (status, error["error"]["code"], hdrs["retry-after"]) == (
            429,
            "tenant_block_quota_exceeded",
            "1",
        )
        assert hdrs["x-kvguard-reason"] == "tenant_block_quota_exceeded"
        # Another free tenant fills the pool to its limit of 50 blocks: 39 + 3 + 3 + 3 = 48.
        for _ in range(3):
            call, (_, answer) = await exchange(
                stub, headers("/v1/chat/completions", tenant="other"), body(CHAT)
            )
            assert answer.WhichOneof("response") == "request_body"
            calls.append(call)
        _, (_, full) = await exchange(
            stub, headers("/v1/chat/completions", tenant="third"), body(CHAT)
        )
        assert refusal(full)[0] == 429
        assert refusal(full)[2]["error"]["code"] == "kv_cache_watermark_exceeded"
        assert await reserved(service) == 48
        for call in calls:
            await call.done_writing()
        await wait_until(lambda: _is_zero(service))


async def test_shadow_mode_passes_what_it_would_refuse(tmp_path: Path) -> None:
    async with running(tmp_path, shadow=True) as (service, stub):
        _, (_, answer) = await exchange(
            stub, headers("/v1/chat/completions"), body({**CHAT, "max_tokens": 512, "n": 20})
        )
        hdrs = set_headers(answer.request_body.response)
        assert hdrs == {"x-kvguard-would-refuse": "request_exceeds_capacity"}
        _, (_, bad) = await exchange(stub, headers("/v1/chat/completions"), body(b"{"))
        assert refusal(bad)[0] == 400  # malformed input is refused even in shadow mode
        assert await reserved(service) == 0


async def test_internal_fault_answers_503_not_a_silent_pass(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):

        async def broken(*_: object) -> None:
            raise RuntimeError("ledger exploded")

        service.admission.ledger.reserve = broken  # type: ignore[method-assign]
        _, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        status, _, error = refusal(answer)
        assert (status, error["error"]["code"]) == (503, "internal_error")
        assert "exploded" not in error["error"]["message"]


async def test_health_answers_serving(tmp_path: Path) -> None:
    async with (
        running(tmp_path) as (service, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}") as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness"):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        service.health.set("draining", True)

        async def not_serving() -> bool:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            return answer.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving)
        live = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING
