"""Prompt token counts as vLLM's OpenAI server computes them (DESIGN.md, "Token counts…").

Chat: messages are normalised as vLLM's `parse_chat_messages` (vllm/entrypoints/chat_utils.py)
does, the template arguments are merged as `ChatCompletionRequest.build_chat_params` and
`OnlineRenderer.preprocess_chat` merge them, and the template is rendered as transformers'
`apply_chat_template(tokenize=False)` does (kvguard.chat_template). Counting runs the Rust
`tokenizers` pipeline of tokenizer.json, which is what `AutoTokenizer.from_pretrained(folder)`
runs too: transformers ≥ 5 keeps the file's post-processor (a config's `add_bos_token` does
not rewrite it), so BOS is added exactly where tokenizer.json says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from kvguard.chat_template import ChatTemplate, ChatTemplateError, ContentFormat


class TokenizerError(ValueError):
    """vLLM would refuse this request (400). The message never quotes prompt text."""


_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                         "cls_token", "mask_token")
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}
_MEDIA_PARTS = ("image_url", "input_image", "image_embeds", "image_pil", "audio_url",
                "input_audio", "audio_embeds", "video_url", "prompt_embeds")
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# apply_chat_template's own parameters: it consumes them, the template never sees them.
_CALL_PARAMETERS = ("chat_template", "tokenize", "padding", "truncation", "max_length",
                    "return_tensors", "return_dict", "tokenizer_kwargs",
                    "sanitize_control_tokens", "return_assistant_tokens_mask")
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "defer_loading"})
# pydantic's lax bool, which vLLM's request model uses.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True)
class _TemplateArguments:
    tools: list[Any] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    variables: dict[str, Any]


class PoolTokenizer:
    """One pool's tokenizer and chat template(s); immutable after load, safe to share by threads."""

    def __init__(self, tokenizer: Tokenizer, templates: Mapping[str, ChatTemplate],
                 special_tokens: Mapping[str, str]) -> None:
        self._tokenizer = tokenizer
        self._templates = dict(templates)  # "default", and "tool_use" etc. for named templates
        self._special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, folder: str | Path, chat_template: str | Path | None = None) -> PoolTokenizer:
        """Read folder/tokenizer.json and folder/tokenizer_config.json; `chat_template` is a
        template file that replaces the folder's (vLLM's --chat-template).

        Raises FileNotFoundError for a missing file, ValueError for an unusable one.
        """
        folder = Path(folder)
        config_path, path = folder / "tokenizer_config.json", folder / "tokenizer.json"
        for required in (path, config_path):
            if not required.is_file():
                raise FileNotFoundError(f"{required}: not found (a pool's tokenizer folder needs "
                                        "tokenizer.json and tokenizer_config.json)")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path}: not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: must hold a JSON object")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ValueError(f"{path}: not a tokenizers file: {exc}") from None
        # vLLM counts whole prompts: a truncation or padding saved in the file must not apply.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        special = _special_tokens(config, config_path)
        _add_missing_special_tokens(tokenizer, special, config)
        return cls(tokenizer, _load_templates(folder, config, chat_template), special)

    def render_chat(self, request: Mapping[str, Any]) -> str:
        """The prompt text vLLM renders for this chat.completions body. Raises TokenizerError."""
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizerError("messages must be a non-empty array")
        args = _template_arguments(request, _normalise_tools(request.get("tools")))
        template = self._template_for(args.tools)
        try:
            return template.render(
                _normalise_messages(messages, template.content_format),
                tools=args.tools, documents=args.documents,
                add_generation_prompt=args.add_generation_prompt,
                continue_final_message=args.continue_final_message,
                variables={**self._special_tokens, **args.variables},
            )
        except ChatTemplateError as exc:
            raise TokenizerError(str(exc)) from None

    def chat_add_special_tokens(self, request: Mapping[str, Any]) -> bool:
        """The chat request's `add_special_tokens` (default false). Raises TokenizerError."""
        return _lax_bool(request.get("add_special_tokens", False), "add_special_tokens")

    def count(self, text: str, add_special_tokens: bool) -> int:
        """Tokens in `text`. Holds the GIL: for short texts only (see count_many)."""
        return len(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def count_many(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        """Tokens in each text; encode_batch releases the GIL, so worker threads run in parallel."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [len(e) for e in encodings]

    def _template_for(self, tools: list[Any] | None) -> ChatTemplate:
        # transformers' get_chat_template: named templates prefer "tool_use" when tools are sent.
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise TokenizerError("this model has no default chat template: chat requests are refused")


def _token_text(value: object, key: str, origin: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialised AddedToken
    raise ValueError(f"{origin}: {key} must be a string or an object with a string 'content'")


def _special_tokens(config: dict[str, Any], origin: Path) -> dict[str, str]:
    """The template variables transformers calls `special_tokens_map` (bos_token, …)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        # transformers also treats any other `*_token` string as a named special token.
        named = key in _NAMED_SPECIAL_TOKENS or (key.endswith("_token") and isinstance(value, str))
        if named and (text := _token_text(value, key, origin)) is not None:
            out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (text := _token_text(value, key, origin)) is not None:
                out[str(key)] = text
    return out


def _add_missing_special_tokens(tokenizer: Tokenizer, special: dict[str, str],
                                config: dict[str, Any]) -> None:
    # transformers adds configured special tokens that tokenizer.json lacks, so that they
    # match as one token in text; without this the counts would differ.
    listed = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = [t for t in listed if isinstance(t, str)] if isinstance(listed, list) else []
    present = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys([*special.values(), *extra]) if t not in present]
    if missing:
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in missing]
        )


