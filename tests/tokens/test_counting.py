"""kvguard.tokens.counting against transformers, through the entry point admission uses.

A generated corpus (fixed seed) of chat and completion requests goes through
`kvguard.tokens.request.parse` and `kvguard.tokens.counting.count_prompts`, inline and batched,
and must give exactly the token counts transformers gives: Qwen's files for chat and completions,
Llama 3.2's for completions. Each request's reference is built here, independently of kvguard's own
normalisation: what vLLM hands `apply_chat_template` (text parts joined with "\\n", tool-call
arguments parsed, null content as ""), then the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvguard import config as configs
from kvguard.admission import policy as policies
from kvguard.errors import Code, Refusal
from kvguard.testing.wait import wait_until
from kvguard.tokens import counting
from kvguard.tokens.counting import (
    INITIAL_BYTES_PER_S,
    INLINE_BODY_BYTES,
    LONG_WORK_BYTES,
    PromptCounter,
    count_prompts,
    work_bytes,
)
from kvguard.tokens.request import parse
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.conftest import model_dir
from tests.tokens import chat_cases as handwritten

transformers = pytest.importorskip("transformers")

SEED = 20251129


# --- the generated corpus -------------------------------------------------------------------

PROSE = (
    "the quick brown fox jumps over a lazy dog while engineers measure p99 latency across "
    "KV-cache blocks tenants quotas admission control vLLM Envoy gRPC stream token budget "
    "数据 中心 模型 推理 東京 서울 naïve façade Ærøskøbing straße 42 3.14159 2025-11-29 "
    "don't isn't I'm we'll"
)
WORDS = PROSE.split()
SNIPPETS = (
    "def area(r):\n    return 3.14159 * r ** 2\n",
    "SELECT id, name FROM users WHERE created_at > now() - interval '1 day';",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    "Emoji: 😀🚀👩‍👩‍👧‍👦🇫🇷 ✓",
    "Literal markers: <|im_start|> <|im_end|> <think> </tool_call> <|endoftext|>",
    "   spaced   out\t\ttabs\r\nand CRLF\n\n",
    "مرحبا بالعالم — שלום עולם — Привет, мир!",
    "ﬁ ligature, Å angstrom, é composed vs é decomposed",
)
TOOLS = (
    {
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
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Full-text search — über präzise, 検索",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object", "properties": {"year": {"type": "integer"}}},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time, ISO 8601",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
)


def _text(rng: random.Random, *, allow_empty: bool = False) -> str:
    if allow_empty and rng.random() < 0.05:
        return ""
    pieces = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.3:
            pieces.append(rng.choice(SNIPPETS))
        else:
            pieces.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))))
    if rng.random() < 0.05:
        pieces.append(handwritten.TEXTS["long"])  # ~3k tokens
    return rng.choice(["\n", " ", "\n\n"]).join(pieces)


def _content(rng: random.Random) -> tuple[Any, str]:
    """Message content as a client sends it, and as vLLM hands it to a "string" template."""
    if rng.random() < 0.65:
        text = _text(rng, allow_empty=True)
        return text, text
    texts = [_text(rng, allow_empty=True) for _ in range(rng.randint(1, 3))]
    parts: list[Any] = [
        {"type": rng.choice(["text", "text", "input_text"]), "text": t} for t in texts
    ]
    return parts, "\n".join(texts)


def _arguments(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "get_weather":
        return {"city": rng.choice(["Paris", "Zürich", "東京", "São Paulo"]), "unit": "C"}
    if name == "search_docs":
        return {"query": _text(rng)[:80], "filters": {"year": rng.randint(1990, 2025)}}
    return {"tz": rng.choice(["Europe/Paris", "Asia/Tokyo", "UTC"])}


@dataclass
class ChatCase:
    id: str
    body: dict[str, Any]
    ref_messages: list[dict[str, Any]]
    ref_tools: list[dict[str, Any]] | None
    ref_kwargs: dict[str, Any]
    special: bool


def _tool_turn(
    rng: random.Random, tools: list[dict[str, Any]], turn: int
) -> tuple[list[Any], list[Any]]:
    """An assistant message with tool calls and the tool results: sent, and as vLLM passes them."""
    names = [t["function"]["name"] for t in tools]
    calls, ref_calls = [], []
    for k in range(rng.randint(1, 2)):
        name = rng.choice(names)
        args = _arguments(rng, name)
        sent_args: Any = json.dumps(args, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.3:
            sent_args = args  # some clients send an object
        call_id = f"call_{turn}_{k}"
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": sent_args}}
        )
        ref_calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        )
    content, ref_content = (None, "") if rng.random() < 0.6 else _content(rng)
    sent = [{"role": "assistant", "content": content, "tool_calls": calls}]
    ref = [{"role": "assistant", "content": ref_content, "tool_calls": ref_calls}]
    for call in calls:
        result, ref_result = _content(rng)
        sent.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        ref.append({"role": "tool", "tool_call_id": call["id"], "content": ref_result})
    return sent, ref


def _chat_case(rng: random.Random, i: int) -> ChatCase:
    body: dict[str, Any] = {"model": "qwen"}
    messages: list[Any] = []
    ref: list[Any] = []
    tools = rng.sample(TOOLS, rng.randint(1, 3)) if rng.random() < 0.35 else []
    if rng.random() < 0.5:
        content, ref_content = _content(rng)
        messages.append({"role": "system", "content": content})
        ref.append({"role": "system", "content": ref_content})
    for turn in range(rng.randint(1, 4)):
        content, ref_content = _content(rng)
        messages.append({"role": "user", "content": content})
        ref.append({"role": "user", "content": ref_content})
        if tools and rng.random() < 0.5:
            sent_turn, ref_turn = _tool_turn(rng, tools, turn)
            messages += sent_turn
            ref += ref_turn
        if rng.random() < 0.6:
            content, ref_content = _content(rng)
            messages.append({"role": "assistant", "content": content})
            ref.append({"role": "assistant", "content": ref_content})
    body["messages"] = messages
    kwargs: dict[str, Any] = {}
    last = messages[-1]
    final = last["content"] if last["role"] == "assistant" else None
    # continue_final_message needs the final text rendered intact (no think tags).
    if isinstance(final, str) and final.strip() and "think>" not in final and rng.random() < 0.5:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        kwargs["continue_final_message"] = True
    if "continue_final_message" not in body and rng.random() < 0.2:
        body["add_generation_prompt"] = False
    kwargs["add_generation_prompt"] = body.get("add_generation_prompt", True)
    if tools:
        body["tools"] = tools
        choice = rng.choice(
            [None, "none", "auto", "required", {"type": "function", "function": {"name": "x"}}]
        )
        if isinstance(choice, dict):
            choice["function"]["name"] = tools[0]["function"]["name"]
        if choice is not None:
            body["tool_choice"] = choice  # never changes the prompt vLLM renders
    if rng.random() < 0.25:
        thinking = rng.random() < 0.5
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
        kwargs["enable_thinking"] = thinking
    elif rng.random() < 0.15:
        effort = rng.choice(["none", "low", "high"])
        body["reasoning_effort"] = effort
        kwargs["reasoning_effort"] = effort
        kwargs["enable_thinking"] = effort != "none"
    special = False
    if rng.random() < 0.2:
        special = rng.random() < 0.5
        body["add_special_tokens"] = special
    # Fields that change nothing vLLM counts in the prompt.
    if rng.random() < 0.3:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if rng.random() < 0.2:
        body["echo"] = True
    if rng.random() < 0.3:
        body["n"] = rng.randint(1, 4)
    if rng.random() < 0.5:
        body[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.randint(1, 2048)
    if rng.random() < 0.2:
        body |= {"temperature": 0.2, "logprobs": True, "top_logprobs": 2, "user": "u"}
    return ChatCase(f"chat-{i:03d}", body, ref, tools or None, kwargs, special)


@dataclass
class CompletionCase:
    id: str
    model: str
    body: dict[str, Any]
    max_model_len: int | None = None
    expected: list[Any] = field(default_factory=list)  # texts (str) or token counts (int)
    special: bool = True
    keep: int | None = None  # tokens vLLM keeps of each prompt (truncate_prompt_tokens)


def _completion_case(rng: random.Random, model: str, i: int) -> CompletionCase:
    vocab = 151_000 if model == "qwen" else 128_000
    form = rng.choice(["text", "texts", "ids", "id-lists"])
    if form == "text":
        prompt: Any = _text(rng)
        refs: list[Any] = [prompt]
    elif form == "texts":
        prompt = [_text(rng) for _ in range(rng.randint(1, 5))]
        refs = list(prompt)
    elif form == "ids":
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 400))]
        refs = [len(prompt)]
    else:
        prompt = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(3)]
        refs = [len(p) for p in prompt]
    case = CompletionCase(f"{model}-completion-{i:03d}", model, {"model": model, "prompt": prompt})
    case.expected = refs
    choice = rng.random()
    if choice < 0.15:
        case.body["add_special_tokens"] = False
        case.special = False
    elif choice < 0.25:
        value, case.special = rng.choice([("false", False), ("true", True), (0, False), (1, True)])
        case.body["add_special_tokens"] = value
    if rng.random() < 0.15:
        case.keep = rng.randint(1, 64)
        case.body["truncate_prompt_tokens"] = case.keep
    elif rng.random() < 0.05:
        case.body["truncate_prompt_tokens"] = -1
        case.max_model_len = rng.randint(8, 64)
        case.keep = case.max_model_len - 1
    if rng.random() < 0.2:
        case.body["echo"] = True
        case.body["max_tokens"] = rng.choice([0, 5])
    if rng.random() < 0.3:
        case.body["n"] = rng.randint(1, 4)
    if rng.random() < 0.2:
        case.body |= {"stream": True, "stream_options": {"include_usage": True}}
    return case


def _corpus() -> tuple[list[ChatCase], list[CompletionCase]]:
    rng = random.Random(SEED)
    chats = [_chat_case(rng, i) for i in range(150)]
    completions = [_completion_case(rng, m, i) for m in ("qwen", "llama") for i in range(60)]
    return chats, completions


CHATS, COMPLETIONS = _corpus()


def _counted(tokenizer: PoolTokenizer, kind: str, body: dict[str, Any], **kw: Any) -> list[int]:
    """count_prompts on a parse()d request, twice: the second count finds the text's segments
    counted before (kvguard.tokens.segments), and both must agree."""
    request = parse(kind, json.dumps(body).encode())
    first = count_prompts(tokenizer, request, **kw)
    assert count_prompts(tokenizer, request, **kw) == first
    return first


def test_corpus_size() -> None:
    """The requests whose counts are checked against transformers through count_prompts."""
    checked = len(handwritten.CASES) + len(CHATS) + len(COMPLETIONS)
    assert checked >= 200, checked
    assert len({c.id for c in CHATS} | {c.id for c in COMPLETIONS}) == len(CHATS) + len(COMPLETIONS)
    # The corpus really varies what it claims to.
    assert sum("tools" in c.body for c in CHATS) >= 20
    assert sum(c.body.get("continue_final_message", False) for c in CHATS) >= 5
    assert sum(any(isinstance(m["content"], list) for m in c.body["messages"]) for c in CHATS) > 30
    assert sum(any(m["role"] == "tool" for m in c.body["messages"]) for c in CHATS) >= 10
    assert sum("truncate_prompt_tokens" in c.body for c in COMPLETIONS) >= 10


@pytest.mark.parametrize("case", CHATS, ids=[c.id for c in CHATS])
def test_chat_corpus_matches_transformers(
    qwen: PoolTokenizer, qwen_hf: Any, case: ChatCase
) -> None:
    text = qwen_hf.apply_chat_template(
        case.ref_messages, tools=case.ref_tools, tokenize=False, **case.ref_kwargs
    )
    expected = len(qwen_hf(text, add_special_tokens=case.special)["input_ids"])
    assert _counted(qwen, "chat", case.body) == [expected]


@pytest.mark.parametrize("case", COMPLETIONS, ids=[c.id for c in COMPLETIONS])
def test_completion_corpus_matches_transformers(
    case: CompletionCase, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(case.model)
    hf = request.getfixturevalue(f"{case.model}_hf")
    expected = []
    for ref in case.expected:
        if isinstance(ref, int):
            expected.append(ref if case.keep is None else min(ref, case.keep))
            continue
        truncation = {} if case.keep is None else {"truncation": True, "max_length": case.keep}
        expected.append(len(hf(ref, add_special_tokens=case.special, **truncation)["input_ids"]))
    assert _counted(tokenizer, "completion", case.body, max_model_len=case.max_model_len) == (
        expected
    )


# --- request shapes around the count ---------------------------------------------------------

ASK = {"role": "user", "content": "Weather in Paris?"}
WEATHER = TOOLS[0]


def test_tool_choice_stream_options_and_echo_leave_the_count_alone(qwen: PoolTokenizer) -> None:
    with_tools = {"model": "q", "messages": [ASK], "tools": [WEATHER]}
    base = _counted(qwen, "chat", with_tools)
    for extra in (
        {"tool_choice": "none"},  # vLLM still renders the tools (unless the server excludes them)
        {"tool_choice": "auto"},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"echo": True, "stream": True, "stream_options": {"include_usage": True}},
    ):
        assert _counted(qwen, "chat", with_tools | extra) == base, extra
    assert _counted(qwen, "chat", {"model": "q", "messages": [ASK]}) < base


def test_empty_prompts_are_refused_as_vllm_refuses_them(
    qwen: PoolTokenizer, llama: PoolTokenizer
) -> None:
    with pytest.raises(Refusal, match="must be provided and non-empty") as info:
        parse("completion", b'{"model": "q", "prompt": ""}')
    assert info.value.param == "prompt"
    for body in ({"prompt": ["a", ""]}, {"prompt": "x", "truncate_prompt_tokens": 0}):
        with pytest.raises(Refusal, match="empty after tokenization") as info:
            _counted(qwen, "completion", {"model": "q", **body})
        assert (info.value.code, info.value.param) == (Code.INVALID_REQUEST, "prompt")
    # Llama 3.2 adds <|begin_of_text|>: an empty string is one token there, and vLLM takes it.
    assert _counted(llama, "completion", {"model": "l", "prompt": ["a", ""]}) == [2, 1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt_embeds": ["AAAA"]}, "prompt_embeds"),
        ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"prompt": "x", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": "x", "max_tokens": 0, "echo": "maybe"}, "echo"),
    ],
)
def test_completion_shapes_vllm_refuses(body: dict[str, Any], param: str) -> None:
    with pytest.raises(Refusal) as info:
        parse("completion", json.dumps({"model": "q", **body}).encode())
    assert (info.value.code, info.value.param) == (Code.INVALID_REQUEST, param)


def test_echo_with_zero_max_tokens_is_a_completion_shape() -> None:
    request = parse("completion", b'{"model": "q", "prompt": "x", "max_tokens": 0, "echo": true}')
    assert request.limits == {"max_tokens": 0}
    assert parse("completion", b'{"model": "q", "prompt": "x", "prompt_embeds": []}').limits == {}
    with pytest.raises(Refusal, match="positive integer"):
        parse("chat", b'{"model": "q", "messages": [{"role": "user"}], "max_tokens": 0}')


def test_truncation_keeps_what_vllm_keeps(qwen: PoolTokenizer) -> None:
    body = {"model": "q", "messages": [ASK], "truncate_prompt_tokens": 5}
    assert _counted(qwen, "chat", body) == [5]
    full = _counted(qwen, "chat", {"model": "q", "messages": [ASK]})[0]
    assert _counted(qwen, "chat", body | {"truncate_prompt_tokens": -1}, max_model_len=9) == [8]
    assert _counted(qwen, "chat", body | {"truncate_prompt_tokens": -1}) == [full]
    assert _counted(qwen, "chat", body | {"truncate_prompt_tokens": 10_000}) == [full]


# --- media parts -----------------------------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
COSTS = {"image_url": 576, "input_audio": 750}


def test_media_parts_cost_what_the_pool_declares(qwen: PoolTokenizer, qwen_hf: Any) -> None:
    text = [{"type": "text", "text": "Describe these."}, {"type": "text", "text": "Briefly."}]
    body = {"model": "q", "messages": [{"role": "user", "content": [IMAGE, *text, AUDIO, IMAGE]}]}
    # A "string" template: text parts joined as without the media, plus the declared costs.
    reference = qwen_hf.apply_chat_template(
        [{"role": "user", "content": "Describe these.\nBriefly."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = len(qwen_hf(reference, add_special_tokens=False)["input_ids"]) + 2 * 576 + 750
    assert _counted(qwen, "chat", body, media_tokens=COSTS) == [expected]
    inferred = {"image_url": {"url": "https://example.com/cat.png"}}  # no type: vLLM infers it
    body["messages"][0]["content"] = [inferred, *text]
    assert _counted(qwen, "chat", body, media_tokens=COSTS) == [expected - 576 - 750]
    body["messages"][0]["content"] = [*text, {"type": "video_url", "video_url": {"url": "v"}}]
    with pytest.raises(Refusal, match="'video_url': this pool counts text only") as info:
        _counted(qwen, "chat", body, media_tokens=COSTS)
    assert (info.value.code, info.value.param) == (Code.INVALID_REQUEST, "messages")


def test_media_parts_reach_an_openai_template_as_vllm_passes_them(
    tmp_path: Path, qwen_hf: Any
) -> None:
    path = tmp_path / "vision.jinja"
    path.write_text(handwritten.OPENAI_TEMPLATE, encoding="utf-8")
    tokenizer = PoolTokenizer.load(model_dir("qwen"), path)
    content = [{"type": "text", "text": "What is this?"}, IMAGE]
    body = {"model": "q", "messages": [{"role": "user", "content": content}]}
    reference = qwen_hf.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}],
            }
        ],
        chat_template=handwritten.OPENAI_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|image_pad|>" in reference
    expected = len(qwen_hf(reference, add_special_tokens=False)["input_ids"]) + 576
    assert _counted(tokenizer, "chat", body, media_tokens=COSTS) == [expected]


# --- a pool's own template, through the configuration -----------------------------------------


def test_pool_chat_template_file_is_loaded_through_the_config(tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "plain.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}",
        encoding="utf-8",
    )
    pool = {
        "name": "qwen",
        "models": ["qwen"],
        "tokenizer": str(model_dir("qwen")),
        "chat_template": "templates/plain.jinja",  # relative to the configuration file
        "max_model_len": 4096,
        "capacity": {"blocks": 100, "block_size": 16},
        "media_tokens": {"image_url": 64},
    }
    path = tmp_path / "kvguard.yaml"
    path.write_text(json.dumps({"pools": [pool]}), encoding="utf-8")
    loaded = policies.build(configs.load(path, environ={}))
    built = loaded.by_model["qwen"]
    assert built.config.media_tokens == {"image_url": 64}
    body = {"model": "qwen", "messages": [ASK]}
    assert built.tokenizer.render_chat(body) == "[user] Weather in Paris?\n[assistant] "
    request = parse("chat", json.dumps(body).encode())
    assert count_prompts(built.tokenizer, request) == [
        built.tokenizer.count("[user] Weather in Paris?\n[assistant] ", False)
    ]


# --- PromptCounter: inline, on the pool, and the bound on queued work --------------------------


class _Gated:
    """Wraps a tokenizer so that counts on threads of texts longer than `gate_chars` block
    until released, with a deadline; records how many ran at once, and the counts made on the
    event loop's thread (`inline`)."""

    def __init__(self, tokenizer: PoolTokenizer, gate_chars: int = 0) -> None:
        self._tokenizer = tokenizer
        self._gate_chars = gate_chars
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.running = self.most_running = self.inline = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def count_many(self, texts: list[str], special: bool, stop_at: int | None = None) -> list[int]:
        if threading.current_thread() is threading.main_thread():
            self.inline += 1
            return self._tokenizer.count_many(texts, special, stop_at)
        if sum(map(len, texts)) <= self._gate_chars:
            return self._tokenizer.count_many(texts, special, stop_at)
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.started.release()
        try:
            assert self.release.wait(10), "never released"
            return self._tokenizer.count_many(texts, special, stop_at)
        finally:
            with self.lock:
                self.running -= 1


