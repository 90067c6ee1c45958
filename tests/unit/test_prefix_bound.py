"""A prompt that passes max_model_len is counted only until it is known to (kvguard.prefix_bound):
a lower bound refuses it, a prompt that fits is still counted exactly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tokenizers import Tokenizer

from kvguard.counting import PromptCounter, count_prompts
from kvguard.errors import Code, Refusal
from kvguard.prefix_bound import count_at_least, margin_chars
from kvguard.request import parse
from kvguard.tokenizer import PoolTokenizer
from tests.conftest import model_dir

PROSE = "the quick brown fox jumps over a lazy dog, don't you think?\n数据 中心 naïve 3.14 "
MIB = 1024 * 1024


class Recording:
    """A tokenizers.Tokenizer that notes how many characters it is given to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.chars += sum(map(len, texts))
        return self._tokenizer.encode_batch(texts, **kwargs)

    def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> Any:
        self.chars += sum(map(len, texts))
        return self._tokenizer.encode_batch_fast(texts, **kwargs)


def raw(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir(name) / "tokenizer.json"))


@pytest.fixture(params=["qwen", "llama3.2"])
def recorded(request: pytest.FixtureRequest) -> tuple[PoolTokenizer, Recording]:
    recording = Recording(raw(request.param))
    tokenizer = PoolTokenizer(recording, {}, {})  # type: ignore[arg-type]
    recording.chars = 0  # what loading checked does not count
    return tokenizer, recording


def completion(chars: int, **fields: Any) -> tuple[Any, int]:
    prompt = (PROSE * (chars // len(PROSE) + 1))[:chars]
    body = json.dumps({"model": "m", "prompt": prompt, **fields}, ensure_ascii=False).encode()
    return parse("completion", body), len(body)


def test_a_prompt_of_megabytes_is_refused_from_a_prefix(
    recorded: tuple[PoolTokenizer, Recording],
) -> None:
    tokenizer, recording = recorded
    request, _ = completion(6 * MIB)
    with pytest.raises(Refusal) as refused:
        count_prompts(tokenizer, request, max_model_len=4096)
    assert refused.value.code is Code.CONTEXT_LENGTH_EXCEEDED
    assert "at least" in refused.value.message
    assert recording.chars < 100_000  # of 6 Mi characters


def test_truncation_needs_only_what_vllm_keeps(recorded: tuple[PoolTokenizer, Recording]) -> None:
    tokenizer, recording = recorded
    request, _ = completion(2 * MIB, truncate_prompt_tokens=100)
    assert count_prompts(tokenizer, request, max_model_len=4096) == [100]
    request, _ = completion(2 * MIB, truncate_prompt_tokens=-1)
    assert count_prompts(tokenizer, request, max_model_len=4096) == [4095]
    assert recording.chars < 200_000


@pytest.mark.parametrize("name", ["qwen", "llama3.2"])
def test_the_bound_never_passes_the_count_and_short_texts_stay_exact(name: str) -> None:
    tokenizer = PoolTokenizer.load(model_dir(name))
    exact = raw(name)
    text = (PROSE * 5000)[:300_000]
    for special in (False, True):
        whole = len(exact.encode(text, add_special_tokens=special))
        for stop_at in (10, 4096, 20_000, whole, whole + 1):
            counted = tokenizer.count(text, special, stop_at)
            assert counted <= whole
            assert counted == whole or counted >= stop_at
        assert tokenizer.count(text, special, whole + 1) == whole  # never reached: exact


def test_a_chat_of_many_turns_is_counted_turn_batch_by_turn_batch() -> None:
    recording = Recording(raw("qwen"))
    tokenizer = PoolTokenizer(recording, {}, {})  # type: ignore[arg-type]
    # Hangul: text kvguard.pretokens leaves to tokenizers, where the characters are seen.
    turns = [f"<|im_start|>user\n{i} 서울 {PROSE}<|im_end|>\n" for i in range(20_000)]
    text = "".join(turns)
    recording.chars = 0
    counted = tokenizer.count(text, False, 4096)
    assert 4096 <= counted <= len(raw("qwen").encode(text, add_special_tokens=False))
    assert recording.chars < len(text) // 20


def test_a_tokenizer_counted_by_whole_texts_is_bounded_too() -> None:
    """Where counting by segments might differ (here: added tokens encoded as text), whole
    texts are bounded from their prefixes, special tokens included."""
    exact = raw("llama3.2")
    exact.encode_special_tokens = True  # kvguard.segments declines such a tokenizer
    recording = Recording(exact)
    tokenizer = PoolTokenizer(recording, {}, {})  # type: ignore[arg-type]
    text = "<|eot_id|>" + (PROSE * 20_000)
    recording.chars = 0
    counted = tokenizer.count(text, True, 4096)
    assert recording.chars < 100_000
    assert 4096 <= counted <= len(exact.encode(text, add_special_tokens=True))


def test_text_without_local_words_is_counted_whole() -> None:
    """A tokenizer without a pre-tokenizer reads a text as one word: no prefix bounds it."""
    tokenizer = raw("qwen")
    tokenizer.pre_tokenizer = None  # type: ignore[assignment]
    text = "x" * 200_000
    tokens, exact = count_at_least(tokenizer, text, 100, False, margin_chars(tokenizer))
    assert exact
    assert tokens == len(tokenizer.encode(text, add_special_tokens=False))


async def test_bodies_past_max_model_len_weigh_what_counting_reads(qwen: PoolTokenizer) -> None:
    """Two 6 MiB prompts at once: the backlog holds what their counts read (~48 KiB each at
    max_model_len 4096), not 12 MiB of body, so neither is refused as busy."""
    request, body_bytes = completion(6 * MIB)
    counter = PromptCounter(workers=1)
    try:
        answers = await asyncio.gather(
            *(counter.count(qwen, request, body_bytes, max_model_len=4096) for _ in range(2)),
            return_exceptions=True,
        )
        assert [a.code for a in answers if isinstance(a, Refusal)] == [
            Code.CONTEXT_LENGTH_EXCEEDED
        ] * 2
    finally:
        counter.close()
