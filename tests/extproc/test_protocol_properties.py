"""Property-based: whatever a client sends, every ext_proc stream ends in a valid pass or in a
response from docs/design.md's status table, never a gRPC error, and the ledger returns to zero.

The kvguard service runs on its own event loop in a thread; hypothesis drives real gRPC streams.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard import config as configs
from kvguard.app import Service
from kvguard.errors import Code
from kvguard.testing.wait import wait_until_sync
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, headers

MAX_BODY = 64 * 1024
STATUS_OF = {code.value: code.status for code in Code}
CAPS = {"pro": 512, "free": 64}


class Harness:
    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        path = write_config(tmp, kvguard_config(max_body_bytes=MAX_BODY, max_model_len=2048))
        self.service = self.call(self._start(path))

    async def _start(self, path: Path) -> Service:
        service = Service(configs.load(path, environ={}))
        await service.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        return service

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def stream(self, hdrs: dict[str, str], raw: bytes | None, tenant: str | None) -> Any:
        call = self.stub.Process()
        await call.write(headers("/v1/chat/completions", hdrs, eos=raw is None, tenant=tenant))
        answers = [await call.read()]
        if raw is not None and answers[0].WhichOneof("response") != "immediate_response":
            await call.write(body(raw))
            # A slow decision is preceded by a request for more time, as Envoy allows.
            while (answer := await call.read()).WhichOneof("response") is None:
                assert answer.HasField("override_message_timeout"), answer
            answers.append(answer)
        await call.done_writing()
        return answers

    async def reserved(self) -> int:
        await self.service.keeper.settle()
        return (await self.service.ledger.usage("qwen")).reserved

    def close(self) -> None:
        self.call(self.channel.close())
        self.call(self.service.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("props"))
    yield h
    h.close()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
limits = st.one_of(
    st.integers(min_value=-5, max_value=10**12),
    st.floats(),
    st.booleans(),
    st.text(max_size=5),
    st.none(),
    st.just(0),
    st.just(1),
    st.just(2**63),
)
content = st.one_of(
    st.text(max_size=300),
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=50)}), max_size=3
    ),
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "x"])}),
        max_size=2,
    ),
    json_values,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bogus"])},
    optional={"content": content, "name": st.text(max_size=5), "tool_calls": json_values},
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["qwen", "other-model", ""]) | json_values},
    optional={
        "messages": st.lists(message, max_size=4) | json_values,
        "max_tokens": limits,
        "max_completion_tokens": limits,
        "n": limits,
        "stream": st.booleans(),
        "add_generation_prompt": json_values,
        "continue_final_message": json_values,
        "chat_template_kwargs": json_values,
        "tools": json_values,
        "extra": json_values,
    },
)


def raw_bodies() -> st.SearchStrategy[bytes]:
    encoded = chat_bodies.map(lambda b: json.dumps(b, allow_nan=True).encode())
    return st.one_of(
        encoded,
        encoded.flatmap(lambda raw: st.integers(0, len(raw)).map(lambda cut: raw[:cut])),
        st.binary(max_size=200),
        st.just(b'{"model": "qwen", "model": 5, "messages": [{"role": "user", "content": "x"}]}'),
        st.just(b"[" * 10000 + b"]" * 10000),
        st.just(
            b'{"model": "qwen", "messages": [{"role": "user", "content": "'
            + b"a" * MAX_BODY
            + b'"}]}'
        ),
        st.integers(MAX_BODY - 200, MAX_BODY + 200).map(
            lambda size: (
                (b'{"model":"qwen","messages":[{"role":"user","content":"' + b"w " * size)[:size]
                + b'"}]}'
            )
        ),
    )


def check_answer(answer: Any, tenant: str | None) -> None:
    kind = answer.WhichOneof("response")
    if kind == "immediate_response":
        immediate = answer.immediate_response
        hdrs = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
        error = json.loads(immediate.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] in STATUS_OF and hdrs["x-kvguard-reason"] == error["code"]
        assert immediate.status.code == STATUS_OF[error["code"]]
        assert hdrs["content-type"] == "application/json"
        assert error["code"] != "internal_error", error
        return
    assert kind in ("request_headers", "request_body"), answer
    if kind == "request_body":
        common = answer.request_body.response
        hdrs = {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }
        assert int(hdrs["x-kvguard-blocks"]) > 0
        if common.HasField("body_mutation"):
            sent = json.loads(common.body_mutation.body)
            assert hdrs["content-length"] == str(len(common.body_mutation.body))
            cap = CAPS["pro" if tenant == "acme" else "free"]
            for key in ("max_tokens", "max_completion_tokens"):
                if key in sent and sent[key] is not None:
                    assert type(sent[key]) is int and 1 <= sent[key] <= cap


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    raw=st.one_of(st.none(), raw_bodies()),
    tenant=st.sampled_from([None, "acme", "", "someone", "x" * 300]),
    spoof=st.dictionaries(
        st.sampled_from(
            [
                "x-kvguard-lease",
                "x-kvguard-blocks",
                "x-kvguard-prompt-tokens",
                "x-gateway-destination-endpoint",
                "x-gateway-destination-endpoint-served",
                "x-gateway-destination-endpoint-subset",
            ]
        ),
        st.text(alphabet="abc123", max_size=5),
        max_size=3,
    ),
)
def test_every_stream_ends_in_a_pass_or_a_table_response(
    harness: Harness, raw: bytes | None, tenant: str | None, spoof: dict[str, str]
) -> None:
    answers = harness.call(harness.stream(spoof, raw, tenant))
    removed = list(answers[0].request_headers.response.header_mutation.remove_headers)
    if answers[0].WhichOneof("response") == "request_headers":
        assert sorted(removed) == sorted(spoof)
    for answer in answers:
        check_answer(answer, tenant)
    wait_until_sync(lambda: harness.call(harness.reserved()) == 0, "the stream's lease to end")
