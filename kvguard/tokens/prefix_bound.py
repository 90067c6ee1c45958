"""A lower bound on a long text's token count, read from part of it.

A prompt that passes max_model_len is refused whatever its exact count, so a text of several
MiB need not be tokenized whole: once it is known to hold enough tokens, counting stops.

By length. A byte-level BPE tokenizer (a ByteLevel pre-tokenizer, every byte in its vocabulary,
nothing dropped on the way) covers each byte of its normalized text with exactly one token, and
a token covers at most as many bytes as its vocabulary string has characters (one per byte) or
its added token has bytes: at most `per_token` bytes (128 for Qwen and Llama 3). A text of B
normalized bytes holds at least ceil(B / per_token) tokens, so one of `per_token * stop_at`
bytes or more is refused without being tokenized, and no longer text is ever read whole.

From a prefix. The tokenizers pipeline cuts a text into words (its pre-tokens) and tokenizes
each word alone. The pre-tokenizers of real tokenizers (regex splits, ByteLevel, Metaspace,
whitespace and punctuation splits) decide a word from the text at most a few characters past
it, and added tokens are at most as long as the longest one. So the words of a prefix that end
more than `margin` characters before the cut are words of the whole text, tokenized alike, and
their tokens are a lower bound of its count. NFC is the exception: it composes a letter with a
combining mark any number of marks later when the marks between have a lower combining class
("xyza" + 200 x U+0316 + U+0301 is "xyzá" + 200 x U+0316), so the word that ends in that letter
is another word in the whole text ([4130, 4360] cut at 150 characters, [28854, 1953] whole, on
Qwen). The count is still a lower bound there: those marks, `margin` or more of two bytes or
more, are the whole text's too and hold more tokens than a word gains or loses when its last
letter changes. tests/tokens/test_prefix_bound_properties.py holds the bound on counts, that case
among its examples. A tokenizer whose words are not local (no pre-tokenizer: the text is one
word) yields no such words; its text is then bounded by length or counted whole.
"""

from __future__ import annotations

import math
from typing import Any

from tokenizers import Encoding, Tokenizer, pre_tokenizers

from kvguard.tokens.pretokens import component_state

# Words ending this close to the cut may be cut differently in the whole text (a lookahead such
# as Qwen's `\s+(?!\S)`, a contraction), before the length of the longest added token, which a
# prefix may hold only in part, is added.
MARGIN_CHARS = 64
# The first prefix read: its rate of tokens per character tells whether the text is likely to
# fit (it is then counted whole at once) or how long a prefix should hold `stop_at` tokens.
FIRST_LOOK_CHARS = 4 * 1024
# A prefix is read this much longer than the rate seen so far says `stop_at` tokens need.
SPARE = 1.25
# Texts longer than twice look_chars(stop_at) are bounded, shorter ones counted whole. It is
# also the size of the batches in which kvguard.tokens.segments counts many short segments.
LOOK_CHARS_PER_TOKEN = 6
MIN_LOOK_CHARS = 16 * 1024
# Normalizers that leave ASCII text unchanged, and the most each can lengthen UTF-8 text
# (Unicode's UAX #15: 3x for NFC and NFD, 11x for NFKC and NFKD).
_ASCII_KEEPING = {"NFC": 3, "NFD": 3, "NFKC": 11, "NFKD": 11}
# Pre-tokenizers that keep every character of the text: each is in one pre-token.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split", "Punctuation"})


def look_chars(stop_at: int) -> int:
    """The characters of a batch of segments read to find `stop_at` tokens."""
    return max(MIN_LOOK_CHARS, LOOK_CHARS_PER_TOKEN * stop_at)


def worth_bounding(chars: int, stop_at: int) -> bool:
    """Whether a text this long is better bounded than counted whole."""
    return chars > 2 * look_chars(stop_at)


