"""Counting through the real in-process gRPC service: large prompts are counted off the event
loop, slow decisions ask Envoy for more time, queued counting work is bounded, and what vLLM
would refuse (a failing template, undeclared media, prompt embeddings) is a clear 400."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvguard.app import Service
from kvguard.config.schema import COUNTING_BUDGET_S
from kvguard.testing.wait import wait_until
from kvguard.tokens.counting import LONG_WORK_BYTES, PromptCounter, work_bytes
from kvguard.tokens.request import parse
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.extproc.harness import (
    body,
    headers,
    refusal,
    released,
    reserved,
    running,
    set_headers,
)

# A template that fails for one content, to see a render error become a 400.
TEMPLATE = (
    "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom here') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BIG_TIERS = {
    "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 100_000},
    "pro": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 100_000},
}


def serving_big(tmp_path: Path) -> Any:
    """The Service with room for 32k-token prompts (context length, blocks, tier caps)."""
    return running(tmp_path, max_model_len=40_000, blocks=100_000, tiers=BIG_TIERS)


async def open_call(stub: Any, path: str, payload: Any) -> Any:
    """A stream that has sent its headers (answered) and its body (answer not read yet)."""
    call = stub.Process()
    await call.write(headers(path, tenant="anyone"))
    assert (await call.read()).WhichOneof("response") == "request_headers"
    await call.write(body(payload))
    return call


async def body_answer(call: Any) -> tuple[pb.ProcessingResponse, list[pb.ProcessingResponse]]:
    """The answer to the body, and the timeout extensions Envoy was sent before it."""
    extensions = []
    while (answer := await call.read()).WhichOneof("response") is None:
        assert answer.HasField("override_message_timeout"), answer
        extensions.append(answer)
    return answer, extensions


def chat(text: str) -> dict[str, Any]:
    return {"model": "qwen", "messages": [{"role": "user", "content": text}]}


def big_chat(tokens: int) -> dict[str, Any]:
    return chat(" ".join(["token"] * tokens))


class PoolWatch:
    """Instruments a pool's tokenizer: notes when a count starts on a worker thread, and can
    hold pool counts (after their real work) until released, with a deadline. Counts on the
    event loop's thread pass straight through."""

    def __init__(self, tokenizer: PoolTokenizer, *, gated: bool) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        if not gated:
            self.release.set()
        self.lock = threading.Lock()
        self.running = self.most_running = 0
        self._count_many = tokenizer.count_many

    def count_many(self, texts: list[str], special: bool, stop_at: int | None = None) -> list[int]:
        if threading.current_thread() is threading.main_thread():
            return self._count_many(texts, special, stop_at)
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.started.release()
        try:
            counts = self._count_many(texts, special, stop_at)
            assert self.release.wait(10), "never released"
            return counts
        finally:
            with self.lock:
                self.running -= 1

    async def wait_started(self, count: int = 1) -> None:
        for _ in range(count):
            assert await asyncio.to_thread(self.started.acquire, True, 10), "no count started"


def watch(service: Service, monkeypatch: pytest.MonkeyPatch, *, gated: bool) -> PoolWatch:
    tokenizer = service.policy.pools["qwen"].tokenizer
    spy = PoolWatch(tokenizer, gated=gated)
    monkeypatch.setattr(tokenizer, "count_many", spy.count_many)
    return spy


async def test_large_prompt_in_flight_does_not_hold_back_a_small_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_big(tmp_path) as (service, stub):
        spy = watch(service, monkeypatch, gated=False)
        big = await open_call(stub, "/v1/chat/completions", big_chat(32_000))
        await spy.wait_started()  # the 32k-token count is now running on a worker thread
        small = await open_call(stub, "/v1/chat/completions", chat("Say hello in French."))
        finished: list[str] = []

        async def decided(name: str, call: Any) -> pb.ProcessingResponse:
            answer, _ = await body_answer(call)
            finished.append(name)
            return answer

        big_answer, small_answer = await asyncio.gather(
            decided("big", big), decided("small", small)
        )
        assert finished == ["small", "big"]
        assert spy.most_running == 1  # only the large body went to the pool
        big_tokens = int(set_headers(big_answer.request_body.response)["x-kvguard-prompt-tokens"])
        assert big_tokens > 32_000
        tokenizer = service.policy.pools["qwen"].tokenizer
        small_tokens = tokenizer.count(tokenizer.render_chat(chat("Say hello in French.")), False)
        hdrs = set_headers(small_answer.request_body.response)
        assert hdrs["x-kvguard-prompt-tokens"] == str(small_tokens)
        for call in (big, small):
            await call.done_writing()
        await wait_until(lambda: released(service), "every lease to be released")


