# ruff: noqa: RUF001 - the self-check texts are meant to hold look-alike characters
r"""Exact token counts of common text, pre-token by pre-token, each pre-token's count remembered.

The tokenizers of Qwen, Llama 3, GPT-2 and their kin normalize a text (NFC, or not at all), cut
it into pre-tokens with one regex (a Split, then ByteLevel's byte-to-character mapping; or
ByteLevel's own GPT-2 regex), and run the BPE model on each pre-token alone. A text's count is
therefore the sum of its pre-tokens' counts, and natural text repeats its pre-tokens (" the",
" request", "\n\n") endlessly. tokenizers itself spends most of a count on per-byte alignments
that a count does not need: kvguard cuts the text with the same regex in Python's `re` and adds
up remembered counts instead (measured in bench/bench_tokens.py). Pre-tokens not seen before are
counted by tokenizers itself.

That is exact only where the two regex engines agree, so it is done only on text whose every
character is in `DOMAIN`: ASCII's printable characters, tab, LF and CR, and the letters, digits,
punctuation and symbols of long-assigned blocks (Latin, Greek, Cyrillic, general punctuation,
arrows, mathematical operators, box drawing, CJK ideographs and punctuation, fullwidth forms,
common emoji) that NFC leaves unchanged. On such text `\p{L}` and `\p{N}` are explicit sets,
`\s` is space, tab, LF and CR, and Oniguruma (which tokenizers uses) and `re` are both
backtracking engines with leftmost-first alternation. Any other text, any regex construct not
translated here, and any other normalizer or pre-tokenizer are left to tokenizers itself:
`PreTokenCounter.for_tokenizer` returns None, or `count` returns None. A tokenizer whose cuts or
counts differ from its own pre-tokenizer's and encode's on a fixed corpus of awkward texts at
load gets no counter at all.
"""

from __future__ import annotations

import json
import logging
import random
import re
import unicodedata
from collections import Counter
from itertools import accumulate
from typing import Any, cast

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# What ByteLevel(use_regex=True) splits with (tokenizers' byte_level.rs), as GPT-2 does.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The blocks DOMAIN is drawn from (first and last code point), all assigned long before the
# Unicode versions of Python's and tokenizers' tables.
_BLOCKS = (
    (0x0020, 0x007E),  # ASCII, printable
    (0x00A1, 0x024F),  # Latin-1 Supplement, Latin Extended-A and -B
    (0x0370, 0x04FF),  # Greek, Cyrillic
    (0x2010, 0x205E),  # General Punctuation
    (0x20A0, 0x20BF),  # Currency Symbols
    (0x2100, 0x218B),  # Letterlike Symbols, Number Forms
    (0x2190, 0x22FF),  # Arrows, Mathematical Operators
    (0x2500, 0x27BF),  # Box Drawing ... Dingbats
    (0x3001, 0x303F),  # CJK Symbols and Punctuation
    (0x4E00, 0x9FEF),  # CJK Unified Ideographs
    (0xFF01, 0xFF60),  # Fullwidth Forms
    (0x1F300, 0x1F64F),  # Miscellaneous Symbols and Pictographs, Emoticons
)
# Letters whose case folding differs between the engines' (?i) (dotted and dotless i, long s).
_FOLDING_ODDITIES = frozenset("\u0130\u0131\u017f")
# Normalizers that leave DOMAIN text unchanged.
_IDENTITY_NORMALIZERS = frozenset({"NFC"})
# Escapes that mean the same to Oniguruma and to `re` on DOMAIN text (\d and \w do not:
# Oniguruma's \w has no ½, Python's has).
_PLAIN_ESCAPES = frozenset("sSrnt") | frozenset(r"""\'"^$.|?*+()[]{}-/ !#%&,:;<=>@_`~""")
# Segments longer than this are left to tokenizers, which releases the GIL while it counts
# (cutting here holds it). A higher limit makes long prompts cheaper to count but stalls the
# small requests decided meanwhile.
MAX_SEGMENT_CHARS = 16 * 1024
# Pre-tokens remembered per tokenizer (some 20 MB); past this the memory is emptied.
MAX_PRE_TOKENS = 200_000
# A segment with more than 1/WHOLE_SEGMENT_SHARE of its pre-tokens new is counted by
# tokenizers in one call, which costs several times less a pre-token than one call for each.
WHOLE_SEGMENT_SHARE = 4


def _domain() -> tuple[str, dict[str, str]]:
    """DOMAIN's characters, and the members of each Unicode class used in patterns."""
    chars = ["\t", "\n", "\r"]
    for first, last in _BLOCKS:
        for code in range(first, last + 1):
            char = chr(code)
            category = unicodedata.category(char)
            if (
                (category[0] in "LNPS" or char == " ")
                and unicodedata.normalize("NFC", char) == char
                and char not in _FOLDING_ODDITIES
            ):
                chars.append(char)
    classes = {
        name: "".join(c for c in chars if unicodedata.category(c)[0] == name) for name in "LN"
    }
    return "".join(chars), classes