def _completion(words: int) -> tuple[Any, int]:
    raw = json.dumps({"model": "q", "prompt": " ".join(["token"] * words)}).encode()
    return parse("completion", raw), len(raw)


def _work(tokenizer: PoolTokenizer, request: Any, body_bytes: int) -> int:
    return work_bytes(tokenizer, request, body_bytes, None)


async def _started(gate: _Gated, count: int = 1) -> None:
    for _ in range(count):
        assert await asyncio.to_thread(gate.started.acquire, True, 10), "count never started"


async def test_where_each_size_is_counted(qwen: PoolTokenizer) -> None:
    counter = PromptCounter(workers=1)
    gate: Any = _Gated(qwen)
    try:
        small, small_bytes = _completion(10)
        assert small_bytes <= INLINE_BODY_BYTES
        assert await counter.count(gate, small, small_bytes) == [10]
        assert (gate.inline, gate.most_running) == (1, 0)  # counted on the event loop
        medium, medium_bytes = _completion(5000)
        medium_work = _work(qwen, medium, medium_bytes)
        assert medium_bytes > INLINE_BODY_BYTES
        assert medium_work <= LONG_WORK_BYTES
        task = asyncio.create_task(counter.count(gate, medium, medium_bytes))
        await _started(gate)  # on a thread
        assert counter.pending_bytes == medium_work
        gate.release.set()
        assert await task == [5000]
        assert counter.pending_bytes == 0
    finally:
        gate.release.set()
        counter.close()