async def test_a_slow_decision_asks_envoy_for_more_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_big(tmp_path) as (service, stub):
        spy = watch(service, monkeypatch, gated=True)
        call = await open_call(stub, "/v1/chat/completions", big_chat(8_000))
        await spy.wait_started()
        extension = await call.read()  # sent while the count is still held on its thread
        assert extension.WhichOneof("response") is None
        assert extension.override_message_timeout.ToMilliseconds() == (COUNTING_BUDGET_S * 1000)
        spy.release.set()
        answer, more = await body_answer(call)
        assert more == []  # once per message
        assert "x-kvguard-lease" in set_headers(answer.request_body.response)
        # A quick decision is answered directly.
        fast = await open_call(stub, "/v1/chat/completions", chat("hi"))
        answer, extensions = await body_answer(fast)
        assert (answer.WhichOneof("response"), extensions) == ("request_body", [])


async def test_a_stream_gone_while_counting_reserves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_big(tmp_path) as (service, stub):
        spy = watch(service, monkeypatch, gated=True)
        call = await open_call(stub, "/v1/chat/completions", big_chat(8_000))
        await spy.wait_started()
        call.cancel()
        counter = service.admission.counter
        spy.release.set()
        await wait_until(lambda: _idle(counter), "the counter to be idle")
        # A whole exchange after it: had the abandoned decision gone on, it would hold blocks.
        after = await open_call(stub, "/v1/chat/completions", chat("hi"))
        assert (await body_answer(after))[0].WhichOneof("response") == "request_body"
        await after.done_writing()
        await wait_until(lambda: released(service), "every lease to be released")
        assert service.keeper.open_leases == 0


async def _idle(counter: PromptCounter) -> bool:
    return counter.pending_bytes == 0


