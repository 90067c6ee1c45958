"""The chat cases kvguard.tokens.tokenizer is checked against transformers with (test_tokenizer.py,
test_counting.py): each holds the request kvguard sees and the reference input, the messages,
tools and template arguments vLLM 0.32 hands to `apply_chat_template` after its own
normalisation; the texts they are built from, and a template in the "openai" content format."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


def _long_text() -> str:
    """About 3k Qwen tokens of mixed-script prose, the same on every run."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "while",
        "engineers",
        "measure",
        "latency",
        "across",
        "kv",
        "cache",
        "blocks",
        "tenants",
        "quotas",
        "admission",
        "control",
        "vLLM",
        "Envoy",
        "gRPC",
        "stream",
        "token",
        "budget",
        "数据",
        "中心",
        "模型",
        "推理",
        "東京",
        "서울",
        "naïve",
        "façade",
        "42",
        "3.14",
        "2025",
    ]
    rng = random.Random(7)
    return "\n".join(
        " ".join(rng.choice(words) for _ in range(rng.randint(8, 22))) + rng.choice(".?!;")
        for _ in range(120)
    )


TEXTS = {
    "short": "What is the capital of France?",
    "unicode": "Grüße aus Köln — naïve café. 你好，世界！こんにちは。안녕하세요. مرحبا بالعالم. "  # noqa: RUF001
    "Emoji: 😀🚀👩‍👩‍👧‍👦🇫🇷",
    "code": "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))\r\n",
    "specials": "Literal markers: <|im_start|> and <|im_end|> and <think> in user text.",
    "spaces": "  leading and trailing spaces   \n\n",
    "empty": "",
    "long": _long_text(),
}
SYSTEM = "You are a terse assistant. Answer in one sentence."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time, ISO 8601 — über präzise",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