def _ranges(chars: str) -> str:
    """A character-class body for `chars` (code points in ascending order)."""
    out, i = [], 0
    while i < len(chars):
        j = i
        while j + 1 < len(chars) and ord(chars[j + 1]) == ord(chars[j]) + 1:
            j += 1
        first, last = re.escape(chars[i]), re.escape(chars[j])
        out.append(first if i == j else f"{first}-{last}")
        i = j + 1
    return "".join(out)


DOMAIN, _CLASS_MEMBERS = _domain()
_CLASSES = {name: _ranges(members) for name, members in _CLASS_MEMBERS.items()}
_OUTSIDE = re.compile(f"[^{_ranges(DOMAIN)}]")


def domain_pattern(pattern: str) -> re.Pattern[str] | None:
    """`pattern` (tokenizers' Oniguruma syntax) as a `re` pattern that means the same on DOMAIN
    text, or None when it holds anything not known to."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            if i + 1 >= len(pattern):
                return None
            escaped = pattern[i + 1]
            if escaped == "p":
                match = re.match(r"\{(\w+)\}", pattern[i + 2 :])
                if match is None or match.group(1) not in _CLASSES:
                    return None
                ranges = _CLASSES[match.group(1)]
                out.append(ranges if in_class else f"[{ranges}]")
                i += 2 + match.end()
                continue
            if escaped not in _PLAIN_ESCAPES:
                return None
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if char == "[":
            if in_class:  # a nested class or a POSIX bracket: not translated
                return None
            in_class = True
            out.append(char)
            if pattern.startswith("^", i + 1):
                out.append("^")
                i += 1
            if pattern.startswith("]", i + 1):  # a literal ] first in a class
                return None
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        elif (
            char == "("
            and pattern.startswith("(?", i)
            and not re.match(r"\(\?(?:i:|:|!|=|<!|<=)", pattern[i:])
        ):
            return None  # named groups, other flags, conditionals...
        else:
            out.append(char)
        i += 1
    if in_class:
        return None
    try:
        compiled = re.compile("".join(out))
    except re.error:
        return None
    # findall returns a capturing group's text instead of the whole match.
    return compiled if compiled.groups == 0 else None


def component_state(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's own JSON (its normalizer, its pre-tokenizer), or None; cheaper
    than the whole tokenizer's (~10 MB with the vocabulary)."""
    return None if component is None else json.loads(component.__getstate__())


