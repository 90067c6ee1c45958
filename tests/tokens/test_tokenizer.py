"""kvguard.tokens.tokenizer against transformers, the reference vLLM itself renders and tokenizes
with.

Each chat case holds the request kvguard sees and the reference input: the messages, tools and
template arguments vLLM 0.32 hands to `apply_chat_template` after its own normalisation (text
parts joined with "\\n" for "string" templates, tool-call arguments parsed from JSON, null
content as "", …). Prompts and counts must be exactly equal.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvguard.errors import Refusal
from kvguard.tokens.chat_template import ChatTemplate, ChatTemplateError, detect_content_format
from kvguard.tokens.counting import add_special_tokens, count_prompts
from kvguard.tokens.request import lax_bool, parse
from kvguard.tokens.tokenizer import PoolTokenizer, TokenizerError
from tests.conftest import model_dir

transformers = pytest.importorskip("transformers")


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


def test_enough_cases() -> None:
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chat_matches_transformers(qwen: PoolTokenizer, qwen_hf: Any, case: Case) -> None:
    request = case.request
    before = copy.deepcopy(request)
    prompt = qwen.render_chat(request)
    assert request == before, "render_chat must not modify the request"
    kwargs = (
        {"add_generation_prompt": False, **case.ref_kwargs}
        if (case.ref_kwargs.get("continue_final_message"))
        else {
            "add_generation_prompt": case.extra.get("add_generation_prompt", True),
            **case.ref_kwargs,
        }
    )
    expected = qwen_hf.apply_chat_template(
        case.ref if case.ref is not None else case.messages,
        tools=case.ref_tools,
        tokenize=False,
        **kwargs,
    )
    assert prompt == expected
    special = lax_bool(request.get("add_special_tokens", False), "add_special_tokens")
    count = len(qwen_hf(expected, add_special_tokens=special)["input_ids"])
    assert qwen.count(prompt, special) == count
    # The entry point admission uses, on the parsed request: new text, then seen before.
    parsed = parse("chat", json.dumps(request).encode())
    assert count_prompts(qwen, parsed) == [count]
    assert count_prompts(qwen, parsed) == [count]


COMPLETIONS = [
    *TEXTS.values(),
    "Once upon a time",
    " leading space",
    "<|begin_of_text|>already has BOS",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "\n\n\n",
    "1234567890 3.14159 1e-9",
    "tab\tseparated\tvalues\n" * 20,
    "ﬁ ligature, Å angstrom, é composed vs é decomposed",  # NFC normalisation (Qwen)
    "a" * 5000,
]


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("model", ["qwen", "llama"])
def test_completion_counts_match_transformers(
    model: str, special: bool, request: pytest.FixtureRequest
) -> None:
    mine: PoolTokenizer = request.getfixturevalue(model)
    hf = request.getfixturevalue(f"{model}_hf")
    expected = [len(hf(text, add_special_tokens=special)["input_ids"]) for text in COMPLETIONS]
    assert [mine.count(text, special) for text in COMPLETIONS] == expected
    assert mine.count_many(COMPLETIONS, special) == expected
    # One batch request through count_prompts ("" alone is refused: see test_counting).
    kept = [(t, n) for t, n in zip(COMPLETIONS, expected, strict=True) if t]
    body = {"model": "m", "prompt": [t for t, _ in kept], "add_special_tokens": special}
    parsed = parse("completion", json.dumps(body).encode())
    assert count_prompts(mine, parsed) == [n for _, n in kept]


def test_special_tokens_per_model(qwen: PoolTokenizer, llama: PoolTokenizer) -> None:
    # Qwen's post-processor adds nothing; Llama 3.2's adds <|begin_of_text|>.
    assert qwen.count("hello", True) == qwen.count("hello", False)
    assert llama.count("hello", True) == llama.count("hello", False) + 1
    assert qwen.count_many([], True) == []


def test_count_many_equals_count(qwen: PoolTokenizer) -> None:
    texts = [qwen.render_chat(c.request) for c in CASES[:20]]
    assert qwen.count_many(texts, False) == [qwen.count(t, False) for t in texts]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "'image_url'"),
        (
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            "'input_audio'",
        ),
        ({"type": "video_url", "video_url": {"url": "https://x/y.mp4"}}, "'video_url'"),
        ({"image_url": "https://x/y.png"}, "'image_url'"),  # vLLM infers the type from the key
        ({"type": "hologram", "data": "x"}, "'hologram'"),
        ({"text": "no type"}, "Missing 'type'"),
        (42, "strings or objects"),
    ],
)
def test_unsupported_content_parts(qwen: PoolTokenizer, part: Any, message: str) -> None:
    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
    with pytest.raises(TokenizerError, match=r"unsupported content part|Missing|strings") as info:
        qwen.render_chat(request)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "Cannot set both",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "must not be an empty"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            r"tools\[0\]",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            "trust-request-chat-template",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"chat_template": "{{ 1 }}"},
            },
            "trust-request-chat-template",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["x"]},
            "must be an object",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"messages": []},
            },
            "may not set",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "maybe"},
            "add_generation_prompt must be a boolean",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"},
            "reasoning_effort",
        ),
        ({"messages": [{"content": "x"}]}, "string 'role'"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "content must be"),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "'function' object",
        ),
    ],
)
def test_invalid_chat_requests(
    qwen: PoolTokenizer, request_body: dict[str, Any], message: str
) -> None:
    with pytest.raises(TokenizerError, match=message):
        qwen.render_chat(request_body)


def test_add_special_tokens_is_read_as_vllm_reads_it() -> None:
    def parsed(kind: str, body: dict[str, object]) -> bool:
        base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
        return add_special_tokens(parse(kind, json.dumps(base | body).encode()))  # type: ignore[arg-type]

    assert parsed("chat", {}) is False
    assert parsed("completion", {}) is True
    assert parsed("chat", {"add_special_tokens": True}) is True
    assert parsed("completion", {"add_special_tokens": "false"}) is False
    assert parsed("chat", {"add_special_tokens": 1}) is True
    for bad in ("maybe", 2, [], {}):
        with pytest.raises(Refusal, match="add_special_tokens"):
            parsed("chat", {"add_special_tokens": bad})


def test_model_without_template_refuses_chat(llama: PoolTokenizer) -> None:
    with pytest.raises(TokenizerError, match="no default chat template"):
        llama.render_chat({"messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def qwen_backend() -> Tokenizer:
    return Tokenizer.from_file(str(model_dir("qwen") / "tokenizer.json"))


def _with_template(backend: Tokenizer, source: str) -> PoolTokenizer:
    """Qwen's tokenizer with another template, without reloading tokenizer.json per test."""
    return PoolTokenizer(
        backend, {"default": ChatTemplate(source, "test")}, {"eos_token": "<|im_end|>"}
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{{ raise_exception('Only user and assistant roles are supported!') }}",
            "chat template failed to render: Only user and assistant roles are supported!",
        ),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ messages[0].nope.deeper }}", "has no attribute 'nope'"),
        ("{{ messages.__class__.__mro__ }}", "chat template failed to render"),
        ("{{ messages[0].content.index('zzz') }}", "render: ValueError$"),
        ("{% set ns = namespace(_x=1) %}", "not allowed"),
        ("{{ messages.append(1) }}", "chat template failed to render"),  # immutable sandbox
    ],
)
def test_template_errors_become_tokenizer_errors(
    qwen_backend: Tokenizer, source: str, message: str
) -> None:
    tokenizer = _with_template(qwen_backend, source)
    secret = "secret prompt text"
    for _ in range(2):  # the second time, the sandbox's verdicts are remembered
        with pytest.raises(TokenizerError, match=message) as info:
            tokenizer.render_chat({"messages": [{"role": "user", "content": secret}]})
        assert secret not in str(info.value)


