"""Protocol tests: ProcessingRequests in, ProcessingResponses out, over a real gRPC stream
to a kvguard service running in this process (memory ledger, real Qwen tokenizer)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvguard.admission.calibration import DEFAULT_DECODE_RATE
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.promises import JITTER_S
from kvguard.app import Service
from kvguard.testing.wait import wait_until
from tests.extproc.harness import (
    body,
    exchange,
    headers,
    refusal,
    reserved,
    response_headers,
    running,
    set_headers,
)

HI = '{"model": "qwen", "messages": [{"role": "user", "content": "hi"}]'
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Say hello in French."}]}


async def test_admitted_chat_is_clamped_and_released_at_the_end(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        call, (on_headers, on_body) = await exchange(
            stub,
            headers(
                "/v1/chat/completions",
                {"x-kvguard-lease": "spoofed", "x-gateway-destination-endpoint-subset": "a"},
            ),
            body({**CHAT, "max_tokens": 100000}),
        )
        removed = on_headers.request_headers.response.header_mutation.remove_headers
        assert list(removed) == ["x-kvguard-lease", "x-gateway-destination-endpoint-subset"]
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
        await wait_until(lambda: _is_zero(service), "every lease to be released")


async def test_a_second_body_message_neither_decides_again_nor_loses_the_lease(
    tmp_path: Path,
) -> None:
    """Envoy sends one buffered body; a stream with two still holds one lease, released at
    its end."""
    async with running(tmp_path) as (service, stub):
        call, (_, first, second) = await exchange(
            stub, headers("/v1/chat/completions"), body(CHAT), body(CHAT)
        )
        assert "x-kvguard-lease" in set_headers(first.request_body.response)
        assert not second.request_body.response.HasField("header_mutation")
        assert (await service.ledger.usage("qwen")).leases == 1
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await wait_until(lambda: _is_zero(service), "every lease to be released")
        assert service.keeper.open_leases == 0


async def _is_zero(service: Service) -> bool:
    return await reserved(service) == 0


async def _reserved_is(service: Service, blocks: int) -> bool:
    return await reserved(service) == blocks


async def test_cancelled_stream_releases_its_lease(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        call, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        assert await reserved(service) > 0
        call.cancel()
        await wait_until(lambda: _is_zero(service), "every lease to be released")


async def test_limits_within_the_cap_leave_the_body_untouched(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, stub):
        _, (_, on_body) = await exchange(
            stub, headers("/v1/chat/completions?stream=1"), body({**CHAT, "max_tokens": 10})
        )
        common = on_body.request_body.response
        assert not common.HasField("body_mutation")
        assert "x-kvguard-lease" in set_headers(common)


@pytest.mark.parametrize("expose", [True, False])
async def test_the_applied_limit_is_dynamic_metadata_when_exposed(
    tmp_path: Path, expose: bool
) -> None:
    """envoy.yaml's route turns it into x-kvguard-max-tokens; nothing when not enabled."""
    async with running(tmp_path, expose_limit_header=expose) as (_, stub):
        answers = []
        for limit in ({"max_tokens": 100000}, {}):  # clamped to the cap; injected
            _, (_, on_body) = await exchange(
                stub, headers("/v1/chat/completions"), body({**CHAT, **limit})
            )
            answers.append(on_body)
        shown = [metadata(a).get("max_tokens") for a in answers]
        assert shown == (["512", "128"] if expose else [None, None])  # pro's cap, its default


def metadata(answer: ProcessingResponse) -> dict[str, str]:
    """The dynamic metadata an answer sets in kvguard's namespace ({} when none)."""
    found: dict[str, dict[str, str]] = json_format.MessageToDict(answer.dynamic_metadata)
    assert found.keys() <= {"envoy.filters.http.ext_proc"}
    return found.get("envoy.filters.http.ext_proc", {})


async def test_the_decision_is_dynamic_metadata_for_the_access_log(tmp_path: Path) -> None:
    """What envoy.yaml's access log shows comes from kvguard's answers, never from headers the
    client sent: admitted, refused at the body, refused at the headers."""
    forged = {"x-kvguard-lease": "forged", "x-kvguard-blocks": "1"}
    async with running(tmp_path, tenants={"acme": "pro"}, default_tier=None) as (_, stub):
        _, (_, admitted) = await exchange(stub, headers("/v1/chat/completions", forged), body(CHAT))
        _, (_, refused) = await exchange(
            stub, headers("/v1/chat/completions", forged), body({**CHAT, "model": "nope"})
        )
        _, (unknown,) = await exchange(
            stub, headers("/v1/chat/completions", forged, tenant="victim")
        )
    sent = set_headers(admitted.request_body.response)
    assert metadata(admitted) == {
        "tenant": "acme",
        "lease": sent["x-kvguard-lease"],
        "blocks": sent["x-kvguard-blocks"],
        "prompt_tokens": sent["x-kvguard-prompt-tokens"],
        "reserved_output": sent["x-kvguard-reserved-output"],
        "ratelimit": metadata(admitted)["ratelimit"],
        "ratelimit_policy": '"kv";q=400',  # the pro tier's quota
        "max_tokens": "128",  # the pro tier's default, injected
    }
    # What the tenant could reserve next: at most its quota less this request's blocks.
    remaining = re.fullmatch(r'"kv";r=([0-9]+);t=0', metadata(admitted)["ratelimit"])
    assert remaining is not None and int(remaining[1]) <= 400 - int(sent["x-kvguard-blocks"])
    assert sent["x-kvguard-lease"] != "forged"
    assert refusal(refused)[0] == 404 and metadata(refused) == {"tenant": "acme"}
    assert refusal(unknown)[0] == 401 and metadata(unknown) == {}