def _split_pattern(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The one regex that cuts text into pre-tokens, for the two shapes handled here."""
    if pre_tokenizer is None:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers", [])
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    regex = split.get("pattern", {}).get("Regex")
    return regex if isinstance(regex, str) else None


def _identity(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_identity(n) for n in normalizer.get("normalizers", []))
    return normalizer.get("type") in _IDENTITY_NORMALIZERS


def _spans(pieces: list[str]) -> list[tuple[int, int]]:
    """The character offsets of consecutive `pieces`: (0, e0), (e0, e1), ..."""
    ends = list(accumulate(map(len, pieces)))
    return list(zip([0, *ends], ends, strict=False))


class PreTokenCounter:
    """Counts segments (text between added tokens, no special tokens added) of DOMAIN text.

    Thread-safe: the memory is a dict whose reads and writes are single operations; two threads
    counting the same new pre-token both store the same count.
    """

    def __init__(self, tokenizer: Tokenizer, pattern: re.Pattern[str]) -> None:
        self._tokenizer = tokenizer
        self._findall = pattern.findall
        self._match = pattern.match
        self._counts: dict[str, int] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PreTokenCounter | None:
        """A counter for `tokenizer`, or None where its counts are not known to be sums of
        its pre-tokens' counts on DOMAIN text."""
        model = tokenizer.model
        if type(model).__name__ != "BPE" or getattr(model, "dropout", None):
            return None
        if not _identity(component_state(tokenizer.normalizer)):
            return None
        if any(t.normalized for t in tokenizer.get_added_tokens_decoder().values()):
            return None  # they would be matched inside segments, after normalization
        source = _split_pattern(component_state(tokenizer.pre_tokenizer))
        pattern = domain_pattern(source) if source is not None else None
        if pattern is None:
            return None
        counter = cls(tokenizer, pattern)
        wrong = counter.disagreements(self_check_texts())
        if wrong:
            log.warning(
                "counting by pre-tokens is off for this tokenizer: %d of its self-check "
                "texts count differently from tokenizers (first: %r)",
                len(wrong),
                wrong[0],
            )
            return None
        counter._counts.clear()
        return counter

    @property
    def remembered(self) -> int:
        return len(self._counts)

    def count(self, segment: str) -> int | None:
        """Tokens in `segment` as tokenizers counts it without special tokens, or None when it
        is not text this counter can count (outside DOMAIN, too long, or cut unusually)."""
        if len(segment) > MAX_SEGMENT_CHARS or _OUTSIDE.search(segment) is not None:
            return None
        pieces = self._findall(segment)
        if sum(map(len, pieces)) != len(segment):  # text between matches: not handled here
            return None
        counts = list(map(self._counts.get, pieces))
        if None not in counts:
            return sum(counts)  # type: ignore[arg-type]
        new = list(dict.fromkeys(p for p, c in zip(pieces, counts, strict=True) if c is None))
        if len(new) * WHOLE_SEGMENT_SHARE > len(pieces):
            return self._count_whole(segment, pieces)
        for piece in new:
            # Counted alone, a pre-token must be cut exactly as it was in its text.
            match = self._match(piece)
            if match is None or match.end() != len(piece):
                return None
        encodings = self._tokenizer.encode_batch_fast(new, add_special_tokens=False)
        counted = {piece: len(e) for piece, e in zip(new, encodings, strict=True)}
        self._remember(counted)
        return sum(c if c is not None else counted[p] for p, c in zip(pieces, counts, strict=True))

    def _count_whole(self, segment: str, pieces: list[str]) -> int:
        """The segment counted by tokenizers in one call, each pre-token's count remembered from
        it: tokenizers' word ids are its own pre-tokens, and each token's offsets must lie
        within pieces[word] (the regex here cut where tokenizers did), or nothing is learnt."""
        (encoding,) = self._tokenizer.encode_batch([segment], add_special_tokens=False)
        if None in encoding.word_ids:
            return len(encoding)
        words = cast(list[int], encoding.word_ids)
        tally = Counter(words)
        if set(tally) != set(range(len(pieces))):
            return len(encoding)
        bounds = _spans(pieces)
        for (start, end), word in zip(encoding.offsets, words, strict=True):
            if start < bounds[word][0] or end > bounds[word][1]:
                return len(encoding)
        counted: dict[str, int] = {}
        for word, piece in enumerate(pieces):
            if counted.setdefault(piece, tally[word]) != tally[word]:
                return len(encoding)  # one pre-token, two counts: learn nothing
        self._remember(counted)
        return len(encoding)

    def _remember(self, counted: dict[str, int]) -> None:
        if len(self._counts) + len(counted) > MAX_PRE_TOKENS:
            self._counts.clear()
        self._counts.update(counted)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where this counter cuts `text` into pre-tokens (character offsets)."""
        return _spans(self._findall(text))

    def disagreements(self, texts: list[str]) -> list[str]:
        """The texts that this counter cuts elsewhere than tokenizers' own pre-tokenizer does,
        or counts differently from tokenizers (all are counted, and remembered)."""
        pre_tokenizer = self._tokenizer.pre_tokenizer
        expected = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [
            text
            for text, encoding in zip(texts, expected, strict=True)
            if self.spans(text) != [span for _, span in pre_tokenizer.pre_tokenize_str(text)]
            or self.count(text) != len(encoding)
        ]


_FRAGMENTS = (
    "Hello", " world", "the", " The", "'s", "'S", "'t", "'LL", "'Ve", "'d", "'m", "'re", "'",
    " don't", "I'M", "0", "7", "42", " 123", "4567890", "3.14", " -1", "1e9", "0x1F",
    "\n", "\n\n", "\r\n", "\r", " \n", "\n ", "  ", "   ", "\t", " \t ", "\t\n", "  \n  ",
    "!", "!!", "?!", " ...", ".", ",", ";", "(x)", "[1, 2]", "{json: true}", '"quoted"',
    "`code`", "~", "^", "|", "\\", "/", "#", "@user", "$5", "%", "&&", "*", "+=", "<b>", "_",
    "__init__", "a_b", "x=1;y=2", " -- ", "https://example.com/a?b=c&d=e",
    "def f(x):\n    return x\n", "if (a) {\n\tb();\n}", "ALLCAPS", "camelCase", "snake_case",
    " café", "naïve", "Ångström", "ÉCOLE", "straße", "’s", "’LL", "“quoted”", " — ", "–", "…",
    "½", "x²", " µs", "©", "€5", " → ", "≤", "×", "±1", "Ⅻ", "Σ", " αβγ", "Привет", " мир",
    "数据中心", "模型推理，", "。", "「引用」", "！", "１２３", "─┼─", "▶", "☃", "✓", "🙂", "👍🏽",
)  # fmt: skip


def self_check_texts(count: int = 300, seed: int = 0) -> list[str]:
    """Awkward texts: apostrophes in any case, digit runs, punctuation and whitespace runs next to
    words and newlines, code, accents, other scripts, emoji. The same texts every time."""
    rng = random.Random(seed)
    texts = list(_FRAGMENTS)
    while len(texts) < count:
        texts.append("".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(2, 40))))
    return texts
