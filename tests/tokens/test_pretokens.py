"""Where counting by pre-tokens applies, and where it must not (kvguard.tokens.pretokens)."""

from __future__ import annotations

import logging
import re
import unicodedata

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvguard.tokens import pretokens
from kvguard.tokens.pretokens import (
    DOMAIN,
    GPT2_PATTERN,
    MAX_SEGMENT_CHARS,
    PreTokenCounter,
    domain_pattern,
)
from kvguard.tokens.segments import SegmentCounter
from tests.conftest import model_dir

QWEN = Tokenizer.from_file(str(model_dir("qwen") / "tokenizer.json"))


def byte_level(pre_tokenizer: pre_tokenizers.PreTokenizer) -> Tokenizer:
    """A BPE tokenizer with one token per byte (no merges) and the given pre-tokenizer."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


def test_domain_holds_no_character_that_normalization_or_whitespace_could_treat_apart() -> None:
    assert set(DOMAIN) >= {"\t", "\n", "\r", " ", "a", "é", "—", "数", "🙂"}
    for char in DOMAIN:
        assert unicodedata.normalize("NFC", char) == char
        assert not unicodedata.category(char).startswith(("M", "C", "Z")) or char in " \t\n\r"
    assert not set(DOMAIN) & {"\u00a0", "\u0301", "\u200b", "\u2028", "\x00", "\x7f"}


@pytest.mark.parametrize(
    "pattern",
    [
        r"\p{Han}+",  # a class not translated
        r"\p{Lu}",
        r"\d+",  # \d and \w mean other things to the two engines outside ASCII
        r"\w+",
        r"(?<name>a)",
        r"(?>a+)",
        r"(a)|b",  # a capturing group
        r"[[:alpha:]]",
        r"[]a]",
        r"[a",
        "a\\",
    ],
)
def test_patterns_with_constructs_not_known_to_mean_the_same_are_not_translated(
    pattern: str,
) -> None:
    assert domain_pattern(pattern) is None


def test_known_patterns_translate_with_explicit_classes() -> None:
    pattern = domain_pattern(GPT2_PATTERN)
    assert pattern is not None
    assert pattern.findall("Hello world's 42, naïve café\n\n  x") == [
        "Hello",
        " world",
        "'s",
        " 42",
        ",",
        " naïve",
        " café",
        "\n\n ",
        " x",
    ]
    qwen = domain_pattern(r"(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|\s+(?!\S)|\s+")
    assert qwen is not None
    assert qwen.findall("IT'S 12 ½") == ["IT", "'S", " ", "1", "2", " ", "½"]


def test_a_qwen_count_is_the_tokenizers_count_and_is_remembered() -> None:
    counter = PreTokenCounter.for_tokenizer(QWEN)
    assert counter is not None and counter.remembered == 0
    text = "The request's prompt — 1,024 tokens, naïve café.\n\n  def f(x):\n\treturn x"
    assert counter.count(text) == len(QWEN.encode(text, add_special_tokens=False))
    remembered = counter.remembered
    assert remembered > 0
    assert counter.count(text) == len(QWEN.encode(text, add_special_tokens=False))
    assert counter.remembered == remembered


@pytest.mark.parametrize(
    "text",
    [
        "e\u0301",  # a combining mark: NFC composes it
        "a\u00a0b",  # no-break space: whitespace to one engine's \s, maybe not the other's
        "x\x00y",
        "日本語テキスト",  # katakana: outside the blocks
        "a" * (MAX_SEGMENT_CHARS + 1),
    ],
)
def test_text_outside_the_domain_or_too_long_is_left_to_tokenizers(text: str) -> None:
    counter = PreTokenCounter.for_tokenizer(QWEN)
    assert counter is not None
    assert counter.count(text) is None


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer"),
    [
        (normalizers.Lowercase(), pre_tokenizers.ByteLevel()),
        (normalizers.NFKC(), pre_tokenizers.ByteLevel()),
        (None, pre_tokenizers.ByteLevel(add_prefix_space=True)),
        (None, pre_tokenizers.Metaspace()),
        (None, pre_tokenizers.Whitespace()),
        (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()])),
    ],
)
def test_other_normalizers_and_pre_tokenizers_get_no_counter(
    normalizer: normalizers.Normalizer | None, pre_tokenizer: pre_tokenizers.PreTokenizer
) -> None:
    tokenizer = byte_level(pre_tokenizer)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    assert PreTokenCounter.for_tokenizer(tokenizer) is None


def test_a_gpt2_style_byte_level_tokenizer_gets_a_counter() -> None:
    tokenizer = byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False))
    counter = PreTokenCounter.for_tokenizer(tokenizer)
    assert counter is not None
    assert counter.count("naïve café's 42") == len("naïve café's 42".encode())  # a token a byte


QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize(
    ("mutant", "original"),
    [
        (r"\s+|", r"\s+(?!\S)|"),  # the lookahead gone
        (r"|\p{N}+|", r"|\p{N}|"),  # digit runs as one pre-token
        ("(?:", "(?i:"),  # contractions in lowercase only
        (r"|\s+", r"|\s*[\r\n]+|\s+"),  # newline runs gone
    ],
)
def test_the_self_check_catches_a_pattern_that_differs_by_one_construct(
    mutant: str, original: str
) -> None:
    # The unchanged pattern passes: Qwen gets a counter (test_a_qwen_count_... above).
    assert QWEN_PATTERN.count(original) == 1
    pattern = domain_pattern(QWEN_PATTERN.replace(original, mutant))
    assert pattern is not None
    assert PreTokenCounter(QWEN, pattern).disagreements(pretokens.self_check_texts())


def test_a_tokenizer_that_fails_the_self_check_gets_no_counter(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Cutting at every whitespace run is not how Qwen cuts "  x" (" " + " x").
    monkeypatch.setattr(pretokens, "domain_pattern", lambda _: re.compile(r"\S+|\s+"))
    with caplog.at_level(logging.WARNING, logger="kvguard.tokens.pretokens"):
        assert PreTokenCounter.for_tokenizer(QWEN) is None
    assert "self-check texts count differently" in caplog.text


def test_mostly_new_text_is_counted_whole_and_each_pre_token_learned_from_it() -> None:
    counter = PreTokenCounter.for_tokenizer(QWEN)
    assert counter is not None
    text = "Zyxw qvbn'Ll 987 ¿Qué? — flarn\n\n\tglorp  snib"
    pieces = counter._findall(text)
    assert counter.count(text) == len(QWEN.encode(text, add_special_tokens=False))
    assert counter.remembered == len(set(pieces))  # every pre-token, from one encode
    # One new pre-token among known ones: counted alone.
    again = text + " blorf"
    assert counter.count(again) == len(QWEN.encode(again, add_special_tokens=False))
    assert counter.remembered == len(set(pieces)) + 1


def test_nothing_is_learnt_from_a_whole_segment_cut_elsewhere_than_tokenizers_cut_it() -> None:
    # As many pieces as Qwen's pre-tokens ("ab", " cd"), but cut after the space: "ab ", "cd".
    counter = PreTokenCounter(QWEN, re.compile(r"\S+\s?|\s+"))
    assert counter.count("ab cd") == len(QWEN.encode("ab cd", add_special_tokens=False))
    assert counter.remembered == 0


def test_the_memory_is_emptied_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pretokens, "MAX_PRE_TOKENS", 5)
    counter = PreTokenCounter.for_tokenizer(QWEN)
    assert counter is not None
    text = "one two three four five six seven"
    assert counter.count(text) == len(QWEN.encode(text, add_special_tokens=False))
    assert counter.remembered == 7  # emptied first, then this text's seven
    assert counter.count("eight") == 1
    assert counter.remembered == 1


def test_segments_of_common_text_are_counted_by_pre_tokens_and_others_by_tokenizers() -> None:
    segments = SegmentCounter.for_tokenizer(QWEN)
    assert segments is not None
    pre_tokens = segments._pre_tokens
    assert pre_tokens is not None
    common = "<|im_start|>user\nThe request's prompt, naïve café — 数据.<|im_end|>"
    assert segments.count(common, False) == len(QWEN.encode(common, add_special_tokens=False))
    learnt = pre_tokens.remembered
    assert learnt > 0  # its segments went through the pre-token counter
    other = "<|im_start|>user\n서울 トークン<|im_end|>"
    assert segments.count(other, False) == len(QWEN.encode(other, add_special_tokens=False))
    assert pre_tokens.remembered == learnt  # outside the domain: tokenizers counted it
