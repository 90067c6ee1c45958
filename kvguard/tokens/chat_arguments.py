"""A chat request's template arguments: its tools normalised as vLLM's
`ChatCompletionToolsParam` normalises them, and everything merged as
`ChatCompletionRequest.build_chat_params` and `OnlineRenderer.preprocess_chat`
(vllm/renderers/params.py `merge_kwargs`) merge it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.tokens.request import TokenizerError, lax_bool

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


@dataclass(frozen=True)
class TemplateArguments:
    tools: list[Any] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    variables: dict[str, Any]


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
        defer = fn.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")  # the tool's flag propagates to its function
        function = function_definition(
            fn["name"], fn.get("description"), fn.get("parameters"), fn.get("strict"), defer
        )
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = lax_bool(tool["defer_loading"], "defer_loading")
        out.append(dumped)
    return out


def function_definition(
    name: str,
    description: object,
    parameters: object,
    strict: object = None,
    defer_loading: object = None,
) -> dict[str, Any]:
    """A function as vLLM's `FunctionDefinition` dumps it for the template: its declared
    fields in their order (description and parameters even when None: templates print them),
    strict and defer_loading only when set, nothing else. Raises TokenizerError."""
    if not isinstance(description, str | None) or not isinstance(parameters, dict | None):
        raise TokenizerError(
            f"tool {name[:40]!r}: description must be a string, parameters an object"
        )
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for key, value in (("strict", strict), ("defer_loading", defer_loading)):
        if value is not None:
            function[key] = lax_bool(value, key)
    return function


def _unset(value: object) -> bool:
    # vLLM's merge_kwargs drops these when it merges (renderers/params.py).
    return value is None or (isinstance(value, str) and value == "auto")


def template_arguments(request: Mapping[str, Any], tools: list[Any] | None) -> TemplateArguments:
    """What vLLM hands the template for this chat body (`tools` already normalised).
    Raises TokenizerError where vLLM answers 400."""
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