def _load_templates(folder: Path, config: dict[str, Any],
                    override: str | Path | None) -> dict[str, ChatTemplate]:
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: chat template file not found")
        return {"default": ChatTemplate(path.read_text(encoding="utf-8"), str(path))}
    jinja = folder / "chat_template.jinja"  # where transformers ≥ 4.50 saves it; it wins
    if jinja.is_file():
        return {"default": ChatTemplate(jinja.read_text(encoding="utf-8"), str(jinja))}
    source, origin = config.get("chat_template"), str(folder / "tokenizer_config.json")
    if source is None:
        return {}
    if isinstance(source, str):
        return {"default": ChatTemplate(source, origin)}
    if isinstance(source, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str) for t in source
    ):
        return {t["name"]: ChatTemplate(t["template"], f"{origin} ({t['name']})") for t in source}
    raise ValueError(f"{origin}: chat_template must be a string or a list of "
                     "{name, template} objects")


def _lax_bool(value: object, field: str) -> bool:
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


def _template_arguments(request: Mapping[str, Any], tools: list[Any] | None) -> _TemplateArguments:
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TokenizerError("chat_template_kwargs must be an object")
    if request.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise TokenizerError("a chat template sent with the request is refused "
                             "(vLLM accepts one only with --trust-request-chat-template)")
    add_generation_prompt = _lax_bool(request.get("add_generation_prompt", True),
                                      "add_generation_prompt")
    continue_final = _lax_bool(request.get("continue_final_message", False),
                               "continue_final_message")
    if add_generation_prompt and continue_final:
        raise TokenizerError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
    effort = request.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort in _REASONING_EFFORTS):
        raise TokenizerError(f"reasoning_effort must be one of {sorted(_REASONING_EFFORTS)}")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final,
        "documents": request.get("documents"), "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = effort != "none"
    # build_chat_params: the request's own fields override chat_template_kwargs, which in turn
    # override the request's tools (preprocess_chat's defaults).
    inner = kwargs | {k: v for k, v in extra.items() if not _unset(v)}
    merged = ({} if tools is None else {"tools": tools}) | {
        k: v for k, v in inner.items() if not _unset(v)
    }
    if ("conversation" in merged or merged.get("sanitize_control_tokens")
            or merged.get("return_assistant_tokens_mask")):
        raise TokenizerError("chat_template_kwargs sets an apply_chat_template option that "
                             "fails without tokenization")
    for key in _CALL_PARAMETERS:
        merged.pop(key, None)
    tools, documents = merged.pop("tools", None), merged.pop("documents", None)
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not isinstance(value, list):
            raise TokenizerError(f"{name} must be an array")
    return _TemplateArguments(tools, documents, bool(merged.pop("add_generation_prompt")),
                              bool(merged.pop("continue_final_message")), merged)


def _normalise_tools(tools: object) -> list[Any] | None:
    """Each tool as vLLM's `ChatCompletionToolsParam.model_dump()` hands it to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizerError("tools must be an array")
    if not tools:
        raise TokenizerError("`tools` must not be an empty array. "
                             "Either provide at least one tool or omit the field entirely.")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise TokenizerError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": …}}}}'
            )
        if not isinstance(fn.get("description"), str | None) or not isinstance(
                fn.get("parameters"), dict | None):
            raise TokenizerError(f"tools[{i}].function: description must be a string, "
                                 "parameters an object")
        # Declared fields first (None included: templates print them), extras after them.
        function = {"name": fn["name"], "description": fn.get("description"),
                    "parameters": fn.get("parameters")}
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


def _normalise_messages(messages: list[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's `_parse_chat_message_content` and `_postprocess_messages`, on copies."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        role = message["role"]
        parts = _content_parts(message.get("content"), i, fmt)
        msg: dict[str, Any] = {"role": role,
                               "content": parts if fmt == "openai" else "\n".join(parts)}
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
        media = next((k for k in _MEDIA_PARTS
                      if k in part and (k != "input_audio" or part[k] is not None)), None)
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
