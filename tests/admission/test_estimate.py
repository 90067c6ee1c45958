from __future__ import annotations

import pytest

from kvguard.admission.capacity import pool_limit
from kvguard.admission.sizing import blocks_needed, clamp
from kvguard.config.schema import TierConfig
from kvguard.errors import Code, Refusal

TIER = TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=100)


def test_chat_without_limit_gets_the_tier_default() -> None:
    limits = clamp("chat", {}, TIER, max_model_len=4096, longest_prompt=100)
    assert limits.fields == {"max_tokens": 256}
    assert limits.max_tokens == 256 and limits.clamped
    assert limits.requested is None


def test_each_sent_field_is_clamped_and_chat_reads_max_completion_tokens_first() -> None:
    limits = clamp("chat", {"max_tokens": 9000, "max_completion_tokens": 300}, TIER, 4096, 100)
    assert limits.fields == {"max_tokens": 512, "max_completion_tokens": 300}
    assert limits.max_tokens == 300
    assert limits.requested == 300  # the field vLLM reads, as the client sent it


def test_completions_read_only_max_tokens() -> None:
    limits = clamp("completion", {"max_completion_tokens": 50}, TIER, 4096, 10)
    assert limits.fields == {"max_completion_tokens": 50, "max_tokens": 256}
    assert limits.max_tokens == 256


def test_limit_never_passes_the_context_room() -> None:
    limits = clamp("chat", {"max_tokens": 500}, TIER, max_model_len=1000, longest_prompt=900)
    assert (limits.requested, limits.max_tokens) == (500, 100)
    injected = clamp("chat", {}, TIER, max_model_len=1000, longest_prompt=950)
    assert injected.max_tokens == 50


def test_a_limit_within_bounds_is_left_alone() -> None:
    limits = clamp("chat", {"max_tokens": 20}, TIER, 4096, 100)
    assert limits.fields == {"max_tokens": 20} and not limits.clamped


def test_an_injected_limit_honours_min_tokens_within_the_cap() -> None:
    """vLLM refuses min_tokens above max_tokens: the tier default alone would break this."""
    limits = clamp("chat", {}, TIER, 4096, 100, min_tokens=300)
    assert limits.fields == {"max_tokens": 300} and limits.max_tokens == 300


@pytest.mark.parametrize(
    ("sent", "min_tokens"),
    [({"max_tokens": 9000}, 600), ({}, 600), ({"max_tokens": 20}, 30)],
)
def test_min_tokens_the_limits_cannot_honour_is_refused(
    sent: dict[str, int], min_tokens: int
) -> None:
    with pytest.raises(Refusal) as info:
        clamp("chat", sent, TIER, 4096, 100, min_tokens=min_tokens)
    assert (info.value.code, info.value.param) == (Code.INVALID_REQUEST, "min_tokens")


def test_min_tokens_within_the_clamped_limit_passes() -> None:
    limits = clamp("chat", {"max_tokens": 9000}, TIER, 4096, 100, min_tokens=512)
    assert limits.max_tokens == 512


@pytest.mark.parametrize("prompt", [1000, 1001])
def test_prompt_reaching_max_model_len_is_refused(prompt: int) -> None:
    with pytest.raises(Refusal) as info:
        clamp("chat", {}, TIER, max_model_len=1000, longest_prompt=prompt)
    assert info.value.code is Code.CONTEXT_LENGTH_EXCEEDED


def test_blocks_round_up_per_sequence() -> None:
    assert blocks_needed([100], 156, 1, 16) == 16
    assert blocks_needed([100], 157, 1, 16) == 17
    assert blocks_needed([10, 20], 6, 3, 16) == 3 * (1 + 2)
    assert blocks_needed([809], 1500, 1, 128) == 19


@pytest.mark.parametrize(
    ("capacity", "watermark", "limit"),
    [(100, 0.15, 85), (63, 0.15, 53), (64, 0.0, 64), (1000, 0.1, 900)],
)
def test_pool_limit_keeps_the_watermark_free(capacity: int, watermark: float, limit: int) -> None:
    assert pool_limit(capacity, watermark) == limit
    assert capacity - limit >= watermark * capacity
    assert capacity - (limit + 1) < watermark * capacity
