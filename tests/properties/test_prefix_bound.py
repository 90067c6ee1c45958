"""Property-based: the tokens kvguard.prefix_bound keeps from a prefix's encoding are the first
tokens of the whole text's encoding, on the real Qwen and Llama 3.2 tokenizers; so their count
is a lower bound of the whole text's.

Texts come from words, whitespace runs, contractions, composed and decomposed characters, other
scripts, every added token and fragments of them; the cut falls anywhere. Held with the margin
kvguard uses and with a thinner one (the longest added token only), which is stricter.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.prefix_bound import count_at_least, margin_chars, settled_tokens
from tests.properties.test_segment_counts import ADDED, FRAGMENTS, TOKENIZERS

MORE = ["don't", "   x", "\u0301", "a\u0301\u0316", " 12", "1,234", "\u3000", "서울", "ﾄｰｸﾝ"]


def texts(name: str) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS + MORE),
        st.sampled_from(ADDED[name]),
        st.text(max_size=6),
    )
    return st.lists(piece, min_size=1, max_size=120).map("".join)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_prefix_keeps_only_tokens_of_the_whole_text(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    thin = max(map(len, ADDED[name]))

    @settings(max_examples=400, deadline=None)
    @given(text=texts(name), cut=st.floats(0, 1), special=st.booleans())
    def check(text: str, cut: float, special: bool) -> None:
        size = int(cut * len(text))
        (whole,) = tokenizer.encode_batch([text], add_special_tokens=special)
        (prefix,) = tokenizer.encode_batch([text[:size]], add_special_tokens=special)
        for margin in (margin_chars(tokenizer), thin):
            kept = settled_tokens(prefix, size - margin)
            assert prefix.ids[:kept] == whole.ids[:kept], (margin, text[:size], text[size:])

    check()


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_count_at_least_is_exact_or_a_bound_that_reaches(name: str) -> None:
    tokenizer = TOKENIZERS[name]

    @settings(max_examples=50, deadline=None)
    @given(text=texts(name), repeat=st.integers(1, 400), stop_at=st.integers(1, 20_000))
    def check(text: str, repeat: int, stop_at: int) -> None:
        long = text * repeat  # up to ~300k characters: prefixes of several sizes
        whole = len(tokenizer.encode(long, add_special_tokens=False))
        tokens, exact = count_at_least(tokenizer, long, stop_at, False, margin_chars(tokenizer))
        assert tokens == whole if exact else stop_at <= tokens <= whole

    check()
