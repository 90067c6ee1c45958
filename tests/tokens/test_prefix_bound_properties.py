"""Property-based: the lower bounds of kvguard.tokens.prefix_bound never pass the whole text's
count, on the real Qwen and Llama 3.2 tokenizers.

Texts come from words, whitespace runs, contractions, composed and decomposed characters, runs
of combining marks, other scripts, long runs of one character (the longest tokens), every added
token and fragments of them; a prefix is cut anywhere. What a prefix keeps is held with the
margin kvguard uses and with a thinner one (the longest added token only), which is stricter;
the length bound segment by segment (normalized as the model sees them) and on whole texts;
and count_at_least on texts long enough to be read from prefixes.
"""

from __future__ import annotations

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from kvguard.tokens.prefix_bound import PrefixBound, settled_tokens
from kvguard.tokens.segments import SegmentCounter
from tests.tokens.fragments import ADDED, FRAGMENTS, TOKENIZERS

MORE = ["don't", "   x", "\u0301", "a\u0301\u0316", " 12", "1,234", "\u3000", "서울", "ﾄｰｸﾝ"]
# Runs as long as the longest tokens (128 spaces are one token in both), and runs of marks
# with a lower combining class than the U+0301 that may follow them.
RUNS = [" " * 300, "=" * 200, "\n" * 150, "-" * 130, "数据中心" * 40, "\u0316" * 100]
# NFC composes the "a" with the U+0301 200 marks later: cut at 150, the word "xyza" of the prefix
# is "xyzá" in the whole text (Qwen: [4130, 4360] against [28854, 1953]).
NFC_ACROSS_THE_CUT = "xyza" + "\u0316" * 200 + "\u0301" + " tail"


def texts(name: str) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS + MORE + RUNS),
        st.sampled_from(ADDED[name]),
        st.text(max_size=6),
    )
    return st.lists(piece, min_size=1, max_size=120).map("".join)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_what_a_prefix_keeps_is_a_lower_bound(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    thin = max(map(len, ADDED[name]))
    margin = PrefixBound(tokenizer, whole_texts=True).margin

    @settings(max_examples=400, deadline=None)
    @given(text=texts(name), cut=st.floats(0, 1), special=st.booleans())
    @example(text=NFC_ACROSS_THE_CUT, cut=150.5 / len(NFC_ACROSS_THE_CUT), special=False)
    def check(text: str, cut: float, special: bool) -> None:
        size = int(cut * len(text))
        (whole,) = tokenizer.encode_batch([text], add_special_tokens=special)
        (prefix,) = tokenizer.encode_batch([text[:size]], add_special_tokens=special)
        for kept_margin in (margin, thin):
            kept = settled_tokens(prefix, size - kept_margin)
            assert kept <= len(whole), (kept_margin, text[:size], text[size:])
            if prefix.ids[:kept] != whole.ids[:kept]:
                event("kept tokens differ from the whole text's, fewer or as many")

    check()


def segments(counter: SegmentCounter, text: str) -> list[str]:
    return counter._split(text)[::2]  # what lies between the added tokens


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_length_bound_never_passes_the_count(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    counter = SegmentCounter.for_tokenizer(tokenizer)
    assert counter is not None
    by_segment, by_text = counter.bound, PrefixBound(tokenizer, whole_texts=True)

    @settings(max_examples=400, deadline=None)
    @given(text=texts(name), special=st.booleans())
    @example(text=NFC_ACROSS_THE_CUT * 3, special=False)
    @example(text=" " * 129, special=False)
    def check(text: str, special: bool) -> None:
        assert by_text.floor(text) <= len(tokenizer.encode(text, add_special_tokens=special))
        for segment in segments(counter, text):
            counted = len(tokenizer.encode(segment, add_special_tokens=False))
            assert by_segment._normalized_floor(segment, 1) <= counted
            assert by_segment.floor(segment) <= counted

    check()


class Looks:
    """Notes the prefixes a tokenizer is asked to encode (shorter than `chars`)."""

    def __init__(self, tokenizer: object, chars: int) -> None:
        self._tokenizer, self._chars = tokenizer, chars
        self.prefixes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)

    def encode_batch(self, texts: list[str], **kwargs: object) -> object:
        self.prefixes += sum(len(t) < self._chars for t in texts)
        return self._tokenizer.encode_batch(texts, **kwargs)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_count_at_least_is_exact_or_a_bound_that_reaches(name: str) -> None:
    """Texts of 16k to 200k characters, `stop_at` anywhere from a twentieth of their count to
    past it: every one is read from a prefix first (a look at its start at least)."""
    tokenizer = TOKENIZERS[name]

    @settings(max_examples=50, deadline=None)
    @given(
        text=texts(name).filter(bool),
        chars=st.integers(16_000, 200_000),
        share=st.floats(0.05, 1.5),
    )
    def check(text: str, chars: int, share: float) -> None:
        long = (text * (chars // len(text) + 1))[:chars]
        whole = len(tokenizer.encode(long, add_special_tokens=False))
        stop_at = max(1, int(share * whole))
        looks = Looks(tokenizer, len(long))
        bound = PrefixBound(looks, whole_texts=True)  # type: ignore[arg-type]
        tokens, exact = bound.count_at_least(long, stop_at, False)
        assert tokens == whole if exact else stop_at <= tokens <= whole
        by_length = bound.floor(long) >= stop_at
        assert looks.prefixes >= 1 or by_length
        event("bounded by length" if by_length else "exact" if exact else "bounded by a prefix")

    check()
