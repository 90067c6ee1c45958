"""The Responses and Messages APIs on the real engine: for varied requests of each, sent through
Envoy + kvguard to a real vLLM, `x-kvguard-prompt-tokens` as vLLM received it (recorded by the
transparent proxy in front of vLLM) equals the `usage.input_tokens` vLLM answered, streamed or
not; and a tenant past its quota gets a 429 that never reaches vLLM, in Anthropic's error schema
on /v1/messages and OpenAI's on /v1/responses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.testing.vllm import VllmProcess
from kvguard.testing.wait import wait_until
from tests.live.harness import Gateway, gateway, text

pytestmark = [pytest.mark.live, pytest.mark.asyncio(loop_scope="session")]

TENANCY = {
    "header": "x-tenant-id",
    "default_tier": "pro",
    "tiers": {"pro": {"max_tokens_cap": 64, "default_max_tokens": 3, "max_blocks": 60}},
}
UNICODE = "Grüße, 世界! Здравствуй, мир. مرحبا 👋🏽 e\u0301 ﬁ ½ — “quotes”"
CODE = 'def f(x):\n\treturn {"a": [1, 2, 3], "b": x ** 2}  # comment\n\n\n    trailing   \n'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def responses(input_: Any, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": "qwen", "input": input_, "max_output_tokens": 4, **extra}


def messages(turns: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"model": "qwen", "messages": turns, "max_tokens": 4, **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def said(text_: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text_, "annotations": []}
    return {"type": "message", "role": "assistant", "id": "m1", "status": status, "content": [part]}


WEATHER_CALL = {
    "type": "function_call",
    "call_id": "c1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
WEATHER_FN = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": SCHEMA,
}
THOUGHT = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "Look it up."}],
}
RESPONSES_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses-string": responses("Say hello in French."),
    "responses-instructions": responses("Why?", instructions="Answer in verse."),
    "responses-multi-turn": responses(
        [user("What is a KV cache?"), said("Keys and values of past tokens."), user("And a block?")]
    ),
    "responses-text-parts": responses(
        [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "first part"},
                    {"type": "input_text", "text": UNICODE},
                ],
            }
        ]
    ),
    "responses-code": responses(CODE),
    "responses-long": responses(text(1400, 11)),
    "responses-developer": responses(
        [{"role": "developer", "content": "Be terse."}, user("hi")], instructions="Top."
    ),
    "responses-function-call": responses(
        [
            user("Weather in Paris?"),
            WEATHER_CALL,
            {**WEATHER_CALL, "type": "function_call_output", "output": "21 C"},
        ],
        tools=[WEATHER_FN],
    ),
    "responses-reasoning-merged": responses(
        [user("Weather?"), THOUGHT, said("Sunny."), WEATHER_CALL], tools=[WEATHER_FN]
    ),
    "responses-reasoning-last": responses([user("Weather?"), THOUGHT, said("Sunny.")]),
    "responses-custom-tool": responses(
        [
            user("Patch it."),
            {"type": "custom_tool_call", "call_id": "p1", "name": "patch", "input": "*** diff"},
            {"type": "custom_tool_call_output", "call_id": "p1", "output": "applied"},
        ],
        tools=[{"type": "custom", "name": "patch", "description": "Apply a diff"}],
    ),
    "responses-namespace-tool": responses(
        "Read /a.",
        tools=[
            {
                "type": "namespace",
                "name": "fs",
                "description": "files",
                "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
            }
        ],
    ),
    "responses-builtin-tool": responses("Search.", tools=[{"type": "web_search_preview"}]),
    "responses-effort-none": responses("hi", reasoning={"effort": "none"}),
    "responses-template-kwargs": responses("hi", chat_template_kwargs={"enable_thinking": False}),
    "responses-continue": responses([user("Finish this:"), said("Once upon a", "in_progress")]),
    "responses-no-limit": ("/v1/responses", {"model": "qwen", "input": "Go on."}),
    "responses-truncation-auto": responses("Short enough.", truncation="auto"),
    "responses-stream": responses("Stream, please.", stream=True),
}

TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}
NO_TOOL_CALLS = {"tool_choice": {"type": "none"}}  # vLLM refuses "auto" without a tool parser
MESSAGES_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "messages-string": messages([user("Say hello in French.")]),
    "messages-system": messages([user("Why?")], system="Answer in verse."),
    "messages-system-blocks": messages(
        [user("hi")],
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab;"},
            {"type": "text", "text": "You are terse. "},
            {"type": "text", "text": "Use metric units."},
        ],
    ),
    "messages-multi-turn": messages(
        [user("What is a KV cache?"), {"role": "assistant", "content": "Past keys."}, user("And?")]
    ),
    "messages-text-blocks": messages(
        [user([{"type": "text", "text": "first"}, {"type": "text", "text": UNICODE}])]
    ),
    "messages-code-long": messages([user(CODE + text(900, 12))]),
    "messages-tool-history": messages(
        [
            user("Weather in Paris?"),
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            user(
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "21"},
                            {"type": "text", "text": "sunny"},
                        ],
                    },
                    {"type": "text", "text": "Thanks"},
                ]
            ),
        ],
        tools=[TOOL],
        **NO_TOOL_CALLS,
    ),
    "messages-tool-results-only": messages(
        [
            user("Weather?"),
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            user([{"type": "tool_result", "tool_use_id": "t1", "content": "21 C"}]),
        ],
        tools=[{"name": "get_weather", "input_schema": {"properties": {}}}],
        **NO_TOOL_CALLS,
    ),
    "messages-inline-system": messages(
        [user("a"), {"role": "system", "content": "Reminder."}, user("b")], system="Top."
    ),
    "messages-thinking-disabled": messages([user("hi")], thinking={"type": "disabled"}),
    "messages-redacted-and-empty-blocks": messages(
        [
            user("Hi"),
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "b3BhcXVl"},
                    {"type": "text", "text": ""},
                    {"type": "text", "text": "Hello."},
                ],
            },
            user([{"type": "text", "text": "again"}, {"type": "text", "text": "and again"}]),
        ]
    ),
    "messages-effort": messages([user("hi")], output_config={"effort": "high"}),
    "messages-template-kwargs": messages(
        [user("hi")], chat_template_kwargs={"enable_thinking": False}
    ),
    "messages-tool-changes": messages(
        [
            {
                "role": "system",
                "content": [
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {"name": "late", "input_schema": {"type": "object"}},
                        },
                    },
                    {
                        "type": "tool_removal",
                        "tool": {"type": "tool_reference", "name": "get_weather"},
                    },
                ],
            },
            user("hi"),
        ],
        tools=[TOOL, {"name": "ping", "input_schema": {"type": "object"}, "strict": True}],
        **NO_TOOL_CALLS,
    ),
    "messages-stream": messages([user("Stream, please.")], stream=True),
}


async def _send(
    gw: Gateway, http: aiohttp.ClientSession, name: str, path: str, payload: dict[str, Any]
) -> tuple[int, Any]:
    """The status and the usage vLLM answered (a stream's from its last usage-bearing event)."""
    async with http.post(
        gw.url + path, json=payload, headers={"x-tenant-id": "exact", "x-test-id": name}
    ) as response:
        raw = await response.read()
    if response.status != 200 or not payload.get("stream"):
        return response.status, json.loads(raw)
    usage = None
    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            event = json.loads(line[len(b"data: ") :])
            found = (event.get("response") or event.get("message") or event).get("usage")
            usage = found or usage
    return response.status, {"usage": usage, "raw": raw.decode()}


async def test_input_tokens_equal_vllm_usage(vllm: VllmProcess, tmp_path: Path) -> None:
    cases = RESPONSES_CASES | MESSAGES_CASES
    assert len(RESPONSES_CASES) >= 10 and len(MESSAGES_CASES) >= 10
    async with gateway(tmp_path, vllm, TENANCY) as gw, aiohttp.ClientSession() as http:
        limit = asyncio.Semaphore(4)

        async def one(name: str) -> tuple[str, int, Any]:
            async with limit:
                return name, *await _send(gw, http, name, *cases[name])

        results = await asyncio.gather(*(one(name) for name in cases))
        figures, mismatches = [], []
        for name, status, answer in results:
            assert status == 200, f"{name}: {status} {answer}"
            counted = int(gw.proxy.by_test_id(name).headers["x-kvguard-prompt-tokens"])
            reported = answer["usage"]["input_tokens"]
            figures.append(f"{name}: kvguard {counted}, vLLM {reported}")
            if counted != reported:
                mismatches.append(figures[-1])
        print("\n".join(figures))  # the figures, for the record (pytest -s)
        assert mismatches == []
        # The limits reached vLLM clamped or injected, in each API's own field.
        assert gw.proxy.by_test_id("responses-no-limit").json()["max_output_tokens"] == 3
        for name, (path, body), field in (
            ("responses-clamped", RESPONSES_CASES["responses-string"], "max_output_tokens"),
            ("messages-clamped", MESSAGES_CASES["messages-string"], "max_tokens"),
        ):
            status, answer = await _send(gw, http, name, path, {**body, field: 5000})
            assert status == 200, answer
            assert gw.proxy.by_test_id(name).json()[field] == 64  # the tier's cap

        async def released() -> bool:
            return await gw.reserved() == 0

        await wait_until(released, "the ledger back at zero", timeout_s=10, poll_s=0.05)


QUOTA = {
    "header": "x-tenant-id",
    "default_tier": "small",
    "tiers": {"small": {"max_tokens_cap": 1000, "default_max_tokens": 3, "max_blocks": 10}},
}


async def test_a_tenant_past_its_quota_is_refused_before_vllm(
    vllm: VllmProcess, tmp_path: Path
) -> None:
    async with gateway(tmp_path, vllm, QUOTA) as gw, aiohttp.ClientSession() as http:
        # ~1010 tokens forced (ignore_eos): 8 of the tenant's 10 blocks, held while it streams.
        long = {**RESPONSES_CASES["responses-string"][1], "max_output_tokens": 1000}
        long |= {"ignore_eos": True, "stream": True}
        headers = {"x-tenant-id": "busy", "x-test-id": "holder"}
        async with http.post(gw.url + "/v1/responses", json=long, headers=headers) as holder:
            assert holder.status == 200
            await holder.content.readuntil(b"\n\n")
            assert await gw.tenant_blocks("busy") == 8
            # 3 more blocks each: past the quota while the holder streams.
            refused = {}
            for name, (path, body) in (
                ("refused-messages", messages([user("hi")], max_tokens=300)),
                ("refused-responses", responses("hi", max_output_tokens=300)),
            ):
                async with http.post(
                    gw.url + path, json=body, headers={"x-tenant-id": "busy", "x-test-id": name}
                ) as response:
                    refused[name] = (response.status, response.headers, await response.json())
            await holder.read()
    status, headers, answer = refused["refused-messages"]
    assert status == 429
    assert answer["type"] == "error" and answer["error"]["type"] == "rate_limit_error"
    assert headers["x-kvguard-reason"] == "tenant_block_quota_exceeded"
    assert int(headers["retry-after"]) >= 1
    status, headers, answer = refused["refused-responses"]
    assert status == 429
    assert answer["error"]["code"] == "tenant_block_quota_exceeded"
    # Neither reached vLLM: the proxy in front of it saw only the holder.
    assert [r.headers.get("x-test-id") for r in gw.proxy.requests] == ["holder"]
