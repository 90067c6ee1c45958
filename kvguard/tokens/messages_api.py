"""An Anthropic Messages body turned into the chat request vLLM 0.32 renders for it:
`AnthropicServingMessages.to_chat_completion_request` (vllm/entrypoints/anthropic/serving.py),
whose chat messages then take the chat path (kvguard.tokens.chat_messages), as in vLLM.

Two of its choices depend on the model's chat template, and vLLM probes the template for them
once; so does kvguard (`_traits`): whether system messages inside `messages` are merged into
the leading system prompt (templates that refuse a system message after the first turn), and
which `reasoning_effort` `thinking: {"type": "disabled"}` becomes.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvguard.tokens.chat_arguments import function_definition
from kvguard.tokens.request import TokenizerError
from kvguard.tokens.responses_api import ChatInput
from kvguard.tokens.tokenizer import PoolTokenizer

_ROLES = frozenset({"user", "assistant", "system"})
_BLOCK_TYPES = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
_TOOL_CHANGES = ("tool_addition", "tool_removal")
# Claude Code's attribution block: vLLM drops it (its per-request hash defeats prefix caching).
_BILLING_HEADER = "x-anthropic-billing-header"
# The efforts vLLM tries against "none" for thinking.type "disabled" (AnthropicEffort).
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_PROBE = [{"role": "user", "content": "Hi"}]


def chat_input(body: Mapping[str, Any], tokenizer: PoolTokenizer) -> ChatInput:
    """The chat vLLM renders for this Messages body. Raises TokenizerError where vLLM answers
    400 (or fails)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise TokenizerError("messages must be an array")
    for i, message in enumerate(messages):
        _check_message(message, i)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
        if any(b["type"] in _TOOL_CHANGES for b in system):
            raise TokenizerError('tool changes are only allowed in messages with role "system"')
    merge = any(m["role"] == "system" for m in messages) and _traits(tokenizer).merge_system
    out: list[dict[str, Any]] = []
    parts: list[str] = []
    if system:
        if isinstance(system, str):
            parts.append(system)
        else:
            parts += [b["text"] for b in system if _plain_text(b)]
    if merge:
        parts += [t for m in messages if m["role"] == "system" and (t := _system_text(m))]
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            if not merge and (text := _system_text(message)):
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, out)
        if role != "user" or "content" in converted:  # a user turn of tool results only: none
            out.append(converted)
    if not out:
        raise TokenizerError("messages holds no message to render")
    options: dict[str, Any] = {
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "reasoning_effort": _effort(body, tokenizer),
    }
    return ChatInput(out, _tools(body.get("tools"), messages), options)


def _check_message(message: Any, i: int) -> None:
    # A role or type that is a list or an object is refused, not looked up (it is unhashable).
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in _ROLES:
        raise TokenizerError(f"messages[{i}] must be an object with role user, assistant or system")
    content: Any = message.get("content")
    if isinstance(content, str):
        return
    _check_blocks(content, f"messages[{i}].content")
    if message["role"] != "system" and any(b["type"] in _TOOL_CHANGES for b in content):
        raise TokenizerError('tool changes are only allowed in messages with role "system"')


def _check_blocks(blocks: object, where: str) -> None:
    """Content blocks as vLLM's AnthropicContentBlock validates the fields kvguard reads."""
    if not isinstance(blocks, list):
        raise TokenizerError(f"{where} must be a string or an array of content blocks")
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind not in _BLOCK_TYPES:
            raise TokenizerError(f"{where}[{j}] must be a content block with a known 'type'")
        for key, types in _BLOCK_FIELDS:
            if not isinstance(block.get(key), types):
                raise TokenizerError(f"{where}[{j}].{key} has the wrong type")
        if block["type"] in _TOOL_CHANGES and not isinstance(block.get("tool"), dict):
            raise TokenizerError(f"{where}[{j}]: tool is required for {block['type']} blocks")


_BLOCK_FIELDS: tuple[tuple[str, Any], ...] = (
    ("text", str | None),
    ("thinking", str | None),
    ("source", dict | None),
    ("id", str | None),
    ("tool_use_id", str | None),
    ("name", str | None),
    ("input", dict | None),
    ("content", str | list | None),
)


def _plain_text(block: dict[str, Any]) -> bool:
    """A text block vLLM keeps in a system prompt: non-empty, not the billing header."""
    text = block.get("text")
    return (
        block["type"] == "text"
        and isinstance(text, str)
        and bool(text)
        and (not text.startswith(_BILLING_HEADER))
    )


def _system_text(message: dict[str, Any]) -> str | None:
    """vLLM's `_extract_system_text` for a system message inside `messages`."""
    content = message["content"]
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    texts = [b["text"] for b in content if _plain_text(b)]
    return "".join(texts) if texts else None


