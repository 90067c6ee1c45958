"""Counting by pre-tokens cuts where tokenizers cuts and equals its count
(kvguard.tokens.pretokens).

The real Qwen and Llama 3.2 tokenizers, against their own encode, on texts drawn from every
character of the domain where counting by pre-tokens applies, weighted towards what their regexes
treat specially (apostrophes in any case, digit runs, whitespace runs before words and newlines,
punctuation runs), counted new and then again from the remembered pre-tokens; and with a memory
so small that it is emptied all the time.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvguard.tokens import pretokens
from kvguard.tokens.pretokens import DOMAIN, PreTokenCounter
from tests.conftest import model_dir

TOKENIZERS = {
    name: Tokenizer.from_file(str(model_dir(name) / "tokenizer.json"))
    for name in ("qwen", "llama3.2")
}
COUNTERS = {name: PreTokenCounter.for_tokenizer(t) for name, t in TOKENIZERS.items()}
# Apart from COUNTERS: their memory is emptied all the time (MAX_PRE_TOKENS patched to 3).
SMALL_MEMORY = {name: PreTokenCounter.for_tokenizer(t) for name, t in TOKENIZERS.items()}
SPECIAL = [
    *"'\u2019 \t\n\r0123456789.,!?-_()[]{}<>/\\\"`~^|#@$%&*+=:;",
    "'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'Ve", "'m", "'M", "'ll", "'lL", "'d", "'D",
    "  ", "   ", " \n", "\n ", "\n\n", "\r\n", " \t", "\t\t", "1234", "12345678",
]  # fmt: skip
WORDS = ["the", " the", "The", " request", "naïve", " café", "Straße", "数据", " мир", "🙂"]


def texts() -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(SPECIAL),
        st.sampled_from(WORDS),
        st.text(alphabet=st.sampled_from(DOMAIN), max_size=8),
    )
    return st.lists(piece, max_size=60).map("".join)


def library(name: str, text: str) -> int:
    return len(TOKENIZERS[name].encode(text, add_special_tokens=False))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_both_tokenizers_are_counted_by_pre_tokens(name: str) -> None:
    assert COUNTERS[name] is not None


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=400, deadline=None)
@given(text=texts())
def test_pre_token_counts_equal_the_tokenizers_count(name: str, text: str) -> None:
    counter = COUNTERS[name]
    assert counter is not None
    cuts = [span for _, span in TOKENIZERS[name].pre_tokenizer.pre_tokenize_str(text)]
    assert counter.spans(text) == cuts, repr(text)  # cut exactly where tokenizers cuts
    first = counter.count(text)
    assert first is not None, repr(text)  # domain text, well under the length bound
    assert first == library(name, text), repr(text)
    assert counter.count(text) == first  # again, from the remembered pre-tokens


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(text=texts())
def test_counts_stay_exact_when_the_memory_is_emptied_all_the_time(name: str, text: str) -> None:
    counter = SMALL_MEMORY[name]
    assert counter is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretokens, "MAX_PRE_TOKENS", 3)
        assert counter.count(text) == library(name, text), repr(text)
        assert counter.count(text) == library(name, text), repr(text)