async def test_short_counts_never_wait_behind_long_ones(qwen: PoolTokenizer) -> None:
    long, long_bytes = _completion(12_000)
    medium, medium_bytes = _completion(5000)
    assert _work(qwen, long, long_bytes) > LONG_WORK_BYTES
    counter = PromptCounter(workers=2)
    gate: Any = _Gated(qwen, gate_chars=medium_bytes)  # holds the long counts only
    try:
        longs = [asyncio.create_task(counter.count(gate, long, long_bytes)) for _ in range(3)]
        await _started(gate, 2)  # two long counts on threads, the third one waiting
        # The thread kept free counts a shorter prompt while every long one is held.
        assert await counter.count(gate, medium, medium_bytes) == [5000]
        assert not any(task.done() for task in longs)
        gate.release.set()
        assert await asyncio.gather(*longs) == [[12_000]] * 3
        assert gate.most_running == 2
        assert counter.pending_bytes == 0
    finally:
        gate.release.set()
        counter.close()


async def test_queued_work_is_bounded(qwen: PoolTokenizer) -> None:
    long, long_bytes = _completion(12_000)
    work = _work(qwen, long, long_bytes)
    counter = PromptCounter(workers=2, pending_bytes=4 * work)
    gate: Any = _Gated(qwen)
    try:
        tasks = [asyncio.create_task(counter.count(gate, long, long_bytes)) for _ in range(4)]
        await _started(gate, 2)  # two counting, two waiting
        assert counter.pending_bytes == 4 * work
        with pytest.raises(Refusal, match="busy counting") as info:
            await counter.count(gate, long, long_bytes)
        assert (info.value.code, info.value.retry_after_s) == (Code.INTERNAL_ERROR, 1)
        tasks[3].cancel()  # a stream that goes away gives its waiting work back at once
        await asyncio.gather(tasks[3], return_exceptions=True)
        assert counter.pending_bytes == 3 * work
        gate.release.set()
        assert await asyncio.gather(*tasks[:3]) == [[12_000]] * 3
        assert gate.most_running == 2
        assert counter.pending_bytes == 0
    finally:
        gate.release.set()
        counter.close()


