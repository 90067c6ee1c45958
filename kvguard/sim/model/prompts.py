"""What the simulator reads from an OpenAI request: prompts, their token counts, the limits.

Prompt tokens come from kvguard's `x-kvguard-prompt-tokens` header when it is there (kvguard
counts exactly as vLLM does). Without it they are approximated, with no tokenizer:

- a prompt given as token ids counts its ids;
- text counts ceil(characters / 4) tokens (at least 1);
- a chat counts, per message, 4 tokens of template overhead plus its text (string content, or
  its text parts joined with "\\n"), and 3 tokens for the reply's header.

For prefix caching, a prompt's full blocks get keys that name all the content up to each
block's end: token ids exactly; text by the characters that fall in that block's share.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_OVERHEAD_TOKENS = 3
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default; chat has none
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")


class BadRequest(ValueError):
    """An invalid request; vLLM would answer 400."""


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int
    keys: tuple[Hashable, ...]
    digest: int  # a stable hash of the whole prompt (natural output lengths derive from it)


@dataclass(frozen=True, slots=True)
class Parsed:
    chat: bool
    model: str
    prompts: list[Prompt]
    max_tokens: int
    n: int
    stream: bool
    ignore_eos: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        """usage.prompt_tokens: summed over a batch's prompts, counted once for n > 1."""
        return sum(p.tokens for p in self.prompts)


def approximate_text(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    raise BadRequest("message content must be a string or a list of parts")


def chat_text(messages: list[Any]) -> tuple[str, int]:
    """The messages as one text (for cache keys) and their approximate token count."""
    texts, tokens = [], REPLY_OVERHEAD_TOKENS
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object")
        text = _content_text(message.get("content"))
        texts.append(f"{message.get('role', '')}\n{text}\n")
        tokens += MESSAGE_OVERHEAD_TOKENS + math.ceil(len(text) / CHARS_PER_TOKEN)
    return "".join(texts), tokens


def _digest(value: Hashable) -> int:
    """A stable hash (Python's own differs between processes for text)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big")


def block_keys(content: str | list[int], tokens: int, block_size: int) -> tuple[Hashable, ...]:
    """Chained keys of the full blocks of a prompt of `tokens` tokens."""
    keys: list[Hashable] = []
    previous: Hashable = None
    for index in range(tokens // block_size):
        if isinstance(content, str):
            start = len(content) * index * block_size // tokens
            end = len(content) * (index + 1) * block_size // tokens
            chunk: Hashable = content[start:end]
        else:
            chunk = tuple(content[index * block_size : (index + 1) * block_size])
        previous = _digest((previous, chunk))
        keys.append(previous)
    return tuple(keys)


def _positive(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer")
    return value


def _contents(chat: bool, body: Mapping[str, Any]) -> list[tuple[str | list[int], int]]:
    """Each prompt's content and approximate token count."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        return [chat_text(messages)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [(prompt, approximate_text(prompt))]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return [(list(prompt), len(prompt))]
    if isinstance(prompt, list) and prompt:
        out: list[tuple[str | list[int], int]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append((item, approximate_text(item)))
            elif isinstance(item, list) and item and all(type(t) is int for t in item):
                out.append((list(item), len(item)))
            else:
                raise BadRequest("'prompt' items must be strings or lists of token ids")
        return out
    raise BadRequest("'prompt' must be a string, token ids, or a non-empty list of them")


def parse(
    path: str,
    body: Any,
    header_tokens: str | None,
    *,
    max_model_len: int,
    block_size: int,
) -> Parsed:
    """Read a /v1/chat/completions or /v1/completions body; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    chat = path == "/v1/chat/completions"
    contents = _contents(chat, body)
    counts = [tokens for _, tokens in contents]
    if header_tokens is not None:
        try:
            total = int(header_tokens)
        except ValueError:
            raise BadRequest("x-kvguard-prompt-tokens must be an integer") from None
        # The header sums a batch's prompts: share it out in proportion to the approximation.
        approximate = sum(counts)
        counts = [max(1, total * c // approximate) for c in counts]
        counts[-1] = max(1, total - sum(counts[:-1]))
    limit = _positive(body, "max_completion_tokens") if chat else None
    limit = limit or _positive(body, "max_tokens")
    if limit is None and not chat:
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS
    longest = max(counts)
    if longest >= max_model_len:
        raise BadRequest(
            f"the prompt has {longest} tokens; this model's maximum context length is "
            f"{max_model_len} tokens"
        )
    max_tokens = max_model_len - longest if limit is None else limit
    if longest + max_tokens > max_model_len:
        raise BadRequest(
            f"max_tokens={max_tokens} with a prompt of {longest} tokens exceeds the maximum "
            f"context length of {max_model_len} tokens"
        )
    n = _positive(body, "n") or 1
    options = body.get("stream_options")
    return Parsed(
        chat=chat,
        model=str(body.get("model", "")),
        prompts=[
            Prompt(tokens, block_keys(content, tokens, block_size), _digest(repr(content)))
            for (content, _), tokens in zip(contents, counts, strict=True)
        ],
        max_tokens=max_tokens,
        n=n,
        stream=body.get("stream") is True,
        ignore_eos=body.get("ignore_eos") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )
