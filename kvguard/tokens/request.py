"""Parse and validate a request body (OpenAI's chat, completions and Responses APIs, Anthropic's
Messages API), as far as admission needs it.

Only what decides the reservation is checked here (model, prompt shape, n, token limits);
everything else is vLLM's business and passes through untouched. Counting and templating read
more fields later, with `lax_bool`, and refuse them with `TokenizerError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvguard.errors import invalid

# chat and completion: OpenAI's Chat Completions and Completions; responses: OpenAI's Responses
# API; messages: Anthropic's Messages API (vLLM serves it at /v1/messages).
Kind = Literal["chat", "completion", "responses", "messages"]

# The token-limit fields vLLM reads, in the order it reads them
# (`max_completion_tokens or max_tokens` for chat; completions only know `max_tokens`). The last
# is the one injected when a request sends none (Messages requires its own).
LIMIT_FIELDS: dict[Kind, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completion": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}
ALL_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")
# The body field that holds the prompt, as refusals about the prompt name it.
PROMPT_FIELD: dict[Kind, str] = {
    "chat": "messages",
    "completion": "prompt",
    "responses": "input",
    "messages": "messages",
}

GUARDED_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
# pydantic's lax bool, which vLLM's request model uses.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class TokenizerError(ValueError):
    """vLLM would refuse this request (400). The message never quotes prompt text."""


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: Kind
    model: str
    body: dict[str, Any]
    n: int
    limits: dict[str, int]  # limit fields the client sent with a value
    # vLLM keeps this many prompt tokens (-1: as many as fit); None: no truncation.
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0  # vLLM generates at least this many (it must not exceed max_tokens)
    # `ignore_eos` or `use_beam_search`: it runs to its limit (or holds beams), so it reserves
    # the whole limit whatever the reservation mode.
    runs_to_limit: bool = False
    # Messages' thinking.budget_tokens (0: none): vLLM refuses a limit at or below it.
    thinking_budget: int = 0


def guarded_kind(path: str) -> Kind | None:
    """The kind of a guarded path, whatever its query string; None for any other path."""
    return GUARDED_PATHS.get(path.split("?", 1)[0])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(Exception):
    """An object of the body holds a key twice (raised through json.loads)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers disagree on a repeated key (the last wins here, the first or an error elsewhere),
    # so the body vLLM reads could differ from the one kvguard metered.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey
    return obj


# One decoder for every body: json.loads with arguments builds a new one at each call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_object)


def load_json(text: str) -> Any:
    """The JSON document `text`, refusing NaN/Infinity and repeated keys in any object.
    Raises ValueError (or RecursionError) when it is not JSON, and Refusal(invalid_request)
    naming the path of a repeated key."""
    try:
        return _DECODER.decode(text)
    except _DuplicateKey:
        path = duplicate_key_path(text)
    raise invalid(f"the request body has the key {path} more than once; send each key once", path)


class _Repeated(dict[str, Any]):
    """An object parsed with a repeated key (only while looking for where it is)."""

    key: str


def _marking_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _Repeated(obj)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.key = key
            break
        seen.add(key)
    return marked


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_KEY_CHARS = 64  # of a repeated key quoted in an answer: keys are the client's text


def duplicate_key_path(text: str) -> str:
    """Where the first repeated key of `text` (JSON holding one) is: `messages[0].role`."""
    todo: list[tuple[str, Any]] = [("", json.loads(text, object_pairs_hook=_marking_object))]
    while todo:  # depth first, in document order
        path, value = todo.pop()
        if isinstance(value, _Repeated):
            return _child(path, value.key)
        # Only objects and arrays can hold one: a long array of numbers costs no paths.
        if isinstance(value, dict):
            inner = [(_child(path, k), v) for k, v in value.items() if isinstance(v, dict | list)]
        elif isinstance(value, list):
            inner = [(f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, dict | list)]
        else:
            continue
        todo.extend(reversed(inner))
    raise AssertionError("no repeated key found")  # pragma: no cover - the caller saw one


def _child(path: str, key: str) -> str:
    if _NAME.fullmatch(key):
        return f"{path}.{key}" if path else key
    if len(key) > MAX_KEY_CHARS:
        key = key[:MAX_KEY_CHARS] + "…"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise invalid(f"'{key}' must be a positive integer", key)
    return value