def test_continue_final_message_needs_the_message_rendered(qwen_backend: Tokenizer) -> None:
    tokenizer = _with_template(qwen_backend, "{{ messages[0].content }}")
    request = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    with pytest.raises(TokenizerError, match="does not render the final message intact"):
        tokenizer.render_chat(request)


OPENAI_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message['content'] %}{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' %}<|image_pad|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


@pytest.mark.parametrize("continue_final", [False, True])
def test_openai_content_format_passes_parts(
    tmp_path: Path, qwen_hf: Any, continue_final: bool
) -> None:
    path = tmp_path / "template.jinja"  # through load(): vLLM's --chat-template
    path.write_text(OPENAI_TEMPLATE, encoding="utf-8")
    tokenizer = PoolTokenizer.load(model_dir("qwen"), path)
    request = {
        "messages": [
            {"role": "system", "content": "plain"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a "}, {"type": "input_text", "text": "b"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "partial "}]},
        ],
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
    }
    ref = [
        {"role": "system", "content": [{"type": "text", "text": "plain"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "partial "}]},
    ]
    expected = qwen_hf.apply_chat_template(
        ref,
        chat_template=OPENAI_TEMPLATE,
        tokenize=False,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
    )
    prompt = tokenizer.render_chat(request)
    assert prompt == expected
    assert tokenizer.count(prompt, False) == len(
        qwen_hf(expected, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}"
            "{% for c in m.content | selectattr('type') %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set a = messages %}{% set b = a %}{% set a = b %}"
            "{% for m in b %}{% for c in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for i, m in messages %}{% endfor %}", "string"),  # vLLM gives up on tuple targets
    ],
)
def test_content_format_detection(source: str, expected: str) -> None:
    assert ChatTemplate(source, "test").content_format == expected
    env = transformers.utils.chat_template_utils._compile_jinja_template(source).environment
    assert detect_content_format(env.parse(source)) == expected


