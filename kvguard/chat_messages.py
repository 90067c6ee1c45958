"""Chat requests normalised as vLLM's OpenAI server normalises them, before templating.

Messages follow vLLM's `parse_chat_messages` (vllm/entrypoints/chat_utils.py); template
arguments are merged as `ChatCompletionRequest.build_chat_params` and
`OnlineRenderer.preprocess_chat` merge them (vllm/renderers/params.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.chat_template import ContentFormat


class TokenizerError(ValueError):
    """vLLM would refuse this request (400). The message never quotes prompt text."""


_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = (
    "image_url",
    "input_image",
    "image_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "prompt_embeds",
)
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# apply_chat_template's own parameters: it consumes them, the template never sees them.
_CALL_PARAMETERS = (
    "chat_template",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
    "return_assistant_tokens_mask",
)
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "defer_loading"})
# pydantic's lax bool, which vLLM's request model uses.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True)
class TemplateArguments:
    tools: list[Any] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    variables: dict[str, Any]


def lax_bool(value: object, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise TokenizerError(f"{field} must be a boolean")


def _unset(value: object) -> bool:
    # vLLM's merge_kwargs drops these when it merges (renderers/params.py).
    return value is None or (isinstance(value, str) and value == "auto")


def template_arguments(request: Mapping[str, Any], tools: list[Any] | None) -> TemplateArguments:
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TokenizerError("chat_template_kwargs must be an object")
    if request.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise TokenizerError(
            "a chat template sent with the request is refused "
            "(vLLM accepts one only with --trust-request-chat-template)"
        )
    add_generation_prompt = lax_bool(
        request.get("add_generation_prompt", True), "add_generation_prompt"
    )
    continue_final = lax_bool(
        request.get("continue_final_message", False), "continue_final_message"
    )
    if add_generation_prompt and continue_final:
        raise TokenizerError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    effort = request.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort in _REASONING_EFFORTS):
        raise TokenizerError(f"reasoning_effort must be one of {sorted(_REASONING_EFFORTS)}")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "documents": request.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    # build_chat_params: the request's own fields override chat_template_kwargs, which in turn
    # override the request's tools (preprocess_chat's defaults).
    inner = kwargs | {k: v for k, v in extra.items() if not _unset(v)}
    merged = ({} if tools is None else {"tools": tools}) | {
        k: v for k, v in inner.items() if not _unset(v)
    }
    if (
        "conversation" in merged
        or merged.get("sanitize_control_tokens")
        or merged.get("return_assistant_tokens_mask")
    ):
        raise TokenizerError(
            "chat_template_kwargs sets an apply_chat_template option that "
            "fails without tokenization"
        )
    for key in _CALL_PARAMETERS:
        merged.pop(key, None)
    tools, documents = merged.pop("tools", None), merged.pop("documents", None)
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not isinstance(value, list):
            raise TokenizerError(f"{name} must be an array")
    return TemplateArguments(
        tools,
        documents,
        bool(merged.pop("add_generation_prompt")),
        bool(merged.pop("continue_final_message")),
        merged,
    )


def normalise_tools(tools: object) -> list[Any] | None:
    """Each tool as vLLM's `ChatCompletionToolsParam.model_dump()` hands it to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizerError("tools must be an array")
    if not tools:
        raise TokenizerError(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely."
        )
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise TokenizerError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": …}}}}'
            )
        if not isinstance(fn.get("description"), str | None) or not isinstance(
            fn.get("parameters"), dict | None
        ):
            raise TokenizerError(
                f"tools[{i}].function: description must be a string, parameters an object"
            )
        # Declared fields first (None included: templates print them), extras after them.
        function = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = fn.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")  # the tool's flag propagates to its function
        if defer is not None:
            function["defer_loading"] = defer
        function |= {k: v for k, v in fn.items() if k not in _FUNCTION_FIELDS}
        dumped = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = tool["defer_loading"]
        out.append(dumped)
    return out


def normalise_messages(messages: list[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's `_parse_chat_message_content` and `_postprocess_messages`, on copies."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        role = message["role"]
        parts = _content_parts(message.get("content"), i, fmt)
        msg: dict[str, Any] = {
            "role": role,
            "content": parts if fmt == "openai" else "\n".join(parts),
        }
        if role == "assistant":
            if message.get("tool_calls") is not None and (calls := _tool_calls(message, i)):
                msg["tool_calls"] = calls  # an empty list is dropped: templates take the plain path
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")  # the deprecated name
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            content = msg["content"]
            # Most templates expect a tool result as a string, so vLLM joins text-only lists.
            if isinstance(content, list) and all(p["type"] == "text" for p in content):
                msg["content"] = "\n".join(p["text"] for p in content)
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                msg[key] = message[key]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def _content_parts(content: object, i: int, fmt: ContentFormat) -> list[Any]:
    """Text parts: strings for the "string" format (joined with "\\n"), dicts for "openai"."""
    if content is None:
        return []
    if not isinstance(content, str | list):
        raise TokenizerError(f"messages[{i}].content must be a string, an array or null")
    out: list[Any] = []
    for part in [content] if isinstance(content, str) else content:
        parsed = _content_part(part, i)
        if parsed is None:
            continue
        kind, value = parsed
        if fmt == "string":
            out.append(value)
        elif kind == "text":
            out.append({"type": "text", "text": value})
        else:
            out.append({"type": "tool_reference", "name": value})
    return out


def _content_part(part: object, i: int) -> tuple[str, str] | None:
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise TokenizerError(f"messages[{i}].content parts must be strings or objects")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:  # vLLM then infers the kind from the keys
        media = next(
            (k for k in _MEDIA_PARTS if k in part and (k != "input_audio" or part[k] is not None)),
            None,
        )
        if media is not None:
            raise TokenizerError(f"unsupported content part type {media!r}: only text is counted")
        if "tool_reference" not in part:
            raise TokenizerError("Missing 'type' field in multimodal part.")
        kind = "tool_reference"
    if not isinstance(kind, str):
        raise TokenizerError("Invalid 'type' field in multimodal part.")
    if kind in _MEDIA_PARTS:
        raise TokenizerError(f"unsupported content part type {kind!r}: only text is counted")
    field = _TEXT_PARTS.get(kind, "name" if kind == "tool_reference" else None)
    if field is None:
        raise TokenizerError(f"unsupported content part type {kind[:40]!r}")
    value = part.get(field)
    if value is None and kind in ("text", "refusal"):
        return None  # vLLM skips these
    if not isinstance(value, str):
        raise TokenizerError(f"a {kind!r} content part needs a string {field!r}")
    return ("tool_reference" if kind == "tool_reference" else "text"), value


def _tool_calls(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise TokenizerError(f"messages[{i}].tool_calls must be an array")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict):
            raise TokenizerError(f"messages[{i}].tool_calls entries need a 'function' object")
        function = dict(fn)  # a copy: the parsed arguments must not reach the forwarded body
        args = function.get("arguments")
        # Templates expect arguments as objects: vLLM parses JSON strings, and anything it
        # cannot parse (or that is neither string, object nor array) becomes {}.
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                function["arguments"] = {}
            except RecursionError:
                raise TokenizerError(f"messages[{i}] tool call arguments nest too deeply") from None
        elif not isinstance(args, dict | list):
            function["arguments"] = {}
        out.append({**call, "function": function})
    return out