async def test_unguarded_path_is_not_buffered(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        _, (answer,) = await exchange(
            stub,
            headers(
                "/v1/models",
                {
                    ":method": "GET",
                    "x-kvguard-blocks": "9",
                    "x-gateway-destination-endpoint": "10.0.0.9:8000",
                },
            ),
        )
        assert answer.mode_override.request_body_mode == answer.mode_override.NONE
        assert answer.mode_override.response_header_mode == answer.mode_override.SKIP
        removed = answer.request_headers.response.header_mutation.remove_headers
        assert list(removed) == ["x-kvguard-blocks", "x-gateway-destination-endpoint"]
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
        ((HI + ', "min_tokens": -1}').encode(), "min_tokens"),
        ((HI + ', "max_tokens": 100000, "min_tokens": 100000}').encode(), "min_tokens"),
        (b"\xff\xfe not utf-8", None),
        # Half a surrogate pair, escaped, in a field the body's rewrite re-encodes...
        ((HI + ', "user": "x\\ud800"}').encode(), None),
        # ... in the text the tokenizer encodes, and as bytes (not UTF-8).
        (b'{"model": "qwen", "messages": [{"role": "user", "content": "hi \\udc00"}]}', None),
        (b'{"model": "qwen", "messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}', None),
        # A repeated key: another parser may read the other value than kvguard metered.
        ((HI + ', "max_tokens": 99999, "max_tokens": 5}').encode(), "max_tokens"),
        (
            b'{"model": "qwen", "messages": [{"role": "user", "content": "a", "content": "b"}]}',
            "messages[0].content",
        ),
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


async def test_an_escaped_surrogate_pair_is_one_character_and_admitted(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        escaped = b'{"model": "qwen", "user": "\\ud83d\\ude00", "messages": [{"role": "user", '
        escaped += b'"content": "hi \\ud83d\\ude00"}]}'
        literal = json.dumps(json.loads(escaped), ensure_ascii=False).encode()
        counts, calls = [], []
        for payload in (escaped, literal):
            call, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(payload))
            calls.append(call)  # open until the test ends: its lease is held
            counts.append(set_headers(answer.request_body.response)["x-kvguard-prompt-tokens"])
        assert counts[0] == counts[1]
        assert (await service.ledger.usage("qwen")).leases == 2


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
        status, _, error = refusal(unknown)
        assert (status, error["error"]["code"], error["error"]["param"]) == (
            404,
            "model_not_found",
            "model",
        )
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
        assert (status, error["error"]["code"]) == (429, "tenant_block_quota_exceeded")
        assert hdrs["x-kvguard-reason"] == "tenant_block_quota_exceeded"
        # 2 blocks over the quota of 40: when the first of its leases is expected to end (its
        # 32 tokens at the decode rate assumed until one is measured), plus up to 0.5 s of
        # jitter.
        ms = int(hdrs["retry-after-ms"])
        assert 0 <= ms <= 1000 * (32 / DEFAULT_DECODE_RATE + JITTER_S) + 1
        assert (int(hdrs["retry-after"]), hdrs["x-should-retry"]) == (-(-ms // 1000), "true")
        assert len(hdrs["x-kvguard-retry-token"]) == 32
        assert hdrs["ratelimit-policy"] == '"kv";q=40'
        assert hdrs["ratelimit"] in {'"kv";r=1;t=1', '"kv";r=1;t=0'}
        # Another free tenant fills the pool's limit of 50 blocks, 39 + 3 + 3 + 3 = 48: the
        # freeloader's promise holds nothing of the pool's blocks.
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
        await wait_until(lambda: _is_zero(service), "every lease to be released")


async def test_a_retry_is_known_by_its_body_or_its_token_and_holds_nothing_meanwhile(
    tmp_path: Path,
) -> None:
    """The retry of a refused request is recognised by its body or by the token handed out;
    until its client is back, nothing is held for it: blocks that free serve another tenant's
    fresh request at once, and the retry takes the next ones."""
    async with running(tmp_path, blocks=100, watermark=0.5) as (service, stub):
        calls = []
        for i in range(16):  # 48 of the pool's 50 blocks, 3 a request
            call, _ = await exchange(
                stub, headers("/v1/chat/completions", tenant=f"t{i % 2}"), body(CHAT)
            )
            calls.append(call)
        waiting = {**CHAT, "user": "waiting"}
        _, (_, refused) = await exchange(
            stub, headers("/v1/chat/completions", tenant="u"), body(waiting)
        )
        token = refusal(refused)[1]["x-kvguard-retry-token"]
        _, (_, by_token) = await exchange(
            stub,
            headers("/v1/chat/completions", {"x-kvguard-retry-token": token}, tenant="u"),
            body({**CHAT, "user": "other"}),
        )
        assert refusal(by_token)[2]["error"]["code"] == "kv_cache_watermark_exceeded"
        assert (await service.ledger.usage("qwen")).promises == 1  # the same promise
        await calls.pop().done_writing()  # 45 reserved, 3 promised to the refused request
        await wait_until(lambda: _reserved_is(service, 45), "a lease to be released")
        fresh, (_, admitted) = await exchange(
            stub, headers("/v1/chat/completions", tenant="v"), body(CHAT)
        )
        assert admitted.WhichOneof("response") == "request_body"
        await calls.pop().done_writing()
        await wait_until(lambda: _reserved_is(service, 45), "another lease to be released")
        retry, (_, again) = await exchange(
            stub, headers("/v1/chat/completions", tenant="u"), body(waiting)
        )
        assert again.WhichOneof("response") == "request_body"
        usage = await service.ledger.usage("qwen")
        assert (usage.reserved, usage.promises) == (48, 0)  # the retry took its promise
        for call in [*calls, fresh, retry]:
            await call.done_writing()
        await wait_until(lambda: _is_zero(service), "every lease to be released")


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
        names = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness")
        for name in names:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        service.health.set("draining", True)

        async def not_serving() -> bool:
            answers = [
                await stub.Check(health_pb2.HealthCheckRequest(service=name)) for name in names[:3]
            ]
            return all(a.status == health_pb2.HealthCheckResponse.NOT_SERVING for a in answers)

        await wait_until(not_serving, "readiness to turn NOT_SERVING")
        live = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING


async def test_stop_releases_leases_of_streams_that_outlive_the_grace(tmp_path: Path) -> None:
    async with running(tmp_path) as (service, stub):
        call, _ = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        assert await reserved(service) > 0
        await service.stop(0.2)  # the stream is still open: cancelled after the grace
        assert await reserved(service) == 0
        assert service.keeper.open_leases == 0
        assert not service.health.ready
        call.cancel()


async def test_api_keys_map_to_tenants_by_their_hash_and_ignore_the_tenant_header(
    tmp_path: Path,
) -> None:
    key = "sk-acme-0123456789"
    digest = hashlib.sha256(key.encode()).hexdigest()
    async with running(tmp_path, default_tier=None) as (service, stub):
        tenancy = service.config.tenancy.model_copy(
            update={"identity": "api_key", "api_keys": {digest: "acme"}}
        )
        service.publish(dataclasses.replace(service.policy, tenancy=tenancy))
        bearer = {"authorization": f"Bearer {key}"}
        _, (_, admitted) = await exchange(
            stub, headers("/v1/chat/completions", bearer, tenant="spoofed"), body(CHAT)
        )
        lease = set_headers(admitted.request_body.response)["x-kvguard-lease"]
        assert lease
        assert (await service.ledger.usage("qwen")).tenants == {
            "acme": int(set_headers(admitted.request_body.response)["x-kvguard-blocks"])
        }
        wrong = {"authorization": "Bearer sk-not-a-key"}
        _, (refused,) = await exchange(stub, headers("/v1/chat/completions", wrong, tenant="acme"))
        assert refusal(refused)[0] == 401
        _, (no_key,) = await exchange(stub, headers("/v1/chat/completions", tenant="acme"))
        assert refusal(no_key)[0] == 401


async def test_a_queued_request_waits_against_the_pools_limit_as_it_is_now(
    tmp_path: Path,
) -> None:
    """A request queued for the watermark is admitted when the pool's capacity grows: each
    try reads the limit of the moment, not the one it arrived with."""
    queue = {"queue": {"max_wait_seconds": 20}}
    async with running(tmp_path, blocks=100, watermark=0.5, pool=queue) as (service, stub):
        calls = []
        for i in range(16):  # 48 of the limit of 50 blocks, 3 a request
            call, _ = await exchange(
                stub, headers("/v1/chat/completions", tenant=f"t{i % 2}"), body(CHAT)
            )
            calls.append(call)
        waiting = asyncio.ensure_future(
            exchange(stub, headers("/v1/chat/completions", tenant="u"), body({**CHAT, "user": "u"}))
        )
        await wait_until(lambda: service.queue.queued("qwen") == 1, "the request to queue")
        service.capacities.set("qwen", PoolCapacity(200, 16))  # limit 100; wakes the queue
        call, (_, answer) = await asyncio.wait_for(waiting, 10)
        assert answer.WhichOneof("response") == "request_body"
        assert await reserved(service) == 51
        for each in [*calls, call]:
            await each.done_writing()
        await wait_until(lambda: _is_zero(service), "every lease to be released")