@dataclass
class Case:
    id: str
    messages: list[dict[str, Any]]
    ref: list[dict[str, Any]] | None = None  # what vLLM hands transformers; None: the same
    extra: dict[str, Any] = field(default_factory=dict)  # request fields besides messages
    ref_tools: list[dict[str, Any]] | None = None
    ref_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def request(self) -> dict[str, Any]:
        return {"model": "m", "messages": self.messages, **self.extra}


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _cases() -> list[Case]:
    cases: list[Case] = []
    for key, text in TEXTS.items():
        cases += [
            Case(f"user-{key}", [{"role": "user", "content": text}]),
            Case(
                f"system-{key}",
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            ),
            Case(
                f"multiturn-{key}",
                [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": text + " again?"},
                ],
            ),
            Case(
                f"parts-{key}",
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": text},
                            {"type": "text", "text": "second part"},
                        ],
                    }
                ],
                ref=[{"role": "user", "content": text + "\nsecond part"}],
            ),
            Case(
                f"no-generation-prompt-{key}",
                [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
                extra={"add_generation_prompt": False},
            ),
            Case(
                f"no-thinking-{key}",
                [{"role": "user", "content": text}],
                extra={"chat_template_kwargs": {"enable_thinking": False}},
                ref_kwargs={"enable_thinking": False},
            ),
        ]
    weather_call = [_call("c1", "get_weather", '{"city": "Paris", "unit": "C"}')]
    weather_ref = [_call("c1", "get_weather", {"city": "Paris", "unit": "C"})]
    ask = {"role": "user", "content": "Weather in Paris?"}
    cases += [
        Case(
            "tools-listed",
            [ask],
            extra={"tools": [WEATHER_TOOL, TIME_TOOL]},
            ref_tools=[WEATHER_TOOL, TIME_TOOL],
        ),
        Case(
            "tools-with-system",
            [{"role": "system", "content": SYSTEM}, ask],
            extra={"tools": [WEATHER_TOOL]},
            ref_tools=[WEATHER_TOOL],
        ),
        Case(
            "tool-call-string-arguments",
            [
                ask,
                {"role": "assistant", "content": None, "tool_calls": weather_call},
                {"role": "tool", "tool_call_id": "c1", "content": "18°C, cloudy"},
            ],
            ref=[
                ask,
                {"role": "assistant", "content": "", "tool_calls": weather_ref},
                {"role": "tool", "tool_call_id": "c1", "content": "18°C, cloudy"},
            ],
            extra={"tools": [WEATHER_TOOL]},
            ref_tools=[WEATHER_TOOL],
        ),
        Case(
            "tool-call-with-content",
            [
                ask,
                {"role": "assistant", "content": "Let me check.", "tool_calls": weather_call},
                {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
            ],
            ref=[
                ask,
                {"role": "assistant", "content": "Let me check.", "tool_calls": weather_ref},
                {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
            ],
        ),
        Case(
            "tool-call-invalid-json",
            [
                ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        _call("c1", "get_weather", "{not json"),
                        _call("c2", "get_time", ""),
                    ],
                },
            ],
            ref=[
                ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call("c1", "get_weather", {}), _call("c2", "get_time", {})],
                },
            ],
            extra={"add_generation_prompt": False},
        ),
        Case(
            "tool-call-object-arguments",
            [
                ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call("c1", "get_weather", {"city": "Zürich 東京"})],
                },
            ],
        ),
        Case(
            "tool-call-empty-list",
            [ask, {"role": "assistant", "content": "no call", "tool_calls": []}, ask],
            ref=[ask, {"role": "assistant", "content": "no call"}, ask],
        ),
        Case(
            "parallel-tool-calls",
            [
                ask,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        _call("c1", "get_weather", '{"city": "Paris"}'),
                        _call("c2", "get_time", '{"tz": "Europe/Paris"}'),
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
                {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
            ],
            ref=[
                ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        _call("c1", "get_weather", {"city": "Paris"}),
                        _call("c2", "get_time", {"tz": "Europe/Paris"}),
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
                {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
            ],
            extra={"tools": [WEATHER_TOOL, TIME_TOOL]},
            ref_tools=[WEATHER_TOOL, TIME_TOOL],
        ),
        Case(
            "tool-content-parts",
            [
                ask,
                {"role": "assistant", "content": "", "tool_calls": weather_call},
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "18°C"}, {"type": "text", "text": "wind"}],
                },
            ],
            ref=[
                ask,
                {"role": "assistant", "content": "", "tool_calls": weather_ref},
                {"role": "tool", "tool_call_id": "c1", "content": "18°C\nwind"},
            ],
        ),
        Case(
            "tool-without-description",
            [ask],
            extra={"tools": [{"type": "function", "function": {"name": "ping"}}]},
            ref_tools=[
                {
                    "type": "function",
                    "function": {"name": "ping", "description": None, "parameters": None},
                }
            ],
        ),
        Case(
            "tool-function-extras",
            [ask],
            extra={
                "tools": [
                    {
                        "function": {"strict": True, "name": "ping", "description": "p"},
                        "x-ignored": 1,
                    }
                ]
            },
            ref_tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "ping",
                        "description": "p",
                        "parameters": None,
                        "strict": True,
                    },
                }
            ],
        ),
        Case(
            "tools-in-kwargs-override",
            [ask],
            extra={"tools": [WEATHER_TOOL], "chat_template_kwargs": {"tools": [TIME_TOOL]}},
            ref_tools=[TIME_TOOL],
        ),
        Case(
            "continue-final",
            [ask, {"role": "assistant", "content": "The weather is"}],
            extra={"add_generation_prompt": False, "continue_final_message": True},
            ref_kwargs={"continue_final_message": True},
        ),
        Case(
            "continue-final-trailing-space",
            [ask, {"role": "assistant", "content": "The weather is "}],
            extra={"add_generation_prompt": False, "continue_final_message": True},
            ref_kwargs={"continue_final_message": True},
        ),
        Case(
            "continue-final-parts",
            [
                ask,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "It is"},
                        {"type": "text", "text": "mostly"},
                    ],
                },
            ],
            ref=[ask, {"role": "assistant", "content": "It is\nmostly"}],
            extra={"add_generation_prompt": False, "continue_final_message": "true"},
            ref_kwargs={"continue_final_message": True},
        ),
        Case(
            "continue-final-unicode",
            [ask, {"role": "assistant", "content": "Il fait 18 °C — "}],
            extra={"add_generation_prompt": 0, "continue_final_message": 1},
            ref_kwargs={"continue_final_message": True},
        ),
        Case(
            "reasoning-history",
            [
                ask,
                {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
                {"role": "user", "content": "And tomorrow?"},
            ],
        ),
        Case(
            "reasoning-last-turn",
            [ask, {"role": "assistant", "content": "Sunny.", "reasoning": "Check the sky."}],
            ref=[
                ask,
                {"role": "assistant", "content": "Sunny.", "reasoning_content": "Check the sky."},
            ],
            extra={"add_generation_prompt": False},
        ),
        Case(
            "think-tags-in-content",
            [ask, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nSunny."}],
            extra={"add_generation_prompt": False},
        ),
        Case(
            "reasoning-effort-none",
            [ask],
            extra={"reasoning_effort": "none"},
            ref_kwargs={"enable_thinking": False},
        ),
        Case(
            "reasoning-effort-high",
            [ask],
            extra={"reasoning_effort": "high"},
            ref_kwargs={"enable_thinking": True},
        ),
        Case(
            "reasoning-effort-kwargs-win",
            [ask],
            extra={"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            ref_kwargs={"enable_thinking": True},
        ),
        Case(
            "kwargs-cannot-override-request",
            [ask],
            extra={"chat_template_kwargs": {"add_generation_prompt": False}},
        ),
        Case(
            "kwargs-unset-values-dropped",
            [ask],
            extra={"chat_template_kwargs": {"enable_thinking": None, "flavour": "auto"}},
        ),
        Case(
            "system-parts",
            [
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": SYSTEM},
                        {"type": "input_text", "text": "Be brief."},
                    ],
                },
                ask,
            ],
            ref=[{"role": "system", "content": SYSTEM + "\nBe brief."}, ask],
        ),
        Case(
            "mixed-parts",
            [
                {
                    "role": "user",
                    "content": [
                        "plain string part",
                        {"type": "text", "text": None},
                        {"type": "refusal", "refusal": "r"},
                        {"type": "output_text", "text": "o"},
                        {"type": "thinking", "thinking": "t"},
                    ],
                }
            ],
            ref=[{"role": "user", "content": "plain string part\nr\no\nt"}],
        ),
        Case(
            "null-user-content",
            [{"role": "user", "content": None}],
            ref=[{"role": "user", "content": ""}],
        ),
        Case(
            "names-and-ids",
            [
                {"role": "system", "content": SYSTEM, "name": "ops"},
                {"role": "user", "content": "hi", "name": "alice", "ignored": True},
            ],
            ref=[
                {"role": "system", "content": SYSTEM, "name": "ops"},
                {"role": "user", "content": "hi", "name": "alice"},
            ],
        ),
        Case(
            "second-system",
            [
                ask,
                {"role": "assistant", "content": "ok"},
                {"role": "system", "content": "Now answer in French."},
                ask,
            ],
        ),
        Case(
            "documents-passed",
            [ask],
            extra={"documents": [{"title": "t", "text": "body"}]},
            ref_kwargs={"documents": [{"title": "t", "text": "body"}]},
        ),
        Case("special-tokens-requested", [ask], extra={"add_special_tokens": True}),
        Case(
            "long-conversation",
            [
                {"role": "system", "content": SYSTEM},
                *[
                    m
                    for i in range(12)
                    for m in (
                        {"role": "user", "content": f"Question {i}: {TEXTS['unicode']}"},
                        {"role": "assistant", "content": f"Answer {i}: {TEXTS['code']}"},
                    )
                ],
                {"role": "user", "content": TEXTS["long"]},
            ],
        ),
        # Qwen's template never names the developer role: vLLM renders it as a system message,
        # and merges system messages into one at the start when there are several.
        Case(
            "developer-alone",
            [{"role": "developer", "content": "Be brief."}, ask],
            ref=[{"role": "system", "content": "Be brief."}, ask],
        ),
        Case(
            "developer-after-system",
            [
                {"role": "system", "content": SYSTEM},
                ask,
                {"role": "developer", "content": [{"type": "text", "text": "Be"}, "brief."]},
                {"role": "system", "content": ""},
                ask,
            ],
            ref=[{"role": "system", "content": f"{SYSTEM}\n\nBe\nbrief."}, ask, ask],
        ),
    ]
    return cases


CASES = _cases()


OPENAI_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message['content'] %}{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' %}<|image_pad|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
