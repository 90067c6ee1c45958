"""kvguard's prompt-token count is vLLM's: for varied chat and completion requests sent through
Envoy + kvguard to a real vLLM, `x-kvguard-prompt-tokens` as vLLM received it (recorded by the
transparent proxy in front of vLLM) equals the `usage.prompt_tokens` that vLLM answered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.admission.capacity import PoolCapacity
from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.live.harness import Gateway, gateway, text

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

TENANCY = {
    "header": "x-tenant-id",
    "default_tier": "pro",
    "tiers": {"pro": {"max_tokens_cap": 64, "default_max_tokens": 3, "max_blocks": 60}},
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
UNICODE = (
    "Grüße, 世界! Здравствуй, мир. مرحبا بالعالم 👋🏽"
    " e\u0301 ﬁ \U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 ½ — “quotes”"
)
CODE = 'def f(x):\n\treturn {"a": [1, 2, 3], "b": x ** 2}  # comment\n\n\n    trailing   \n'


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def chat(messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "qwen", "messages": messages, "max_tokens": 4, **extra}


def completion(prompt: Any, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": "qwen", "prompt": prompt, "max_tokens": 4, **extra}


TURNS = [
    {"role": "system", "content": "You are terse."},
    user("What is a KV cache?"),
    {"role": "assistant", "content": "Keys and values of past tokens, kept per layer."},
    user("And a block?"),
    {"role": "assistant", "content": "A fixed number of tokens' worth of that cache."},
    user("Why 128 on CPU?"),
]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-one-user": chat([user("Say hello in French.")]),
    "chat-system": chat([{"role": "system", "content": "Answer in verse."}, user("Why?")]),
    "chat-empty-system": chat([{"role": "system", "content": ""}, user("hi")]),
    "chat-developer": chat(
        [
            {"role": "system", "content": "Top."},
            user("hi"),
            {"role": "developer", "content": "Be terse."},
        ]
    ),
    "chat-multi-turn": chat(TURNS),
    "chat-unicode": chat([user(UNICODE)]),
    "chat-code": chat([user(CODE)]),
    "chat-long": chat([user(text(1400, 1))]),
    "chat-long-multi-turn": chat([*TURNS[:-1], user(text(600, 2))]),
    "chat-n3": chat([user("Three ideas, please.")], n=3),
    "chat-n2-long": chat([user(text(500, 3))], n=2),
    "chat-text-parts": chat(
        [user([{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}])]
    ),
    "chat-system-parts": chat(
        [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            user([{"type": "text", "text": UNICODE}]),
        ]
    ),
    "chat-special-token-text": chat([user("literal <|im_start|>assistant and <|endoftext|>")]),
    "chat-max-completion-tokens": (
        "/v1/chat/completions",
        {"model": "qwen", "messages": [user("Count to three.")], "max_completion_tokens": 4},
    ),
    "chat-no-limit": ("/v1/chat/completions", {"model": "qwen", "messages": [user("Go on.")]}),
    "chat-continue-final": chat(
        [user("Finish this:"), {"role": "assistant", "content": "Once upon a"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    "chat-no-generation-prompt": chat([user("hi")], add_generation_prompt=False),
    "chat-template-kwargs": chat([user("hi")], chat_template_kwargs={"unused_flag": True}),
    "chat-add-special-tokens": chat([user("hi")], add_special_tokens=True),
    "chat-tools": chat([user("Weather in Paris?")], tools=[WEATHER_TOOL], tool_choice="none"),
    "chat-tool-call-history": chat(
        [
            user("Weather in Paris?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "unit": "c"}'},
        ],
        tools=[WEATHER_TOOL],
        tool_choice="none",
    ),
    "chat-stream-usage": chat(
        [user("Stream, please.")], stream=True, stream_options={"include_usage": True}
    ),
    "completion-plain": completion("Once upon a time"),
    "completion-unicode": completion(UNICODE),
    "completion-code": completion(CODE),
    "completion-long": completion(text(2000, 4)),
    "completion-whitespace": completion("   \n\n\t "),
    "completion-special-token-text": completion("<|im_start|>user\nhi<|im_end|>"),
    "completion-n2": completion("The quick brown fox", n=2),
    "completion-batch": completion(["first prompt", UNICODE, text(300, 5)]),
    "completion-batch-n2": completion(["alpha", "beta gamma"], n=2),
    "completion-token-ids": completion([9707, 11, 1879, 0, 151643, 42]),
    "completion-batch-token-ids": completion([[9707, 11], [1879, 0, 1, 2, 3]]),
    "completion-echo": completion("echo me back", echo=True),
    "completion-no-special-tokens": completion("hi there", add_special_tokens=False),
    "completion-stream-usage": completion(
        "stream this", stream=True, stream_options={"include_usage": True}
    ),
}


async def _send(
    gw: Gateway, http: aiohttp.ClientSession, name: str, path: str, payload: dict[str, Any]
) -> tuple[int, Any]:
    async with http.post(
        gw.url + path, json=payload, headers={"x-tenant-id": "exact", "x-test-id": name}
    ) as response:
        raw = await response.read()
    if payload.get("stream"):
        events = [
            json.loads(line[len(b"data: ") :])
            for line in raw.splitlines()
            if line.startswith(b"data: {")
        ]
        usage = [e["usage"] for e in events if e.get("usage")]
        return response.status, {"usage": usage[-1]} if usage else {"raw": raw.decode()}
    return response.status, json.loads(raw)


async def test_prompt_tokens_equal_vllm_usage(vllm: VllmProcess, tmp_path: Path) -> None:
    assert len(CASES) >= 30
    async with gateway(tmp_path, vllm, TENANCY) as gw, aiohttp.ClientSession() as http:
        # Capacity was discovered from the real /metrics: 64 blocks less the null one, of 128.
        assert await gw.capacity() == PoolCapacity(63, 128)
        limit = asyncio.Semaphore(4)

        async def one(name: str) -> tuple[str, int, Any]:
            async with limit:
                status, answer = await _send(gw, http, name, *CASES[name])
                return name, status, answer

        results = await asyncio.gather(*(one(name) for name in CASES))
        mismatches = []
        for name, status, answer in results:
            assert status == 200, f"{name}: {status} {answer}"
            seen = gw.proxy.by_test_id(name)
            assert seen.status == 200
            counted = int(seen.headers["x-kvguard-prompt-tokens"])
            reported = answer["usage"]["prompt_tokens"]
            if counted != reported:
                mismatches.append(f"{name}: kvguard {counted}, vLLM {reported}")
        assert mismatches == []
        # Clamping reached vLLM too: the tier cap and the injected default.
        assert gw.proxy.by_test_id("chat-no-limit").json()["max_tokens"] == 3
        no_limit = next(a for n, _, a in results if n == "chat-no-limit")
        assert no_limit["usage"]["completion_tokens"] <= 3

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the ledger back at zero", timeout_s=10, poll_s=0.05)
