"""OpenAI Responses bodies counted as vLLM 0.32 counts them, against transformers.

Each case holds the body kvguard sees and, built here by hand, what vLLM's `render_responses`
hands `apply_chat_template`: `instructions` as a system message, the input items as chat
messages (assistant text, reasoning and function calls merged into one assistant turn as
`construct_input_messages` merges them), the function tools as chat tools, the template
arguments of `build_chat_params`; tokenized with special tokens added (vLLM's Responses
tokenization does not turn them off). A generated corpus (fixed seed) adds mixed item lists.
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
from kvguard.tokens.counting import count_prompts, work_bytes
from kvguard.tokens.request import parse
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.conftest import model_dir

transformers = pytest.importorskip("transformers")

SEED = 20260131
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
}
WEATHER_CHAT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": WEATHER["parameters"],
    },
}
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


def user(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **extra}


def said(text: str, *more: str, **extra: Any) -> dict[str, Any]:
    """An assistant output message as the Responses API returns it."""
    parts = [{"type": "output_text", "text": t, "annotations": []} for t in (text, *more)]
    return {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": parts,
        **extra,
    }


def call(call_id: str, name: str, arguments: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": json.dumps(arguments),
        **extra,
    }


def output(call_id: str, text: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def reasoning(text: str, *, summary: bool = False) -> dict[str, Any]:
    part = [{"type": "summary_text" if summary else "reasoning_text", "text": text}]
    if summary:
        return {"type": "reasoning", "id": "rs_1", "summary": part}
    return {"type": "reasoning", "id": "rs_1", "summary": [], "content": part}


def ref_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Case:
    id: str
    body: dict[str, Any]  # without "model"
    ref: list[dict[str, Any]]  # the messages apply_chat_template gets
    ref_tools: list[dict[str, Any]] | None = None
    ref_kwargs: dict[str, Any] = field(default_factory=dict)


ASK = user("What is the weather in Paris?")
REF_ASK = {"role": "user", "content": "What is the weather in Paris?"}

CASES = [
    Case("input-string", {"input": "Say hello."}, [{"role": "user", "content": "Say hello."}]),
    Case(
        "instructions",
        {"instructions": "Answer in French.", "input": "Say hello."},
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Say hello."},
        ],
    ),
    Case(
        "empty-instructions-are-dropped",
        {"instructions": "", "input": "hi"},
        [{"role": "user", "content": "hi"}],
    ),
    Case("empty-input-string", {"input": ""}, [{"role": "user", "content": ""}]),
    Case("one-item", {"input": [ASK]}, [REF_ASK]),
    Case(
        "input-text-parts-joined",
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "first"},
                        {"type": "input_text", "text": "second — ünïcödé 東京"},
                    ],
                }
            ]
        },
        [{"role": "user", "content": "first\nsecond — ünïcödé 東京"}],
    ),
    Case(
        "multi-turn",
        {"input": [user("Hi"), said("Hello! How can I help?"), user("Tell me a joke.")]},
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ),
    Case(
        "assistant-as-easy-message",
        {"input": [user("Hi"), {"role": "assistant", "content": "Hello."}, user("Again")]},
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ],
    ),
    Case(
        "assistant-keeps-only-its-first-part",
        {"input": [user("Hi"), said("first part", "second part"), user("and?")]},
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "first part"},
            {"role": "user", "content": "and?"},
        ],
    ),
    Case(
        "developer-and-system-items",
        {
            "instructions": "Top.",
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"role": "system", "content": [{"type": "input_text", "text": "Inline."}]},
                user("Go"),
            ],
        },
        # Qwen's template never names the developer role: vLLM makes it a system message, then
        # merges the system messages into one at the start.
        [
            {"role": "system", "content": "Top.\n\nBe brief.\n\nInline."},
            {"role": "user", "content": "Go"},
        ],
    ),
    Case(
        "tools-listed",
        {"input": [ASK], "tools": [WEATHER]},
        [REF_ASK],
        [WEATHER_CHAT],
    ),
    Case(
        "function-call-and-output",
        {
            "input": [ASK, call("c1", "get_weather", {"city": "Paris"}), output("c1", "21 °C")],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [ref_call("c1", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21 °C"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "call-merged-into-the-assistant-text",
        {
            "input": [
                ASK,
                said("Let me look."),
                call("c1", "get_weather", {"city": "Paris"}),
                call("c2", "get_weather", {"city": "Lyon", "unit": "F"}),
                output("c1", "21"),
                output("c2", "70"),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    ref_call("c1", "get_weather", {"city": "Paris"}),
                    ref_call("c2", "get_weather", {"city": "Lyon", "unit": "F"}),
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21"},
            {"role": "tool", "tool_call_id": "c2", "content": "70"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "reasoning-merged-with-the-answer",
        {"input": [ASK, reasoning("Check the sky."), said("Sunny."), user("Thanks")]},
        [
            REF_ASK,
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "Check the sky."},
            {"role": "user", "content": "Thanks"},
        ],
    ),
    Case(
        "reasoning-in-the-last-turn",
        {"input": [ASK, reasoning("Check the sky."), said("Sunny.")]},
        [
            REF_ASK,
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "Check the sky."},
        ],
    ),
    Case(
        "reasoning-from-its-summary",
        {"input": [ASK, reasoning("In short: sun.", summary=True), said("Sunny.")]},
        [
            REF_ASK,
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "In short: sun."},
        ],
    ),
    Case(
        "reasoning-then-call",
        {
            "input": [
                ASK,
                reasoning("Need the tool."),
                call("c1", "get_weather", {"city": "Paris"}),
                output("c1", "21"),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Need the tool.",
                "tool_calls": [ref_call("c1", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "two-reasonings-two-turns",
        {"input": [ASK, reasoning("one"), reasoning("two")]},
        [
            REF_ASK,
            {"role": "assistant", "content": "", "reasoning_content": "one"},
            {"role": "assistant", "content": "", "reasoning_content": "two"},
        ],
    ),
    Case(
        "tool-output-parts-joined",
        {
            "input": [
                ASK,
                call("c1", "get_weather", {"city": "Paris"}),
                output(
                    "c1",
                    [{"type": "input_text", "text": "21"}, {"type": "input_text", "text": "sunny"}],
                ),
            ],
            "tools": [WEATHER],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [ref_call("c1", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21\nsunny"},
        ],
        [WEATHER_CHAT],
    ),
    Case(
        "custom-tool-and-call",
        {
            "input": [
                user("Patch it."),
                {
                    "type": "custom_tool_call",
                    "call_id": "p1",
                    "name": "apply_patch",
                    "input": "*** diff ü",
                },
                {"type": "custom_tool_call_output", "call_id": "p1", "output": "applied"},
            ],
            "tools": [{"type": "custom", "name": "apply_patch", "description": "Apply a diff"}],
        },
        [
            {"role": "user", "content": "Patch it."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [ref_call("p1", "apply_patch", {"input": "*** diff ü"})],
            },
            {"role": "tool", "tool_call_id": "p1", "content": "applied"},
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "apply_patch",
                    "description": "Apply a diff",
                    "parameters": CUSTOM_PARAMETERS,
                },
            }
        ],
    ),
    Case(
        "namespace-tools-flattened",
        {
            "input": [ASK, call("c1", "read", {"path": "/a"}, namespace="fs")],
            "tools": [
                {
                    "type": "namespace",
                    "name": "fs",
                    "description": "files",
                    "tools": [
                        {
                            "type": "function",
                            "name": "read",
                            "description": "Read",
                            "parameters": {"type": "object"},
                            "strict": True,
                        },
                        {"type": "custom", "name": "not_shown"},
                    ],
                },
                WEATHER,
            ],
        },
        [
            REF_ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [ref_call("c1", "fs__read", {"path": "/a"})],
            },
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "fs__read",
                    "description": "Read",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
            },
            WEATHER_CHAT,
        ],
    ),
    Case(
        "builtin-tools-are-not-shown",
        {
            "input": [ASK],
            "tools": [{"type": "web_search_preview"}, {"type": "mcp", "server_label": "x"}],
        },
        [REF_ASK],
        [],
    ),
    Case(
        "function-without-description-or-parameters",
        {
            "input": [ASK],
            "tools": [
                {
                    "type": "function",
                    "name": "ping",
                    "parameters": None,
                    "strict": False,
                    "defer_loading": True,
                }
            ],
        },
        [REF_ASK],
        [
            {
                "type": "function",
                "function": {
                    "name": "ping",
                    "description": None,
                    "parameters": None,
                    "strict": False,
                    "defer_loading": True,
                },
            }
        ],
    ),
    Case(
        "partial-assistant-is-continued",
        {"input": [user("Finish this: once upon"), said("Once upon a", status="in_progress")]},
        [
            {"role": "user", "content": "Finish this: once upon"},
            {"role": "assistant", "content": "Once upon a"},
        ],
        ref_kwargs={"continue_final_message": True, "add_generation_prompt": False},
    ),
    Case(
        "incomplete-user-message-is-continued",
        {"input": [user("Complete me", type="message", status="incomplete")]},
        [{"role": "user", "content": "Complete me"}],
        ref_kwargs={"continue_final_message": True, "add_generation_prompt": False},
    ),
    Case(
        "reasoning-effort-none",
        {"input": "hi", "reasoning": {"effort": "none"}},
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "none", "enable_thinking": False},
    ),
    Case(
        "reasoning-effort-high",
        {"input": "hi", "reasoning": {"effort": "high", "summary": "auto"}},
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "high", "enable_thinking": True},
    ),
    Case(
        "template-kwargs-win-over-effort",
        {
            "input": "hi",
            "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"enable_thinking": True},
        },
        [{"role": "user", "content": "hi"}],
        ref_kwargs={"reasoning_effort": "none", "enable_thinking": True},
    ),
    Case(
        "fields-that-change-nothing",
        {
            "input": "hi",
            "stream": True,
            "store": True,
            "tool_choice": "none",
            "text": {"format": {"type": "text"}},
            "temperature": 0.2,
            "n": 4,
            "add_special_tokens": False,
            "truncate_prompt_tokens": 1,
            "max_output_tokens": 9,
            "previous_input_messages": [{"role": "user", "content": "ignored without Harmony"}],
        },
        [{"role": "user", "content": "hi"}],
    ),
]


def _count(tokenizer: PoolTokenizer, body: dict[str, Any], **kw: Any) -> list[int]:
    """count_prompts on the parsed body, new and again (its segments seen before); the body is
    left as it was."""
    body = {"model": "qwen", **body}
    before = copy.deepcopy(body)
    request = parse("responses", json.dumps(body).encode())
    first = count_prompts(tokenizer, request, **kw)
    assert count_prompts(tokenizer, request, **kw) == first
    assert request.body == before
    return first


def _expected(hf: Any, ref: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> int:
    text = hf.apply_chat_template(
        ref, tools=tools, tokenize=False, **{"add_generation_prompt": True, **kwargs}
    )
    return len(hf(text, add_special_tokens=True)["input_ids"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_responses_match_transformers(qwen: PoolTokenizer, qwen_hf: Any, case: Case) -> None:
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
    "KV-cache",
    "blocks",
    "tenants",
    "quotas",
    "数据",
    "模型",
    "naïve",
    "façade",
    "straße",
    "42",
    "3.14159",
    "don't",
    "I'm",
    "<|im_start|>",
    "</think>",
    '{"a":',
    "1}",
]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def _generated(rng: random.Random, i: int) -> Case:
    """A conversation of random turns: user messages (strings or parts), assistant answers
    (output messages or plain), reasoning, function calls and their outputs."""
    body: dict[str, Any] = {}
    items: list[dict[str, Any]] = []
    ref: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        body["instructions"] = _text(rng)
        ref.append({"role": "system", "content": body["instructions"]})
    tools = rng.random() < 0.4
    if tools:
        body["tools"] = [WEATHER]
    for turn in range(rng.randint(1, 4)):
        if rng.random() < 0.3:
            texts = [_text(rng) for _ in range(rng.randint(1, 3))]
            parts = [{"type": "input_text", "text": t} for t in texts]
            items.append({"type": "message", "role": "user", "content": parts})
            ref.append({"role": "user", "content": "\n".join(texts)})
        else:
            text = _text(rng)
            items.append(user(text))
            ref.append({"role": "user", "content": text})
        assistant: dict[str, Any] | None = None
        if rng.random() < 0.4:
            thought = _text(rng)
            items.append(reasoning(thought))
            assistant = {"role": "assistant", "content": "", "reasoning_content": thought}
        if rng.random() < 0.6:
            answer = _text(rng)
            items.append(
                said(answer) if rng.random() < 0.5 else {"role": "assistant", "content": answer}
            )
            if assistant is None:
                assistant = {"role": "assistant", "content": answer}
            else:
                assistant["content"] = answer
        calls = []
        if tools and rng.random() < 0.5:
            for k in range(rng.randint(1, 2)):
                args = {"city": rng.choice(["Paris", "東京", "Zürich"])}
                items.append(call(f"c{turn}{k}", "get_weather", args))
                calls.append(ref_call(f"c{turn}{k}", "get_weather", args))
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
            assistant["tool_calls"] = calls
        if assistant is not None:
            ref.append(assistant)
        for c in calls:
            result = _text(rng)
            items.append(output(c["id"], result))
            ref.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    body["input"] = items
    return Case(f"generated-{i:03d}", body, ref, [WEATHER_CHAT] if tools else None)


GENERATED = [_generated(random.Random(SEED + i), i) for i in range(80)]


def test_the_generated_corpus_varies_what_it_claims_to() -> None:
    kinds = [item.get("type") for case in GENERATED for item in case.body["input"]]
    for kind in ("reasoning", "function_call", "function_call_output", "message"):
        assert kinds.count(kind) >= 15, kind
    assert sum("instructions" in c.body for c in GENERATED) >= 20
    assert (
        sum(
            any(m["role"] == "assistant" and m.get("tool_calls") and m["content"] for m in c.ref)
            for c in GENERATED
        )
        >= 5
    )


@pytest.mark.parametrize("case", GENERATED, ids=[c.id for c in GENERATED])
def test_generated_responses_match_transformers(
    qwen: PoolTokenizer, qwen_hf: Any, case: Case
) -> None:
    assert _count(qwen, case.body) == [_expected(qwen_hf, case.ref, case.ref_tools, {})]


# --- around the count --------------------------------------------------------------------------


def test_special_tokens_are_added_as_vllm_adds_them_for_responses(tmp_path: Path) -> None:
    """vLLM tokenizes a Responses prompt with special tokens added: with a tokenizer whose
    post-processor adds BOS and a template that writes it too, the prompt holds two."""
    template = tmp_path / "template.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
        "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    )
    llama = PoolTokenizer.load(model_dir("llama3.2"), template)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir("llama3.2"))
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    with_bos = len(hf(text, add_special_tokens=True)["input_ids"])
    assert with_bos == len(hf(text, add_special_tokens=False)["input_ids"]) + 1
    assert _count(llama, {"input": "hi"}) == [with_bos]
    # A client's own add_special_tokens is not a Responses field: vLLM ignores it.
    assert _count(llama, {"input": "hi", "add_special_tokens": False}) == [with_bos]


def test_truncation_auto_keeps_what_vllm_keeps(qwen: PoolTokenizer, qwen_hf: Any) -> None:
    body = {"input": " ".join(["word"] * 300), "truncation": "auto"}
    whole = _count(qwen, {"input": body["input"]})[0]
    assert whole > 100
    assert _count(qwen, body, max_model_len=100) == [99]
    assert _count(qwen, {**body, "truncation": "disabled"}, max_model_len=1000) == [whole]
    with pytest.raises(Refusal) as refused:
        _count(qwen, {**body, "truncation": "disabled"}, max_model_len=100)
    assert refused.value.code.value == "context_length_exceeded"
    assert refused.value.param == "input"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": 5}, "input", "string or an array"),
        (
            {"input": "x", "previous_response_id": "resp_1"},
            "previous_response_id",
            "stored response",
        ),
        ({"input": "x", "background": True}, "background", "outlive"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"input": "x", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", "positive integer"),
    ],
)
def test_bodies_refused_at_parse(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(Refusal) as refused:
        parse("responses", json.dumps({"model": "qwen", **body}).encode())
    assert refused.value.code.value == "invalid_request"
    assert refused.value.param == param
    assert says in refused.value.message


@pytest.mark.parametrize(
    ("items", "says"),
    [
        ([{"type": "item_reference", "id": "msg_1"}], "Unsupported input item type"),
        (
            [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "gAAA"}],
            "Encrypted",
        ),
        (
            [
                ASK,
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "m",
                    "status": "completed",
                    "content": [{"type": "refusal", "refusal": "no"}],
                },
            ],
            "assistant message",
        ),
        ([ASK, {"role": "assistant", "content": []}], "assistant message"),
        (
            [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}],
            "arguments",
        ),
        ([], "no message"),
        (["just a string"], "must be an object"),
        ([user([{"type": "input_file", "file_id": "f"}])], "unsupported content part"),
    ],
)
def test_inputs_vllm_cannot_render_are_refused(
    qwen: PoolTokenizer, items: list[Any], says: str
) -> None:
    with pytest.raises(Refusal) as refused:
        _count(qwen, {"input": items})
    assert refused.value.code.value == "invalid_request"
    assert refused.value.param == "input"
    assert says in refused.value.message


def test_what_parse_reads(qwen: PoolTokenizer) -> None:
    request = parse(
        "responses",
        json.dumps(
            {
                "model": "qwen",
                "input": "x",
                "max_output_tokens": 7,
                "max_tokens": 99,
                "n": 3,
                "min_tokens": 5,
                "ignore_eos": True,
            }
        ).encode(),
    )
    # Only Responses' own limit is read and clamped; n and min_tokens are not Responses fields.
    assert request.limits == {"max_output_tokens": 7}
    assert (request.n, request.min_tokens, request.runs_to_limit) == (1, 0, True)
    assert request.truncate_prompt_tokens is None


def test_an_image_counts_what_the_pool_declares(qwen: PoolTokenizer, qwen_hf: Any) -> None:
    image = {"type": "input_image", "image_url": "https://127.0.0.1/cat.png"}
    body = {"input": [user([{"type": "input_text", "text": "What is this?"}, image])]}
    with pytest.raises(Refusal):
        _count(qwen, body)
    text_only = _expected(qwen_hf, [{"role": "user", "content": "What is this?"}], None, {})
    # vLLM joins the text parts around a placeholder; the declared cost covers the image.
    assert _count(qwen, body, media_tokens={"input_image": 500}) == [text_only + 500]


def test_a_long_input_weighs_what_its_count_reads(qwen: PoolTokenizer) -> None:
    """The input and instructions are prompt text: they count in a body's counting work."""
    small = parse("responses", json.dumps({"model": "qwen", "input": "x"}).encode())
    big_body = {"model": "qwen", "input": "word " * 20_000, "instructions": "be " * 5_000}
    big = parse("responses", json.dumps(big_body).encode())
    raw = len(json.dumps(big_body))
    assert work_bytes(qwen, big, raw, None) >= 100_000 + 15_000
    assert work_bytes(qwen, small, 40, None) < 200
