"""A prompt that passes max_model_len is counted only until it is known to
(kvguard.tokens.prefix_bound): a lower bound, from its length or a prefix, refuses it; a prompt
that fits is still counted exactly; and the counting backlog weighs each body by what its count
reads at most."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers

from kvguard.errors import Code, Refusal
from kvguard.tokens.counting import LONG_WORK_BYTES, PromptCounter, count_prompts, work_bytes
from kvguard.tokens.prefix_bound import FIRST_LOOK_CHARS, PrefixBound
from kvguard.tokens.request import parse
from kvguard.tokens.tokenizer import PoolTokenizer
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
    qwen = PoolTokenizer.load(model_dir("qwen"))  # its chat template, for both (Llama's has none)
    recording = Recording(raw(request.param))
    tokenizer = PoolTokenizer(recording, qwen._templates, {})  # type: ignore[arg-type]
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
    # Hangul: text kvguard.tokens.pretokens leaves to tokenizers, where the characters are seen.
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
    exact.encode_special_tokens = True  # kvguard.tokens.segments declines such a tokenizer
    recording = Recording(exact)
    tokenizer = PoolTokenizer(recording, {}, {})  # type: ignore[arg-type]
    text = "<|eot_id|>" + (PROSE * 20_000)
    recording.chars = 0
    counted = tokenizer.count(text, True, 4096)
    assert recording.chars < 100_000
    assert 4096 <= counted <= len(exact.encode(text, add_special_tokens=True))


def test_text_without_local_words_is_counted_whole() -> None:
    """A tokenizer without a pre-tokenizer reads a text as one word: no prefix bounds it, and
    without ByteLevel nothing says how many bytes a token covers."""
    tokenizer = raw("qwen")
    tokenizer.pre_tokenizer = None  # type: ignore[assignment]
    text = "x" * 200_000
    bound = PrefixBound(tokenizer, whole_texts=False)
    assert bound.per_token is None
    tokens, exact = bound.count_at_least(text, 100, False)
    assert exact
    assert tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("name", ["qwen", "llama3.2"])
def test_the_length_bound_holds_only_where_each_byte_is_in_one_token(name: str) -> None:
    assert PrefixBound(raw(name), whole_texts=False).per_token == 128  # their longest entry
    dropping = raw(name)  # Whitespace drops the spaces between words
    dropping.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    removed = raw(name)
    removed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    for tokenizer in (dropping, removed):
        assert PrefixBound(tokenizer, whole_texts=False).per_token is None
    stripping = raw(name)  # an added token that takes the spaces before it along
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert PrefixBound(stripping, whole_texts=False).per_token == 128
    assert PrefixBound(stripping, whole_texts=True).per_token is None


def test_a_prompt_without_words_is_refused_by_its_length(
    recorded: tuple[PoolTokenizer, Recording],
) -> None:
    """Letters without a space, CJK without punctuation: no word of a prefix ends before the
    cut, so no prefix bounds them; their length does (1 MB of "a" took 0.92 s, 3 MB of CJK
    2.57 s, tokenized whole)."""
    tokenizer, recording = recorded
    for prompt in ("a" * (2 * MIB), "数据中心模型" * 200_000):
        body = json.dumps({"model": "m", "prompt": prompt}, ensure_ascii=False).encode()
        with pytest.raises(Refusal) as refused:
            count_prompts(tokenizer, parse("completion", body), max_model_len=4096)
        assert refused.value.code is Code.CONTEXT_LENGTH_EXCEEDED
        assert recording.chars <= FIRST_LOOK_CHARS  # one look at the start, if any
        recording.chars = 0


def indented(lines: int) -> str:
    """Text of few tokens for its length: indented code (57,600 characters, 3462 Qwen tokens)."""
    rnd = random.Random(3)
    return "".join(" " * 60 + "".join(rnd.choices("abcdefghij", k=3)) + "\n" for _ in range(lines))


def test_a_long_text_that_fits_is_tokenized_once(
    recorded: tuple[PoolTokenizer, Recording],
) -> None:
    """The rate of a short first look says it fits: the whole text is counted at once (it was
    after a prefix of 24 Ki characters: 16.0 ms against 12.8 ms counted whole)."""
    tokenizer, recording = recorded
    text = indented(900)
    exact = len(recording.encode(text, add_special_tokens=False))
    assert exact < 4096
    recording.chars = 0
    assert tokenizer.count(text, False, 4096) == exact
    assert recording.chars <= len(text) * 1.1  # 4 Ki of 57,600 characters looked at first


def bodies() -> dict[str, tuple[str, bytes]]:
    """Completions and chats whose counts read the most for their size, and some that do not."""
    chats = {
        "short messages": [{"role": "user", "content": f"m {i} hi"} for i in range(20_000)],
        "one long word": [{"role": "user", "content": "b" * 400_000}],
        "prose": [{"role": "user", "content": PROSE * 2000}],
    }
    completions = {
        "one word": "a" * 500_000,  # below the length bound: counted whole
        "CJK": "数据中心模型" * 28_000,
        "fits": indented(900),
        "prose, 6 MiB": (PROSE * (6 * MIB // len(PROSE))),
        "three prompts": ["c" * 300_000, "d" * 300_000, PROSE * 4000],
    }
    out = {}
    for name, messages in chats.items():
        out[name] = "chat", json.dumps({"model": "m", "messages": messages}).encode()
    for name, prompt in completions.items():
        raw = json.dumps({"model": "m", "prompt": prompt}, ensure_ascii=False).encode()
        out[name] = "completion", raw
    return out


@pytest.mark.parametrize("max_model_len", [4096, 32_768])
def test_a_count_reads_no_more_than_its_body_weighs(
    recorded: tuple[PoolTokenizer, Recording], max_model_len: int
) -> None:
    tokenizer, recording = recorded
    for name, (kind, raw) in bodies().items():
        request = parse(kind, raw)  # type: ignore[arg-type]
        recording.chars = 0
        try:
            count_prompts(tokenizer, request, max_model_len=max_model_len)
        except Refusal as refused:
            assert refused.code is Code.CONTEXT_LENGTH_EXCEEDED
        weight = work_bytes(tokenizer, request, len(raw), max_model_len)
        assert recording.chars <= weight, name


def test_a_chat_padded_in_an_ignored_field_weighs_what_its_messages_do(qwen: PoolTokenizer) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}
    raw = json.dumps({**chat, "user": "x" * (4 * MIB)}).encode()
    assert work_bytes(qwen, parse("chat", raw), len(raw), 4096) < 1024  # of 4 MiB


class Held:
    """A pool tokenizer whose counts of texts longer than `chars` wait on threads until
    released (with a deadline)."""

    def __init__(self, tokenizer: PoolTokenizer, chars: int) -> None:
        self._tokenizer, self._chars = tokenizer, chars
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def count_many(self, texts: list[str], special: bool, stop_at: int | None = None) -> list[int]:
        if sum(map(len, texts)) > self._chars:
            self.started.release()
            assert self.release.wait(10), "never released"
        return self._tokenizer.count_many(texts, special, stop_at)


def long_counts() -> dict[str, list[tuple[Any, int]]]:
    """Three bodies each of what is read at length whatever max_model_len: one-word prompts
    just below the length bound at 4096 (read whole), and chats of many messages (rendered)."""
    out: dict[str, list[tuple[Any, int]]] = {"one word": [], "messages": []}
    for i in range(3):
        raw = json.dumps({"model": "m", "prompt": "abc"[i] * 500_000}).encode()
        out["one word"].append((parse("completion", raw), len(raw)))
        messages = [{"role": "user", "content": f"{i} {j}"} for j in range(20_000)]
        raw = json.dumps({"model": "m", "messages": messages}).encode()
        out["messages"].append((parse("chat", raw), len(raw)))
    return out


@pytest.mark.parametrize("kind", ["one word", "messages"])
async def test_long_counts_leave_a_thread_to_short_ones(qwen: PoolTokenizer, kind: str) -> None:
    """Counts that read at length take at most `workers` threads, so a short one is counted
    at once meanwhile (five 2 MB one-word prompts held a 4.9 KB one back 5.2 s, past Envoy's
    5 s)."""
    held: Any = Held(qwen, 100_000)
    short, short_bytes = completion(10_000)
    assert work_bytes(qwen, short, short_bytes, 4096) <= LONG_WORK_BYTES
    counter = PromptCounter(workers=2)
    try:
        longs = [
            asyncio.create_task(counter.count(held, request, size, max_model_len=4096))
            for request, size in long_counts()[kind]
        ]
        for _ in range(2):
            assert await asyncio.to_thread(held.started.acquire, True, 10), "never started"
        counted = await asyncio.wait_for(
            counter.count(held, short, short_bytes, max_model_len=4096), 10
        )
        assert counted == count_prompts(qwen, short, max_model_len=4096)
        assert not any(task.done() for task in longs)
        held.release.set()
        for answer in await asyncio.gather(*longs, return_exceptions=True):
            assert isinstance(answer, Refusal) and answer.code is Code.CONTEXT_LENGTH_EXCEEDED
    finally:
        held.release.set()
        counter.close()


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