def lax_bool(value: object, field: str) -> bool:
    """A boolean field as vLLM's request model reads it; raises TokenizerError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise TokenizerError(f"{field} must be a boolean")


def parse(kind: Kind, raw: bytes) -> InferenceRequest:
    """Validate the body; raises Refusal(invalid_request) with a message naming the field."""
    try:
        # Decoded here, strictly: json.loads would let a surrogate's UTF-8 bytes through.
        text = raw.decode()
        body = load_json(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise invalid("the request body is not valid JSON in UTF-8") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if ("\\ud" in text or "\\uD" in text) and _holds_lone_surrogate(body):
        raise invalid(
            "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which "
            "is not text"
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string", "model")
    if kind == "responses":
        return _responses(model, body)
    if kind == "messages":
        return _messages(model, body)
    if kind == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"), body.get("prompt_embeds"))
    n = _positive_int(body, "n") or 1
    limits = {}
    for key in ALL_LIMIT_FIELDS:
        value = 0 if kind == "completion" and _echo_only(body, key) else _positive_int(body, key)
        if value is not None:
            limits[key] = value
    to_limit = _flag(body, "ignore_eos") or _flag(body, "use_beam_search")
    return InferenceRequest(
        kind, model, body, n, limits, _truncation(body), _min_tokens(body), to_limit
    )


def _responses(model: str, body: dict[str, Any]) -> InferenceRequest:
    """An OpenAI Responses body (vLLM's ResponsesRequest): no `n`, no `min_tokens`; `truncation:
    "auto"` keeps what fits, as `truncate_prompt_tokens: -1` does. What needs state vLLM keeps
    between requests is refused: kvguard counts only what the body holds."""
    if not isinstance(body.get("input"), str | list):
        raise invalid("'input' must be a string or an array of input items", "input")
    if body.get("previous_response_id") is not None:
        raise invalid(
            "'previous_response_id' is not supported here: the prompt would include a stored "
            "response that kvguard cannot count; send the conversation in 'input'",
            "previous_response_id",
        )
    if _flag(body, "background"):
        raise invalid(
            "'background' is not supported here: the generation would outlive the request "
            "that holds its KV-cache reservation",
            "background",
        )
    if body.get("prompt") is not None:
        raise invalid("prompt template is not supported", "prompt")  # vLLM's answer
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise invalid("'truncation' must be 'auto' or 'disabled'", "truncation")
    limits = {}
    if (value := _positive_int(body, "max_output_tokens")) is not None:
        limits["max_output_tokens"] = value
    keep = -1 if truncation == "auto" else None
    return InferenceRequest("responses", model, body, 1, limits, keep, 0, _flag(body, "ignore_eos"))


def _messages(model: str, body: dict[str, Any]) -> InferenceRequest:
    """An Anthropic Messages body (vLLM's AnthropicMessagesRequest): `max_tokens` required; an
    extended-thinking budget must stay below the limit, as vLLM checks."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("'messages' must be an array", "messages")
    max_tokens = _positive_int(body, "max_tokens")
    if max_tokens is None:
        raise invalid("'max_tokens' is required", "max_tokens")
    budget: Any = 0
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1024:
            raise invalid(
                "'thinking.budget_tokens' must be an integer of at least 1024",
                "thinking.budget_tokens",
            )
        transfer = body.get("kv_transfer_params")
        if isinstance(transfer, dict) and transfer.get("do_remote_decode"):
            budget = 0  # vLLM checks a disaggregated prefill's budget on its decode leg
        elif budget >= max_tokens:
            raise invalid(
                "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens"
            )
    return InferenceRequest(
        "messages", model, body, 1, {"max_tokens": max_tokens}, thinking_budget=budget
    )


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    try:
        return lax_bool(value, key)
    except TokenizerError as exc:
        raise invalid(str(exc), key) from None


def _holds_lone_surrogate(body: dict[str, Any]) -> bool:
    """Whether a string of `body` holds half of a surrogate pair: one that cannot be encoded
    (the tokenizer and the rewritten body both need it encoded). Escaped pairs, as JSON
    writes characters beyond the BMP, decode to one character and pass."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def _echo_only(body: dict[str, Any], key: str) -> bool:
    """vLLM accepts `max_tokens: 0` on a completion with `echo`: it returns the prompt and
    runs one step, so the prompt's own blocks are all it holds."""
    if key != "max_tokens" or type(body.get(key)) is not int or body[key] != 0:
        return False
    try:
        return lax_bool(body.get("echo") or False, "echo")
    except TokenizerError as exc:
        raise invalid(str(exc), "echo") from None


def _min_tokens(body: dict[str, Any]) -> int:
    value = body.get("min_tokens")
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise invalid("'min_tokens' must be a non-negative integer", "min_tokens")
    return value


def _truncation(body: dict[str, Any]) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is not None and (type(value) is not int or value < -1):
        raise invalid("'truncate_prompt_tokens' must be an integer >= -1", "truncate_prompt_tokens")
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", "messages")


def _check_prompt(prompt: Any, embeds: Any) -> None:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if embeds is not None and embeds != []:
        raise invalid(
            "'prompt_embeds' is not supported here: its token count cannot be checked before "
            "admission; send the prompt as text or token ids",
            "prompt_embeds",
        )
    if prompt == "":
        raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or are_token_ids(prompt):
            return
        if all(isinstance(p, list) and p and are_token_ids(p) for p in prompt):
            return
    raise invalid(
        "'prompt' must be a string, an array of strings, an array of token ids "
        "or an array of arrays of token ids",
        "prompt",
    )


def are_token_ids(values: list[Any]) -> bool:
    """Whether every value is a token id (an int, 0 or more)."""
    return all(type(v) is int and v >= 0 for v in values)
