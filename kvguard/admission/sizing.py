"""A request's size: its output-token limits (the clamp to the tier's cap and the context left)
and the KV blocks a prompt and an output take. Pure functions; what a calibrated request
expects to produce is `calibration`'s estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvguard.config.schema import TierConfig
from kvguard.errors import Code, Refusal, invalid
from kvguard.tokens.request import LIMIT_FIELDS, PROMPT_FIELD, Kind


@dataclass(frozen=True, slots=True)
class Limits:
    fields: dict[str, int]  # the limit fields to write into the body (clamped or injected)
    max_tokens: int  # the output limit vLLM will apply
    clamped: bool  # True when a client value was lowered or a limit was injected
    requested: int | None = None  # the client's limit that vLLM reads; None when it sent none


def clamp(
    kind: Kind,
    sent: dict[str, int],
    tier: TierConfig,
    max_model_len: int,
    longest_prompt: int,
    min_tokens: int = 0,
) -> Limits:
    """Clamp each limit the client sent to the tier cap and to the context room left by the
    longest prompt; inject the kind's limit field (`max_tokens`; Responses'
    `max_output_tokens`) = the tier default when vLLM would read none, or
    `min_tokens` when that is more. vLLM refuses `min_tokens` above `max_tokens`: a request
    whose `min_tokens` the limits cannot honour is refused here."""
    room = max_model_len - longest_prompt
    if room <= 0:
        raise Refusal(
            Code.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {longest_prompt} tokens, which reaches this model's maximum "
            f"context length of {max_model_len} tokens",
            PROMPT_FIELD[kind],
        )
    ceiling = min(tier.max_tokens_cap, room)
    fields = {key: min(value, ceiling) for key, value in sent.items()}
    read = [key for key in LIMIT_FIELDS[kind] if key in fields]
    requested = sent[read[0]] if read else None
    if read:
        max_tokens = fields[read[0]]
        clamped = fields != sent
    else:
        max_tokens = min(max(tier.default_max_tokens, min_tokens), ceiling)
        fields[LIMIT_FIELDS[kind][-1]] = max_tokens
        clamped = True
    if min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' is {min_tokens}, above the {max_tokens} tokens this request may "
            f"generate (this tenant's cap is {tier.max_tokens_cap}, the context leaves {room})",
            "min_tokens",
        )
    return Limits(fields, max_tokens, clamped, requested)


def blocks_needed(prompt_tokens: list[int], max_tokens: int, n: int, block_size: int) -> int:
    """n sequences per prompt, each holding prompt + output tokens in whole blocks."""
    return n * sum(math.ceil((p + max_tokens) / block_size) for p in prompt_tokens)
