"""Prompt token counts as vLLM's OpenAI server computes them (docs/design.md, "Counting rules").

Chat: messages are normalised as vLLM's `parse_chat_messages` (vllm/entrypoints/chat_utils.py)
does, the template arguments are merged as `ChatCompletionRequest.build_chat_params` and
`OnlineRenderer.preprocess_chat` merge them, and the template is rendered as transformers'
`apply_chat_template(tokenize=False)` does (kvguard.tokens.chat_template). Counting runs the Rust
`tokenizers` pipeline of tokenizer.json, which is what `AutoTokenizer.from_pretrained(folder)`
runs too: transformers ≥ 5 keeps the file's post-processor (a config's `add_bos_token` does
not rewrite it), so BOS is added exactly where tokenizer.json says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from kvguard.tokens.chat_arguments import normalise_tools, template_arguments
from kvguard.tokens.chat_messages import developer_as_system, normalise_messages
from kvguard.tokens.chat_template import ChatTemplate, ChatTemplateError
from kvguard.tokens.prefix_bound import PrefixBound, worth_bounding
from kvguard.tokens.request import TokenizerError
from kvguard.tokens.segments import SegmentCounter

__all__ = ["ChatPrompt", "PoolTokenizer", "TokenizerError"]

# Counts run on kvguard's own threads (kvguard.tokens.counting); tokenizers' rayon pool would
# split a batch of segments across more threads again, for more CPU and no gain. It reads the
# variable at each call.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str  # the rendered template, to be tokenized
    media_tokens: int  # declared tokens of its media parts, added to the text's count


_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class PoolTokenizer:
    """One pool's tokenizer and chat template(s); immutable after load, safe to share by threads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, ChatTemplate],
        special_tokens: Mapping[str, str],
    ) -> None:
        self._tokenizer = tokenizer
        self._segments = SegmentCounter.for_tokenizer(tokenizer)
        self._bound = (
            self._segments.bound
            if self._segments is not None
            else PrefixBound(tokenizer, whole_texts=True)
        )
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
                raise FileNotFoundError(
                    f"{required}: not found (a pool's tokenizer folder needs "
                    "tokenizer.json and tokenizer_config.json)"
                )
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path}: not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: must hold a JSON object")
        special = _special_tokens(config, config_path)
        templates = _load_templates(folder, config, chat_template)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ValueError(f"{path}: not a tokenizers file: {exc}") from None
        # vLLM counts whole prompts: a truncation or padding saved in the file must not apply.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        _add_missing_special_tokens(tokenizer, special, config)
        return cls(tokenizer, templates, special)

    @staticmethod
    def files(folder: str | Path, chat_template: str | Path | None = None) -> list[Path]:
        """The files `load(folder, chat_template)` reads (some may be absent)."""
        folder = Path(folder)
        # Without an override, folder/chat_template.jinja (when present) is the template.
        template = folder / "chat_template.jinja" if chat_template is None else Path(chat_template)
        return [folder / "tokenizer.json", folder / "tokenizer_config.json", template]

    def render_chat(self, request: Mapping[str, Any]) -> str:
        """The prompt text vLLM renders for this chat.completions body. Raises TokenizerError."""
        return self.chat_prompt(request).text

    def chat_prompt(
        self, request: Mapping[str, Any], media_tokens: Mapping[str, int] | None = None
    ) -> ChatPrompt:
        """The rendered prompt and the tokens declared for its media parts (`media_tokens`,
        per content-part type; a media part of another type is refused). Raises TokenizerError.
        """
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizerError("messages must be a non-empty array")
        return self.messages_prompt(
            messages, normalise_tools(request.get("tools")), request, media_tokens
        )

    def messages_prompt(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        options: Mapping[str, Any],
        media_tokens: Mapping[str, int] | None = None,
    ) -> ChatPrompt:
        """As `chat_prompt`, for chat messages built from another API's body: `tools` as vLLM
        hands them to the template, `options` the template fields of a chat body
        (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`,
        `reasoning_effort`). Raises TokenizerError."""
        args = template_arguments(options, tools)
        template = self._template_for(args.tools)
        chat, media = normalise_messages(messages, template.content_format, media_tokens)
        if not template.names_developer and any(m["role"] == "developer" for m in chat):
            chat = developer_as_system(chat)
        try:
            text = template.render(
                chat,
                tools=args.tools,
                documents=args.documents,
                add_generation_prompt=args.add_generation_prompt,
                continue_final_message=args.continue_final_message,
                variables={**self._special_tokens, **args.variables},
            )
        except ChatTemplateError as exc:
            raise TokenizerError(str(exc)) from None
        return ChatPrompt(text, media)

    def template_sources(self) -> list[str]:
        """The chat templates vLLM may render with, without tools and with them (one source
        when the folder has a single template). Raises TokenizerError without a template."""
        sources = [self._template_for(None).source, self._template_for([]).source]
        return sources[:1] if sources[0] == sources[1] else sources

    def count(self, text: str, add_special_tokens: bool, stop_at: int | None = None) -> int:
        """Tokens in `text`: segments between added tokens that were counted before are not
        tokenized again (kvguard.tokens.segments). Tokenizing releases the GIL. With `stop_at`, a
        count of `stop_at` or more may be a lower bound: a long text is counted only until it
        is known to reach it (kvguard.tokens.prefix_bound)."""
        return self.count_many([text], add_special_tokens, stop_at)[0]

    def count_many(
        self, texts: list[str], add_special_tokens: bool, stop_at: int | None = None
    ) -> list[int]:
        """Tokens in each text; `stop_at` as for `count`."""
        if self._segments is not None:
            return [self._segments.count(t, add_special_tokens, stop_at) for t in texts]
        bounded = {
            i: self._bound.count_at_least(text, stop_at, add_special_tokens)[0]
            for i, text in enumerate(texts)
            if stop_at is not None and worth_bounding(len(text), stop_at)
        }
        whole = [text for i, text in enumerate(texts) if i not in bounded]
        # encode_batch_fast: the same tokens as encode, without the offsets.
        encode = self._tokenizer.encode_batch_fast
        encoded = iter(encode(whole, add_special_tokens=add_special_tokens) if whole else [])
        return [bounded[i] if i in bounded else len(next(encoded)) for i in range(len(texts))]

    def reads_at_most(self, chars: int, stop_at: int | None) -> int:
        """About the most characters `count` tokenizes for a text of `chars` characters (or
        bytes) with `stop_at` (kvguard.tokens.prefix_bound)."""
        return self._bound.reads_at_most(chars, stop_at)

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
        # transformers also names any other `*_token` string (or AddedToken) a special token.
        named = key in _NAMED_SPECIAL_TOKENS or (
            key.endswith("_token")
            and (
                isinstance(value, str)
                or (isinstance(value, dict) and value.get("__type") == "AddedToken")
            )
        )
        if named and (text := _token_text(value, key, origin)) is not None:
            out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if (text := _token_text(value, key, origin)) is not None:
                out[str(key)] = text
    return out


def _add_missing_special_tokens(
    tokenizer: Tokenizer, special: dict[str, str], config: dict[str, Any]
) -> None:
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


def _load_templates(
    folder: Path, config: dict[str, Any], override: str | Path | None
) -> dict[str, ChatTemplate]:
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
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in source
    ):
        return {t["name"]: ChatTemplate(t["template"], f"{origin} ({t['name']})") for t in source}
    raise ValueError(
        f"{origin}: chat_template must be a string or a list of {{name, template}} objects"
    )