class PrefixBound:
    """How one tokenizer's long texts are counted until they are known to reach `stop_at`.

    `whole_texts`: the texts hold added tokens (they are not split into segments first, see
    kvguard.tokens.segments); the length bound then applies only where no normalizer can join what
    lies on either side of an added token (none, or ASCII text) and no added token strips the
    text around it. Immutable, safe to share by threads.
    """

    def __init__(self, tokenizer: Tokenizer, *, whole_texts: bool) -> None:
        self._tokenizer = tokenizer
        added = list(tokenizer.get_added_tokens_decoder().values())
        self.margin = MARGIN_CHARS + max((len(t.content) for t in added), default=0)
        self.per_token = _bytes_per_token(tokenizer, added)
        if whole_texts and any(t.lstrip or t.rstrip for t in added):
            self.per_token = None  # such a token also covers the whitespace beside it
        normalizer = component_state(tokenizer.normalizer)
        kind = None if normalizer is None else normalizer.get("type")
        self._normalizer = tokenizer.normalizer
        self._plain = normalizer is None  # the model sees the text's own bytes
        self._keeps_ascii = self._plain or kind in _ASCII_KEEPING
        self._expands = 1 if self._plain else _ASCII_KEEPING.get(str(kind))
        # Whole texts with a normalizer are bounded by length only when ASCII.
        self._any_text = not whole_texts or self._plain

    def reads_at_most(self, chars: int, stop_at: int | None) -> int:
        """About the most characters that counting a text of `chars` characters (or bytes)
        tokenizes with `stop_at`: the first prefix, prefixes of at most half the text (or of
        the length the length bound reaches), the whole text when those do not settle it."""
        if stop_at is None or not worth_bounding(chars, stop_at):
            return chars
        reach = self._reach(stop_at)
        return FIRST_LOOK_CHARS + 2 * (chars if reach is None else min(chars, reach))

    def count_at_least(self, text: str, stop_at: int, add_special_tokens: bool) -> tuple[int, bool]:
        """(tokens, exact): `text`'s exact count, or a lower bound >= `stop_at` (exact
        False), from its length or from prefixes that grow until one holds `stop_at` tokens."""
        floor = self.floor(text)
        if floor >= stop_at:
            return floor, False
        # The whole text is read only below the length bound's reach: no prefix passes half it.
        reach = self._reach(stop_at, text)
        limit = (len(text) if reach is None else min(len(text), reach)) // 2
        size = FIRST_LOOK_CHARS
        while size <= limit:
            (encoding,) = self._tokenizer.encode_batch(
                [text[:size]], add_special_tokens=add_special_tokens
            )
            bound = settled_tokens(encoding, size - self.margin)
            if bound >= stop_at:
                return bound, False
            if bound == 0:  # no word has ended yet: no rate to go by
                break
            # Long enough at the rate seen so far; past the limit when the text is likely to
            # fit, which is then counted whole at once.
            rate = bound / (size - self.margin)
            size = max(2 * size, self.margin + math.ceil(SPARE * stop_at / rate))
        floor = self._normalized_floor(text, stop_at)
        if floor >= stop_at:
            return floor, False
        (encoding,) = self._tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return len(encoding), True

    def _reach(self, stop_at: int, text: str | None = None) -> int | None:
        """The normalized bytes from which the length bound refuses `text` (any text, where
        None); None where it may not apply."""
        if self.per_token is None:
            return None
        if self._any_text or (text is not None and text.isascii() and self._keeps_ascii):
            return self.per_token * stop_at
        return None

    def floor(self, text: str) -> int:
        """The tokens `text` holds at least by its length, where its length as the model sees
        it is known without normalizing it (0 elsewhere)."""
        if self.per_token is None:
            return 0
        if text.isascii() and self._keeps_ascii:
            return -(-len(text) // self.per_token)
        if self._plain:
            return -(-len(text.encode("utf-8", "surrogatepass")) // self.per_token)
        return 0

    def _normalized_floor(self, text: str, stop_at: int) -> int:
        """`floor`, from the normalized text where it takes normalizing (which costs time per
        character) and the text could reach `stop_at`."""
        known = self.floor(text)
        if known or self.per_token is None or not self._any_text:
            return known
        size = len(text.encode("utf-8", "surrogatepass"))
        if self._expands is not None and size * self._expands < self.per_token * stop_at:
            return 0  # too short to reach `stop_at` even at the most normalizing lengthens
        normalized = self._normalizer.normalize_str(text)
        return -(-len(normalized.encode("utf-8", "surrogatepass")) // self.per_token)


def _bytes_per_token(tokenizer: Tokenizer, added: list[Any]) -> int | None:
    """The most normalized bytes one token covers, where every byte is covered by a token;
    None where that is not known (a model or pre-tokenizer that may drop text or give one
    unknown token for a whole word)."""
    if type(tokenizer.model).__name__ != "BPE":
        return None
    pre_tokenizer = component_state(tokenizer.pre_tokenizer)
    parts = [pre_tokenizer] if pre_tokenizer is not None else []
    if parts and parts[0].get("type") == "Sequence":
        parts = parts[0].get("pretokenizers", [])
    if not any(p.get("type") == "ByteLevel" for p in parts):
        return None
    if any(
        p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
        for p in parts
    ):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if not all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        return None  # a byte without a token of its own could be dropped or unknown
    longest = max(map(len, vocab))
    return max([longest, *(len(t.content.encode("utf-8")) for t in added)])


def settled_tokens(encoding: Encoding, cutoff: int) -> int:
    """The tokens of a prefix's encoding that count towards the whole text's: those of the
    words that end before `cutoff` (a character offset), and the post-processor's own (BOS,
    at 0).

    A word ends before `cutoff` when the next word starts there or earlier; word ids run in
    text order (added tokens get theirs too), so these are the words before the last one that
    starts at or before `cutoff`.
    """
    words, offsets = encoding.word_ids, encoding.offsets
    last = -1
    for word, (start, _) in zip(words, offsets, strict=True):
        if word is not None and start <= cutoff:
            last = word
    return sum(
        1
        for word, (_, end) in zip(words, offsets, strict=True)
        if (word is not None and word < last) or (word is None and end == 0)
    )
