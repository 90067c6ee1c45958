"""Chat messages normalised as vLLM's OpenAI server normalises them, before templating: vLLM's
`parse_chat_messages` (vllm/entrypoints/chat_utils.py). The tools and the other template
arguments are normalised and merged in kvguard.tokens.chat_arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvguard.tokens.chat_template import ContentFormat
from kvguard.tokens.request import TokenizerError

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


def normalise_messages(
    messages: list[Any], fmt: ContentFormat, media_tokens: Mapping[str, int] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """vLLM's `_parse_chat_message_content` and `_postprocess_messages`, on copies; and the
    tokens declared for their media parts (`media_tokens`: per part type; others are refused).

    Media parts reach an "openai" template as vLLM passes them ({"type": "image"} …); a
    "string" template gets vLLM's model-specific placeholders, which the declared cost covers.
    """
    out: list[dict[str, Any]] = []
    costs: list[int] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        role = message["role"]
        parts = _content_parts(message.get("content"), i, fmt, media_tokens or {}, costs)
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
    return out, sum(costs)


def developer_as_system(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` and `_consolidate_system_messages`
    (vllm/renderers/hf.py), for a template that never names the developer role: developer
    messages become system messages, and when a system message is then not alone at the
    start, every system message's text goes into one at the start ("\n\n" between them)."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in chat
    ]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else converted


def _content_parts(
    content: object, i: int, fmt: ContentFormat, media: Mapping[str, int], costs: list[int]
) -> list[Any]:
    """Text parts: strings for the "string" format (joined with "\\n"), dicts for "openai".
    Appends the declared cost of each media part to `costs`."""
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
        if kind == "media":
            if value not in media:
                raise TokenizerError(
                    f"unsupported content part type {value!r}: this pool counts text only "
                    "(its media_tokens declare no cost for this type)"
                )
            costs.append(media[value])
            if fmt == "openai":
                modality = next((m for m in ("audio", "video") if m in value), "image")
                out.append({"type": modality})
        elif fmt == "string":
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
            return "media", media
        if "tool_reference" not in part:
            raise TokenizerError("Missing 'type' field in multimodal part.")
        kind = "tool_reference"
    if not isinstance(kind, str):
        raise TokenizerError("Invalid 'type' field in multimodal part.")
    if kind in _MEDIA_PARTS:
        return "media", kind
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
