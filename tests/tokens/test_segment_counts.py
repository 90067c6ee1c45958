"""Counting by segments between added tokens equals counting the whole text
(kvguard.tokens.segments).

The real Qwen and Llama 3.2 tokenizers, against their own whole-text encode, on texts built
from words, whitespace and line breaks, non-ASCII and composed/decomposed characters, digits,
every added token of the model and fragments of them; each text is counted new and then again
from the remembered segments, with a cache small enough to evict all the time.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kvguard.tokens.segments import SegmentCounter
from tests.tokens.fragments import ADDED, FRAGMENTS, TOKENIZERS


def texts(name: str) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS),
        st.sampled_from(ADDED[name]),
        st.text(max_size=12),
    )
    return st.lists(piece, max_size=40).map("".join)


def whole(tokenizer: Tokenizer, text: str, special: bool) -> int:
    return len(tokenizer.encode(text, add_special_tokens=special))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_segments_count_as_the_whole_text(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    counter = SegmentCounter.for_tokenizer(tokenizer, max_cached_chars=2_000)
    assert counter is not None

    @settings(max_examples=400, deadline=None)
    @given(text=texts(name), special=st.booleans())
    def check(text: str, special: bool) -> None:
        expected = whole(tokenizer, text, special)
        assert counter.count(text, special) == expected  # new, or partly remembered
        assert counter.count(text, special) == expected  # remembered

    check()


def test_remembered_segments_stay_within_the_bound() -> None:
    tokenizer = TOKENIZERS["qwen"]
    counter = SegmentCounter.for_tokenizer(tokenizer, max_cached_chars=1_000)
    assert counter is not None
    for i in range(200):
        text = f"<|im_start|>user\nquestion number {i}<|im_end|>\n"
        assert counter.count(text, False) == whole(tokenizer, text, False)
    # 1,000 chars of budget at 100 + len(segment) per entry: at most 9 entries.
    assert 0 < counter.cached_segments <= 9


def test_threads_share_one_counter() -> None:
    tokenizer = TOKENIZERS["llama3.2"]
    counter = SegmentCounter.for_tokenizer(tokenizer, max_cached_chars=5_000)
    assert counter is not None
    chats = [
        "<|start_header_id|>system<|end_header_id|>\n\nYou help.<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{'word ' * (i % 50)}{i}<|eot_id|>"
        for i in range(300)
    ]
    expected = [whole(tokenizer, t, True) for t in chats]
    wrong: list[int] = []

    def work(offset: int) -> None:
        for k in range(len(chats)):
            i = (k + offset) % len(chats)
            if counter.count(chats[i], True) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(n * 37,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def _metaspace_tokenizer(prepend_scheme: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE({"▁": 0, "a": 1}, []))  # "▁a" is two tokens
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tokenizer.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return tokenizer


def test_position_dependent_pipelines_are_counted_whole() -> None:
    first = _metaspace_tokenizer("first")
    # Metaspace "first" prepends ▁ only at the start of the whole text, so a segment after an
    # added token counts differently alone ("a" -> "▁a", 2 tokens) than in place ("a", 1).
    assert whole(first, "<s>a", False) != whole(first, "<s>", False) + whole(first, "a", False)
    assert SegmentCounter.for_tokenizer(first) is None
    assert SegmentCounter.for_tokenizer(_metaspace_tokenizer("always")) is not None


def test_stripping_added_tokens_are_counted_whole() -> None:
    tokenizer = _metaspace_tokenizer("never")
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    assert SegmentCounter.for_tokenizer(tokenizer) is None
    plain = _metaspace_tokenizer("never")
    plain.encode_special_tokens = True  # added tokens are then not matched at all
    assert SegmentCounter.for_tokenizer(plain) is None
