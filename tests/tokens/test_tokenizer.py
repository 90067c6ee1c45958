"""kvguard.tokens.tokenizer against transformers, the reference vLLM itself renders and tokenizes
with.

Each chat case (tests/tokens/chat_cases.py) holds the request kvguard sees and the reference
input: the messages, tools and template arguments vLLM 0.32 hands to `apply_chat_template` after
its own normalisation (text parts joined with "\\n" for "string" templates, tool-call arguments
parsed from JSON, null content as "", …). Prompts and counts must be exactly equal.
"""

from __future__ import annotations

import copy
import json
import shutil
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
from tests.tokens.chat_cases import CASES, OPENAI_TEMPLATE, TEXTS, WEATHER_TOOL, Case

transformers = pytest.importorskip("transformers")


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
