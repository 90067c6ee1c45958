"""Anthropic Messages bodies counted as vLLM 0.32 counts them, against transformers.

Each case holds the body kvguard sees and, built here by hand, what vLLM's
`to_chat_completion_request` and chat rendering hand `apply_chat_template`: `system` (a string,
or its text blocks joined without a separator, the billing header dropped) as the first
system message; text blocks as parts (one alone as a string), thinking as reasoning, tool uses
as tool calls; a user's tool results as tool messages before the rest of its turn; tools as
chat functions (an input_schema without a type gets `"type": "object"`); `thinking` and
`output_config.effort` as `reasoning_effort`. Tokenized without special tokens added, as chat.
A generated corpus (fixed seed) adds mixed conversations.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvguard.errors import Refusal
from kvguard.tokens import messages_api
from kvguard.tokens.counting import count_prompts
from kvguard.tokens.request import parse
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.conftest import model_dir

transformers = pytest.importorskip("transformers")

SEED = 20260201
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": SCHEMA}
WEATHER_CHAT = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather", "parameters": SCHEMA},
}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def tool_use(call_id: str, arguments: dict[str, Any], name: str = "get_weather") -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def result(call_id: str, content: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content}


def ref_call(call_id: str, arguments: dict[str, Any], name: str = "get_weather") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Case:
    id: str
    body: dict[str, Any]  # without "model" and "max_tokens"
    ref: list[dict[str, Any]]
    ref_tools: list[dict[str, Any]] | None = None
    ref_kwargs: dict[str, Any] = field(default_factory=dict)


ASK = user("Weather in Paris?")
REF_ASK = {"role": "user", "content": "Weather in Paris?"}
BILLING = text("x-anthropic-billing-header: cc_version=1.0; cch=abc123;")

CASES = [
    Case(
        "one-user-string",
        {"messages": [user("Say hello.")]},
        [{"role": "user", "content": "Say hello."}],
    ),
    Case(
        "system-string",
        {"system": "Answer in French.", "messages": [user("hi")]},
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}],
    ),
    Case(
        "system-blocks-joined-without-separator",
        {
            "system": [BILLING, text("You are terse. "), text("Use metric units."), text("")],
            "messages": [user("hi")],
        },
        [
            {"role": "system", "content": "You are terse. Use metric units."},
            {"role": "user", "content": "hi"},
        ],
    ),
    Case(
        "empty-system-is-dropped",
        {"system": "", "messages": [user("hi")]},
        [{"role": "user", "content": "hi"}],
    ),
    Case(
        "multi-turn",
        {"messages": [user("Hi"), assistant("Hello!"), user([text("Tell me a joke.")])]},
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ),
    Case(
        "text-blocks-joined",
        {"messages": [user([text("first"), text(""), text("second — 東京 ünï")])]},
        [{"role": "user", "content": "first\nsecond — 東京 ünï"}],
    ),
    Case(
        "thinking-text-and-tool-use",
        {
            "messages": [
                ASK,
                assistant(
                    [
                        {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "b3BhcXVl"},
                        text("Let me check."),
                        tool_use("t1", {"city": "Paris"}),
                        tool_use("t2", {"city": "Zürich"}),
                    ]
                ),
                user(
                    [
                        result("t1", "21 °C"),
                        result("t2", [text("18"), text("windy")]),
                        text("Thanks"),
                    ]
                ),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    ref_call("t1", {"city": "Paris"}),
                    ref_call("t2", {"city": "Zürich"}),
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "21 °C"},
            {"role": "tool", "tool_call_id": "t2", "content": "18\nwindy"},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "a-turn-of-tool-results-only",
        {
            "messages": [
                ASK,
                assistant([tool_use("t1", {"city": "Paris"})]),
                user([result("t1", "21")]),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {"role": "assistant", "content": "", "tool_calls": [ref_call("t1", {"city": "Paris"})]},
            {"role": "tool", "tool_call_id": "t1", "content": "21"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "tool-result-without-content",
        {
            "messages": [
                ASK,
                assistant([tool_use("t1", {})]),
                user([{"type": "tool_result", "tool_use_id": "t1"}]),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {"role": "assistant", "content": "", "tool_calls": [ref_call("t1", {})]},
            {"role": "tool", "tool_call_id": "t1", "content": ""},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "tool-result-in-an-assistant-turn",
        {"messages": [ASK, assistant([result("t0", [text("cached")])]), user("ok?")]},
        [
            REF_ASK,
            {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'cached'}]"},
            {"role": "user", "content": "ok?"},
        ],
    ),
    Case(
        "tool-use-without-input",
        {
            "messages": [
                ASK,
                assistant([{"type": "tool_use", "id": "t9", "name": "get_weather"}]),
                user([result("t9", "x")]),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {"role": "assistant", "content": "", "tool_calls": [ref_call("t9", {})]},
            {"role": "tool", "tool_call_id": "t9", "content": "x"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "inline-system-stays-in-place",
        {
            "system": "Top.",
            "messages": [user("a"), {"role": "system", "content": "Reminder."}, user("b")],
        },
        [
            {"role": "system", "content": "Top."},
            {"role": "user", "content": "a"},
            {"role": "system", "content": "Reminder."},
            {"role": "user", "content": "b"},
        ],
    ),
    Case(
        "inline-system-billing-header-dropped",
        {
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: 1"},
                {"role": "system", "content": [BILLING, text("kept")]},
                user("b"),
            ]
        },
        [{"role": "system", "content": "kept"}, {"role": "user", "content": "b"}],
    ),
    Case(
        "schema-without-type-gets-one",
        {"messages": [ASK], "tools": [{"name": "ping", "input_schema": {"properties": {}}}]},
        [REF_ASK],
        [
            {
                "type": "function",
                "function": {
                    "name": "ping",
                    "description": None,
                    "parameters": {"properties": {}, "type": "object"},
                },
            }
        ],
    ),
    Case(
        "strict-and-deferred-tools",
        {"messages": [ASK], "tools": [{**WEATHER, "strict": True, "defer_loading": True}]},
        [REF_ASK],
        [
            {
                "type": "function",
                "function": {**WEATHER_CHAT["function"], "strict": True, "defer_loading": True},
            }
        ],
    ),
    Case(
        "empty-tools",
        {"messages": [ASK], "tools": []},
        [REF_ASK],
        [],
    ),
    Case(
        "tool-changes-in-a-system-message",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": "ping"},
                        },
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
                ASK,
            ],
            "tools": [
                WEATHER,
                {"name": "ping", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
        },
        [REF_ASK],
        [
            {
                "type": "function",
                "function": {"name": "ping", "description": None, "parameters": {"type": "object"}},
            },
            {
                "type": "function",
                "function": {"name": "late", "description": None, "parameters": {"type": "object"}},
            },
        ],
    ),
    Case(
        "thinking-disabled",
        {"messages": [user("hi")], "thinking": {"type": "disabled"}},
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "none", "enable_thinking": False},
    ),
    Case(
        "thinking-enabled-changes-no-prompt",
        {
            "messages": [user("hi")],
            "max_tokens": 2048,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
        [{"role": "user", "content": "hi"}],
    ),
    Case(
        "output-effort",
        {"messages": [user("hi")], "output_config": {"effort": "high"}},
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "high", "enable_thinking": True},
    ),
    Case(
        "disabled-thinking-wins-over-effort",
        {
            "messages": [user("hi")],
            "output_config": {"effort": "max"},
            "thinking": {"type": "disabled"},
        },
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "none", "enable_thinking": False},
    ),
    Case(
        "template-kwargs",
        {"messages": [user("hi")], "chat_template_kwargs": {"enable_thinking": False}},
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"enable_thinking": False},
    ),
    Case(
        "fields-that-change-nothing",
        {
            "messages": [ASK],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "stream": True,
            "stop_sequences": ["\n\n"],
            "temperature": 0.3,
            "metadata": {"user_id": "u1"},
            "add_special_tokens": True,
            "n": 3,
        },
        [REF_ASK],
        [WEATHER_CHAT],
    ),
]


def _count(tokenizer: PoolTokenizer, body: dict[str, Any], **kw: Any) -> list[int]:
    body = {"model": "qwen", "max_tokens": 64, **body}
    before = copy.deepcopy(body)
    request = parse("messages", json.dumps(body).encode())
    first = count_prompts(tokenizer, request, **kw)
    assert count_prompts(tokenizer, request, **kw) == first
    assert request.body == before
    return first


def _expected(hf: Any, ref: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> int:
    prompt = hf.apply_chat_template(
        ref, tools=tools, tokenize=False, **{"add_generation_prompt": True, **kwargs}
    )
    return len(hf(prompt, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_messages_match_transformers(qwen: PoolTokenizer, qwen_hf: Any, case: Case) -> None:
    expected = _expected(qwen_hf, case.ref, case.ref_tools, case.ref_kwargs)
    assert _count(qwen, case.body) == [expected]


# --- a generated corpus ------------------------------------------------------------------------

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "tenants",
    "quotas",
    "数据",
    "模型",
    "naïve",
    "straße",
    "42",
    "don't",
    "<|im_start|>",
    "</think>",
    '{"k":',
    "[1]}",
    "Tool",
    "result:",
]


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def _generated(rng: random.Random, i: int) -> Case:
    body: dict[str, Any] = {}
    ref: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        if rng.random() < 0.5:
            body["system"] = _words(rng)
            ref.append({"role": "system", "content": body["system"]})
        else:
            texts = [_words(rng) for _ in range(rng.randint(1, 3))]
            body["system"] = [text(t) for t in texts]
            ref.append({"role": "system", "content": "".join(texts)})
    tools = rng.random() < 0.4
    if tools:
        body["tools"] = [WEATHER]
    messages: list[dict[str, Any]] = []
    pending: list[str] = []  # tool calls of the last assistant turn, answered by the next user turn
    for turn in range(rng.randint(1, 4)):
        blocks: list[dict[str, Any]] = []
        for call_id in pending:
            out = _words(rng)
            blocks.append(result(call_id, out if rng.random() < 0.5 else [text(out)]))
            ref.append({"role": "tool", "tool_call_id": call_id, "content": out})
        said = [_words(rng) for _ in range(rng.randint(0 if pending else 1, 2))]
        if said and not blocks and rng.random() < 0.5:
            messages.append(user(" ".join(said)))
            ref.append({"role": "user", "content": " ".join(said)})
        else:
            blocks += [text(t) for t in said]
            messages.append(user(blocks))
            if said:
                ref.append({"role": "user", "content": "\n".join(said)})
        pending = []
        if turn == 3 or rng.random() < 0.2:
            break
        content: list[dict[str, Any]] = []
        answer: dict[str, Any] = {"role": "assistant", "content": ""}
        if rng.random() < 0.3:
            thought = _words(rng)
            content.append({"type": "thinking", "thinking": thought, "signature": "s"})
            answer["reasoning_content"] = thought
        if rng.random() < 0.7:
            reply = _words(rng)
            content.append(text(reply))
            answer["content"] = reply
        if tools and rng.random() < 0.5:
            calls = []
            for k in range(rng.randint(1, 2)):
                args = {"city": rng.choice(["Paris", "東京", "Zürich"])}
                pending.append(f"t{turn}{k}")
                content.append(tool_use(pending[-1], args))
                calls.append(ref_call(pending[-1], args))
            answer["tool_calls"] = calls
        if not content:
            content.append(text("ok"))
            answer["content"] = "ok"
        plain = len(content) == 1 and content[0]["type"] == "text" and rng.random() < 0.5
        messages.append(assistant(content[0]["text"] if plain else content))
        ref.append(answer)
    body["messages"] = messages
    return Case(f"generated-{i:03d}", body, ref, [WEATHER_CHAT] if tools else None)


GENERATED = [_generated(random.Random(SEED + i), i) for i in range(80)]


def test_the_generated_corpus_varies_what_it_claims_to() -> None:
    blocks = [
        b["type"]
        for c in GENERATED
        for m in c.body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
    ]
    for kind in ("text", "thinking", "tool_use", "tool_result"):
        assert blocks.count(kind) >= 15, kind
    assert sum(isinstance(c.body.get("system"), list) for c in GENERATED) >= 10


@pytest.mark.parametrize("case", GENERATED, ids=[c.id for c in GENERATED])
def test_generated_messages_match_transformers(
    qwen: PoolTokenizer, qwen_hf: Any, case: Case
) -> None:
    assert _count(qwen, case.body) == [_expected(qwen_hf, case.ref, case.ref_tools, {})]


# --- what vLLM probes of the template ----------------------------------------------------------

SYSTEM_FIRST = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_template(tmp_path: Path, source: str) -> PoolTokenizer:
    path = tmp_path / "template.jinja"
    path.write_text(source)
    return PoolTokenizer.load(model_dir("qwen"), path)


def test_inline_system_messages_are_merged_where_the_template_needs_it(
    tmp_path: Path, qwen_hf: Any
) -> None:
    tokenizer = _with_template(tmp_path, SYSTEM_FIRST)
    body = {
        "system": "Top. ",
        "messages": [
            user("a"),
            {"role": "system", "content": [text("Reminder "), text("one.")]},
            user("b"),
        ],
    }
    ref = [
        {"role": "system", "content": "Top. Reminder one."},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    prompt = qwen_hf.apply_chat_template(
        ref, chat_template=SYSTEM_FIRST, tokenize=False, add_generation_prompt=True
    )
    assert _count(tokenizer, body) == [len(qwen_hf(prompt, add_special_tokens=False)["input_ids"])]
    assert messages_api._traits(tokenizer).merge_system


def test_the_disabled_thinking_effort_is_probed_as_vllm_probes_it(
    tmp_path: Path, qwen: PoolTokenizer
) -> None:
    # Qwen's template turns thinking off with enable_thinking false: "none" renders apart.
    assert messages_api._traits(qwen).disabled_effort == "none"
    assert not messages_api._traits(qwen).merge_system
    # A template blind to the effort renders "none" as it renders "high": vLLM sends "low".
    blind = _with_template(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert messages_api._traits(blind).disabled_effort == "low"
    # One that refuses "none" gets "low" too.
    refusing = _with_template(
        tmp_path,
        "{% if reasoning_effort == 'none' %}{{ raise_exception('no') }}{% endif %}"
        "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    assert messages_api._traits(refusing).disabled_effort == "low"


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": "qwen", "messages": [ASK]}, "max_tokens", "required"),
        ({"model": "qwen", "messages": [ASK], "max_tokens": 0}, "max_tokens", "positive"),
        ({"model": "qwen", "messages": "hi", "max_tokens": 5}, "messages", "array"),
        (
            {
                "model": "qwen",
                "messages": [ASK],
                "max_tokens": 2000,
                "thinking": {"type": "enabled", "budget_tokens": 2000},
            },
            "thinking.budget_tokens",
            "less than max_tokens",
        ),
        (
            {
                "model": "qwen",
                "messages": [ASK],
                "max_tokens": 2000,
                "thinking": {"type": "enabled", "budget_tokens": 100},
            },
            "thinking.budget_tokens",
            "at least 1024",
        ),
    ],
)
def test_bodies_refused_at_parse(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(Refusal) as refused:
        parse("messages", json.dumps(body).encode())
    assert refused.value.code.value == "invalid_request"
    assert (refused.value.param, says in refused.value.message) == (param, True)


def test_what_parse_reads() -> None:
    body = {
        "model": "qwen",
        "messages": [ASK],
        "max_tokens": 3000,
        "max_completion_tokens": 9,
        "n": 4,
        "min_tokens": 9,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    request = parse("messages", json.dumps(body).encode())
    assert request.limits == {"max_tokens": 3000}
    assert (request.n, request.min_tokens, request.runs_to_limit) == (1, 0, False)
    assert request.thinking_budget == 2048  # the clamped limit must stay above the budget
    # A disaggregated prefill leg is not checked (vLLM checks its decode leg).
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    assert parse("messages", json.dumps(leg).encode()).thinking_budget == 0


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "tool", "content": "x"}], "role user, assistant or system"),
        # Unhashable values are refused as well (a set lookup would raise TypeError: a 503).
        ([{"role": ["user"], "content": "x"}], "role user, assistant or system"),
        ([user([{"type": "video", "x": 1}])], "known 'type'"),
        ([user([{"type": ["text"], "text": "x"}])], "known 'type'"),
        ([user([{"type": "text", "text": 5}])], "wrong type"),
        (
            [user([{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}])],
            "only allowed",
        ),
        (
            [
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": "nope"},
                        }
                    ],
                },
                ASK,
            ],
            "not declared",
        ),
        ([], "no message"),
        (
            [
                user(
                    [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                        }
                    ]
                )
            ],
            "unsupported content part",
        ),
    ],
)
def test_messages_vllm_cannot_render_are_refused(
    qwen: PoolTokenizer, messages: list[Any], says: str
) -> None:
    with pytest.raises(Refusal) as refused:
        _count(qwen, {"messages": messages})
    assert refused.value.code.value == "invalid_request"
    assert refused.value.param == "messages"
    assert says in refused.value.message


def test_a_system_block_without_a_string_type_is_refused(qwen: PoolTokenizer) -> None:
    with pytest.raises(Refusal) as refused:
        _count(qwen, {"system": [{"type": {"text": "x"}}], "messages": [ASK]})
    assert (refused.value.code.value, refused.value.param) == ("invalid_request", "messages")
    assert "known 'type'" in refused.value.message


def test_an_image_counts_what_the_pool_declares(qwen: PoolTokenizer, qwen_hf: Any) -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://127.0.0.1/cat.png"}}
    body = {"messages": [user([text("What is this?"), image])]}
    text_only = _expected(qwen_hf, [{"role": "user", "content": "What is this?"}], None, {})
    # Anthropic image blocks are OpenAI image_url parts by the time vLLM renders them.
    assert _count(qwen, body, media_tokens={"image_url": 300}) == [text_only + 300]
    # Inside a tool result, the image follows in a user message of its own.
    with_result = {
        "messages": [
            ASK,
            assistant([tool_use("t1", {})]),
            user([result("t1", [text("see"), image])]),
        ],
    }
    ref = [
        REF_ASK,
        {"role": "assistant", "content": "", "tool_calls": [ref_call("t1", {})]},
        {"role": "tool", "tool_call_id": "t1", "content": "see"},
        {"role": "user", "content": ""},
    ]
    assert _count(qwen, with_result, media_tokens={"image_url": 300}) == [
        _expected(qwen_hf, ref, None, {}) + 300
    ]