class _Slow:
    """A tokenizer whose counts on threads take at least `seconds` (a slow or busy host)."""

    def __init__(self, tokenizer: PoolTokenizer, seconds: float) -> None:
        self._tokenizer, self._seconds = tokenizer, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def count_many(self, texts: list[str], special: bool, stop_at: int | None = None) -> list[int]:
        threading.Event().wait(self._seconds)  # stands for slow counting, not a synchronisation
        return self._tokenizer.count_many(texts, special, stop_at)


async def test_the_backlog_bound_follows_the_measured_speed(
    qwen: PoolTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    long, long_bytes = _completion(12_000)
    work = _work(qwen, long, long_bytes)
    # Two long bodies fit in the backlog at the initial speed, not at 84 % of it.
    monkeypatch.setattr(counting, "MAX_BACKLOG_S", 2 * work / (0.9 * INITIAL_BYTES_PER_S))
    for slow_first in (False, True):
        counter = PromptCounter(workers=1)
        gate: Any = _Gated(qwen)
        try:
            if slow_first:  # 72 KB in >= 0.2 s: the average drops to <= 84 % of the start
                slow: Any = _Slow(qwen, 0.2)
                assert await counter.count(slow, long, long_bytes) == [12_000]
                assert counter.bytes_per_s <= 0.84 * INITIAL_BYTES_PER_S
            first = asyncio.create_task(counter.count(gate, long, long_bytes))
            await _started(gate)
            second = counter.count(gate, long, long_bytes)
            if slow_first:
                with pytest.raises(Refusal, match="busy counting"):
                    await second
            else:
                waiting = asyncio.create_task(second)
                await wait_for_pending(counter, 2 * work)
                gate.release.set()
                assert await waiting == [12_000]
            gate.release.set()
            assert await first == [12_000]
        finally:
            gate.release.set()
            counter.close()


async def wait_for_pending(counter: PromptCounter, expected: int) -> None:
    await wait_until(
        lambda: counter.pending_bytes == expected, "the request to get in line", timeout_s=10
    )


async def test_one_body_above_the_bound_is_still_counted(qwen: PoolTokenizer) -> None:
    long, long_bytes = _completion(12_000)
    counter = PromptCounter(workers=1, pending_bytes=long_bytes // 2)
    try:
        assert await counter.count(qwen, long, long_bytes) == [12_000]
    finally:
        counter.close()


async def test_token_ids_are_counted_however_much_is_queued(qwen: PoolTokenizer) -> None:
    """A prompt of token ids has nothing to tokenize: never refused as busy."""
    long, long_bytes = _completion(12_000)
    ids = json.dumps({"model": "q", "prompt": list(range(2000))}).encode()
    assert len(ids) > INLINE_BODY_BYTES
    counter = PromptCounter(workers=1, pending_bytes=1)
    gate: Any = _Gated(qwen)
    try:
        task = asyncio.create_task(counter.count(gate, long, long_bytes))
        await _started(gate)
        assert await counter.count(gate, parse("completion", ids), len(ids)) == [2000]
        gate.release.set()
        assert await task == [12_000]
    finally:
        gate.release.set()
        counter.close()