async def test_a_flood_of_large_prompts_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = big_chat(16_000)  # a long count (above LONG_WORK_BYTES): two at a time
    raw = json.dumps(payload).encode()
    async with serving_big(tmp_path) as (service, stub):
        tokenizer = service.policy.pools["qwen"].tokenizer
        size = work_bytes(tokenizer, parse("chat", raw), len(raw), 40_000)
        assert size > LONG_WORK_BYTES
        service.admission.counter.close()
        service.admission.counter = PromptCounter(workers=2, pending_bytes=3 * size)
        spy = watch(service, monkeypatch, gated=True)
        calls = [await open_call(stub, "/v1/chat/completions", payload) for _ in range(6)]
        answers = [asyncio.create_task(body_answer(call)) for call in calls]
        await spy.wait_started(2)
        # Two counting, one waiting: the other three are refused at once, while those still wait.
        while sum(task.done() for task in answers) < 3:
            await asyncio.wait(answers, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        refused = [task.result() for task in answers if task.done()]
        assert len(refused) == 3
        for answer, _ in refused:
            status, hdrs, error = refusal(answer)
            assert (status, hdrs["retry-after"], error["error"]["code"]) == (
                503,
                "1",
                "internal_error",
            )
            assert "busy counting" in error["error"]["message"]
        assert service.admission.counter.pending_bytes == 3 * size
        spy.release.set()
        admitted = [answer for answer, _ in await asyncio.gather(*answers)]
        assert sum(a.WhichOneof("response") == "request_body" for a in admitted) == 3
        assert spy.most_running == 2  # never more counts at once than worker threads
        for call in calls:
            await call.done_writing()
        await wait_until(lambda: released(service), "every lease to be released")
        assert service.admission.counter.pending_bytes == 0


@pytest.mark.parametrize(
    ("path", "payload", "param", "message"),
    [
        ("/v1/chat/completions", chat("boom"), "messages", "failed to render: no boom here"),
        (
            "/v1/chat/completions",
            {
                "model": "qwen",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "AA"}}],
                    }
                ],
            },
            "messages",
            "'input_audio': this pool counts text only",
        ),
        (
            "/v1/completions",
            {"model": "qwen", "prompt": "x", "prompt_embeds": "AAAA"},
            "prompt_embeds",
            "prompt_embeds",
        ),
        ("/v1/completions", {"model": "qwen", "prompt": ""}, "prompt", "non-empty"),
        ("/v1/completions", {"model": "qwen", "prompt": [" ", ""]}, "prompt", "empty"),
    ],
)
async def test_what_vllm_would_refuse_is_a_clear_400(
    tmp_path: Path, path: str, payload: Any, param: str, message: str
) -> None:
    (tmp_path / "strict.jinja").write_text(TEMPLATE, encoding="utf-8")
    pool = {"chat_template": "strict.jinja", "media_tokens": {"image_url": 100}}
    async with running(tmp_path, pool=pool) as (service, stub):
        answer, _ = await body_answer(await open_call(stub, path, payload))
        status, hdrs, error = refusal(answer)
        assert (status, hdrs["x-kvguard-reason"], error["error"]["param"]) == (
            400,
            "invalid_request",
            param,
        )
        assert message in error["error"]["message"]
        assert await reserved(service) == 0


async def test_declared_media_costs_are_counted(tmp_path: Path) -> None:
    (tmp_path / "strict.jinja").write_text(TEMPLATE, encoding="utf-8")
    pool = {"chat_template": "strict.jinja", "media_tokens": {"image_url": 100}}
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    content = [image, {"type": "text", "text": "What is this?"}, image]
    async with running(tmp_path, pool=pool) as (service, stub):
        tokenizer = service.policy.pools["qwen"].tokenizer
        text_only = tokenizer.count(tokenizer.render_chat(chat("What is this?")), False)
        payload = {"model": "qwen", "messages": [{"role": "user", "content": content}]}
        answer, _ = await body_answer(await open_call(stub, "/v1/chat/completions", payload))
        hdrs = set_headers(answer.request_body.response)
        assert hdrs["x-kvguard-prompt-tokens"] == str(text_only + 200)


async def test_truncation_and_echo_reserve_what_vllm_will_hold(tmp_path: Path) -> None:
    async with running(tmp_path, max_model_len=64) as (_, stub):
        long = {"model": "qwen", "prompt": " ".join(["token"] * 500)}
        answer, _ = await body_answer(
            await open_call(stub, "/v1/completions", {**long, "truncate_prompt_tokens": 20})
        )
        hdrs = set_headers(answer.request_body.response)
        assert (hdrs["x-kvguard-prompt-tokens"], hdrs["x-kvguard-blocks"]) == ("20", "4")  # +32
        # -1: vLLM keeps what fits beside the output limit, which kvguard lowers to what is left.
        answer, _ = await body_answer(
            await open_call(stub, "/v1/completions", {**long, "truncate_prompt_tokens": -1})
        )
        common = answer.request_body.response
        assert set_headers(common)["x-kvguard-prompt-tokens"] == "63"
        assert json.loads(common.body_mutation.body)["max_tokens"] == 1
        # echo with max_tokens 0: the prompt comes back, one step runs; the body is untouched.
        echo = {"model": "qwen", "prompt": "Once upon a time", "echo": True, "max_tokens": 0}
        answer, _ = await body_answer(await open_call(stub, "/v1/completions", echo))
        common = answer.request_body.response
        assert not common.HasField("body_mutation")
        assert (
            set_headers(common)["x-kvguard-prompt-tokens"],
            set_headers(common)["x-kvguard-blocks"],
        ) == ("4", "1")
