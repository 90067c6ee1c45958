"""An OpenAI Responses body turned into the chat messages, tools and template arguments vLLM
0.32 renders for it, as `OnlineRenderer.render_responses` does (without a Harmony model):
`construct_input_messages` and `construct_tool_dicts` (vllm/entrypoints/openai/responses/
utils.py), `ResponsesRequest.build_chat_params` (…/responses/protocol.py). The messages then
take the chat path (kvguard.tokens.chat_messages), as they do in vLLM.

Only what the body holds is counted: `previous_response_id`, which reads vLLM's store, is
refused by kvguard.tokens.request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.tokens.chat_arguments import function_definition
from kvguard.tokens.request import TokenizerError

# vLLM's names for what it builds (vllm/tool_parsers/utils.py): a namespace's functions are
# shown flat as `<namespace>__<name>`, a custom tool as a function of one string argument.
_NAMESPACE_SEPARATOR = "__"
_CUSTOM_INPUT = "input"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        _CUSTOM_INPUT: {
            "type": "string",
            "description": "The freeform text payload for this tool.",
        }
    },
    "required": [_CUSTOM_INPUT],
    "additionalProperties": False,
}
_PARTIAL = ("in_progress", "incomplete")


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What a non-chat body renders as: chat messages, the tools as the template gets them
    (None: none), and the template fields of an equivalent chat body."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    options: dict[str, Any]


def chat_input(body: Mapping[str, Any]) -> ChatInput:
    """The chat vLLM renders for this Responses body. Raises TokenizerError where vLLM
    answers 400 (or fails) and where kvguard cannot tell what it would render."""
    items = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if not isinstance(instructions, str | None):
        raise TokenizerError("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise TokenizerError(f"input[{i}] must be an object")
            message = _message(item, i, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
    else:
        raise TokenizerError("input must be a string or an array of input items")
    if not messages:
        raise TokenizerError("input holds no message to render")
    cont = _continues_final(items)
    options: dict[str, Any] = {
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "reasoning_effort": _effort(body.get("reasoning")),
    }
    return ChatInput(messages, _tools(body.get("tools")), options)


def _message(
    item: dict[str, Any], i: int, previous: dict[str, Any] | None
) -> dict[str, Any] | None:
    """vLLM's `_construct_message_from_response_item`: a new message, or None when the item
    was merged into the previous assistant message (which it then changes)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, i)
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            calls.append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        reasoning = _reasoning(item, i)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant" and kind in (None, "message"):
        text = _assistant_text(item.get("content"), i)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if isinstance(role, str) and kind in (None, "message"):
        return dict(item)  # user, system and developer messages go to the chat path as sent
    name = kind if isinstance(kind, str) else None
    raise TokenizerError(f"Unsupported input item type: {name!r:.60}")


def _tool_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise TokenizerError(f"input[{i}] ({item['type']}) needs a string call_id and name")
    arguments: Any
    if item["type"] == "custom_tool_call":
        text = item.get("input") or ""
        if not isinstance(text, str):
            raise TokenizerError(f"input[{i}].input must be a string")
        arguments = json.dumps({_CUSTOM_INPUT: text}, ensure_ascii=False)
    else:
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise TokenizerError(f"input[{i}].arguments must be a string (JSON)")
        namespace = item.get("namespace")
        if namespace:
            if not isinstance(namespace, str):
                raise TokenizerError(f"input[{i}].namespace must be a string")
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any], i: int) -> str:
    """The reasoning text vLLM passes on: the first content text, else the first summary's."""
    if item.get("encrypted_content"):
        raise TokenizerError("Encrypted content is not supported.")
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise TokenizerError(f"input[{i}].{key} must be an array")
        if parts:
            text = parts[0].get("text") if isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise TokenizerError(f"input[{i}].{key}[0] needs a string 'text'")
            return text
    return ""


def _assistant_text(content: object, i: int) -> str:
    """An assistant message's text as vLLM passes it on: the string, or the first part's text
    (later parts are dropped). An empty list or a first part without text makes vLLM fail."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        if isinstance(text, str):
            return text
    raise TokenizerError(
        f"input[{i}]: an assistant message needs its text as a string or in its first "
        "content part ('output_text')"
    )


def _continues_final(items: object) -> bool:
    """vLLM's `should_continue_final_message`: the last item is a message or reasoning whose
    status says it is unfinished, and is then continued rather than answered."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        _PARTIAL
    )


def _effort(reasoning: object) -> Any:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise TokenizerError("reasoning must be an object")
    return reasoning.get("effort")


def _tools(tools: object) -> list[Any] | None:
    """vLLM's `construct_tool_dicts`: function tools, a namespace's functions and custom tools
    as chat functions; built-in tools (web search, MCP, …) are not shown to the model. None
    without tools; an empty list when none of them is shown."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizerError("tools must be an array")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise TokenizerError(f"tools[{i}] must be an object with a string 'type'")
        if tool["type"] == "function":
            out.append(_function(tool, tool.get("name"), i))
        elif tool["type"] == "custom":
            custom = {"description": tool.get("description"), "parameters": _CUSTOM_PARAMETERS}
            out.append(_function(custom, tool.get("name"), i))
        elif tool["type"] == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise TokenizerError(f"tools[{i}]: a namespace needs a string name and tools")
            for fn in inner:
                if isinstance(fn, dict) and fn.get("type") == "function":
                    name = fn.get("name")
                    if not isinstance(name, str):
                        raise TokenizerError(f"tools[{i}]: a function needs a string name")
                    out.append(_function(fn, f"{namespace}{_NAMESPACE_SEPARATOR}{name}", i))
    return out


def _function(tool: dict[str, Any], name: object, i: int) -> dict[str, Any]:
    if not isinstance(name, str):
        raise TokenizerError(f"tools[{i}] needs a string 'name'")
    function = function_definition(
        name,
        tool.get("description"),
        tool.get("parameters"),
        tool.get("strict"),
        tool.get("defer_loading"),
    )
    return {"type": "function", "function": function}