def _convert_blocks(
    blocks: list[dict[str, Any]], role: str, message: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    """vLLM's `_convert_message_content`: text and images as content parts, thinking as
    reasoning, tool uses as tool calls; a user's tool results become tool messages, put
    before the message itself (into `out`)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    # vLLM's own id for a call without one: only its length can matter.
                    "id": block.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out += _tool_result(block)
            else:
                text = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if one_text else parts


def _tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's `_convert_user_tool_result`: a tool message with the result's text; its images
    in a user message after it, its tool references in a second tool message."""
    content = block.get("content")
    text, images, references = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                if not isinstance(value, str):
                    raise TokenizerError("a tool_result's text item needs a string 'text'")
                texts.append(value)
            elif kind == "image":
                source = item.get("source", {})
                if not isinstance(source, dict):
                    raise TokenizerError("a tool_result's image item needs a 'source' object")
                if url := _image_url(source):
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        out.append({"role": "user", "content": parts})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _image_url(source: dict[str, Any]) -> str:
    """vLLM's `_convert_image_source_to_url` (only its presence matters to a count: an image
    costs what the pool's media_tokens declare)."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tools(tools: object, messages: list[dict[str, Any]]) -> list[Any] | None:
    """vLLM's `_resolve_tools` and `_convert_tools`: the tools in effect at the end of the
    conversation (tool_addition and tool_removal blocks applied), as chat functions."""
    if tools is not None and not isinstance(tools, list):
        raise TokenizerError("tools must be an array")
    changes = [
        block
        for message in messages
        if not isinstance(message["content"], str)
        for block in message["content"]
        if block["type"] in _TOOL_CHANGES
    ]
    if not changes:
        return None if tools is None else [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    table = {}
    for i, tool in enumerate(tools or []):
        function = _function(tool, f"tools[{i}]")
        table[function["function"]["name"]] = function
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change.get("type") == "tool_definition":
            function = _function(change.get("definition"), f"{block['type']}.tool.definition")
            name = function["function"]["name"]
            table[name] = function
        else:
            name = change.get("name")
            if change.get("type") != "tool_reference" or not isinstance(name, str):
                raise TokenizerError(f"{block['type']}.tool must be a tool_reference or definition")
            if name not in table:
                raise TokenizerError(
                    f"{block['type']} references tool {name[:60]!r}, which is not declared in tools"
                )
            if block["type"] == "tool_addition":  # added by reference: no longer deferred
                table[name] = {
                    **table[name],
                    "function": {
                        k: v for k, v in table[name]["function"].items() if k != "defer_loading"
                    },
                }
        if block["type"] == "tool_removal":
            if change.get("type") != "tool_reference":
                raise TokenizerError("tool_removal only accepts a tool_reference")
            removed.add(name)
        else:
            removed.discard(name)
    return [function for name, function in table.items() if name not in removed]


def _function(tool: object, where: str) -> dict[str, Any]:
    """An AnthropicTool as the chat function vLLM makes of it; its `input_schema` gets
    `"type": "object"` when it has no type, as vLLM's validator adds it (last)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise TokenizerError(f"{where} must be an object with a string 'name'")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise TokenizerError(f"{where}.input_schema must be an object")
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    function = function_definition(
        tool["name"],
        tool.get("description"),
        schema,
        tool.get("strict"),
        tool.get("defer_loading"),
    )
    return {"type": "function", "function": function}


def _effort(body: Mapping[str, Any], tokenizer: PoolTokenizer) -> Any:
    """The reasoning_effort vLLM sets: `output_config.effort`, overridden by thinking
    disabled (the effort the template is known to turn thinking off with)."""
    effort = None
    config = body.get("output_config")
    if isinstance(config, dict):
        effort = config.get("effort")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = _traits(tokenizer).disabled_effort
    return effort


@dataclass(frozen=True, slots=True)
class _Traits:
    merge_system: bool  # inline system messages go into the leading system prompt
    disabled_effort: str  # the reasoning_effort for thinking.type "disabled"


_TRAITS: weakref.WeakKeyDictionary[PoolTokenizer, _Traits] = weakref.WeakKeyDictionary()


def probe(tokenizer: PoolTokenizer) -> None:
    """Probe the pool's templates as vLLM does at start-up (some 15 ms for Qwen's), so that no
    request pays for it; a pool without a chat template has nothing to probe."""
    with contextlib.suppress(TokenizerError):
        _traits(tokenizer)


def _traits(tokenizer: PoolTokenizer) -> _Traits:
    """What vLLM probes of the pool's templates, once per tokenizer (a race computes it twice,
    to the same value)."""
    traits = _TRAITS.get(tokenizer)
    if traits is None:
        merge = any(_needs_system_first(source) for source in tokenizer.template_sources())
        traits = _TRAITS[tokenizer] = _Traits(merge, _disabled_effort(tokenizer))
    return traits


# vLLM renders its probe in a plain sandbox: none of transformers' globals (raise_exception,
# strftime_now), so a template that calls them while rendering the probe counts as one that
# needs its system prompt first.
_PLAIN = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_SYSTEM_TWICE = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]


def _needs_system_first(source: str) -> bool:
    """vLLM's `_detect_merge_inline_system`: the template fails on a second system message."""
    try:
        _PLAIN.from_string(source).render(messages=_SYSTEM_TWICE, add_generation_prompt=False)
    except Exception:  # a template error; vLLM does not start on any other
        return True
    return False


def _disabled_effort(tokenizer: PoolTokenizer) -> str:
    """vLLM's `_probe_disabled_thinking_effort`: "none" unless the template refuses it or
    renders it as it renders some effort that thinks; then "low"."""

    def rendered(effort: str) -> str | None:
        try:
            return tokenizer.chat_prompt({"messages": _PROBE, "reasoning_effort": effort}).text
        except TokenizerError:
            return None

    none = rendered("none")
    if none is None or any(rendered(effort) == none for effort in _EFFORTS):
        return "low"
    return "none"