def test_qwen_template_is_string_format(qwen: PoolTokenizer) -> None:
    assert qwen._template_for(None).content_format == "string"


def test_named_templates_pick_tool_use(tmp_path: Path) -> None:
    source = model_dir("qwen")
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = PoolTokenizer.load(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.render_chat({"messages": messages}) == "plain"
    assert tokenizer.render_chat({"messages": messages, "tools": [WEATHER_TOOL]}) == "tools: 1"


def test_configured_special_token_missing_from_tokenizer_json(tmp_path: Path) -> None:
    source = model_dir("llama3.2")
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["eos_token"] = {
        "__type": "AddedToken",
        "content": "<|custom_eos|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "one <|custom_eos|> two<|custom_eos|>"
    assert PoolTokenizer.load(tmp_path).count(text, False) == len(
        hf(text, add_special_tokens=False)["input_ids"]
    )


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        PoolTokenizer.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="chat template file"):
        PoolTokenizer.load(model_dir("qwen"), tmp_path / "absent.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jinja: chat template does not compile"):
        PoolTokenizer.load(model_dir("qwen"), bad)
    shutil.copy(model_dir("qwen") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not readable JSON"):
        PoolTokenizer.load(tmp_path)


def test_a_template_that_amplifies_its_input_is_cut_off() -> None:
    # Every message printed 100,000 x 100,000 times: refused once the output passes the limit,
    # long before the render would finish.
    source = (
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{{ m.content }}{% endfor %}{% endfor %}{% endfor %}"
    )
    template = ChatTemplate(source, "amplifier")
    with pytest.raises(ChatTemplateError, match="renders more than"):
        template.render(
            [{"role": "user", "content": "x" * 1000}],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            continue_final_message=False,
            variables={},
        )


def test_a_template_that_names_the_developer_role_gets_it(tmp_path: Path) -> None:
    template = tmp_path / "developer.jinja"
    template.write_text(
        "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}"
        "{{ m.role }}={{ m.content }};{% endfor %}"
    )
    tokenizer = PoolTokenizer.load(model_dir("qwen"), template)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d"},
    ]
    assert tokenizer.render_chat({"messages": messages}) == "system=s;user=u;D:developer=d;"
    # Without the name, vLLM's conversion: one system message at the start.
    template.write_text("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}")
    tokenizer = PoolTokenizer.load(model_dir("qwen"), template)
    assert tokenizer.render_chat({"messages": messages}) == "system=s\n\nd;user=u;"
