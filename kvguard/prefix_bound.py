"""A lower bound on a long text's token count, read from a prefix of it.

A prompt that passes max_model_len is refused whatever its exact count, so a text of several
MiB need not be tokenized whole: once a prefix is known to hold enough tokens, counting stops.

The tokenizers pipeline cuts a text into words (its pre-tokens) and tokenizes each word alone.
The normalizers and pre-tokenizers of real tokenizers (regex splits, ByteLevel, Metaspace,
whitespace and punctuation splits, NFC) decide a word from the text at most a few characters
past it, and added tokens are at most as long as the longest one. So the words of a prefix that
end more than `margin_chars` before the cut are words of the whole text too, tokenized alike:
their tokens are a lower bound of the whole text's count. A tokenizer whose words are not local
(no pre-tokenizer: the text is one word) yields no such words; its text is then counted whole.
"""

from __future__ import annotations

from tokenizers import Encoding, Tokenizer

# Words ending this close to the cut may be cut differently in the whole text (a lookahead such
# as Qwen's `\s+(?!\S)`, a contraction, NFC composing with the next character), before the
# length of the longest added token, which a prefix may hold only in part, is added.
MARGIN_CHARS = 64
# The first prefix looked at: about enough characters for `stop_at` tokens of prose (~4-5
# characters a token in English, fewer in code and CJK); a longer one follows where not.
LOOK_CHARS_PER_TOKEN = 6
MIN_LOOK_CHARS = 16 * 1024


def margin_chars(tokenizer: Tokenizer) -> int:
    """How far before a prefix's end its words are known to be the whole text's."""
    added = [len(t.content) for t in tokenizer.get_added_tokens_decoder().values()]
    return MARGIN_CHARS + max(added, default=0)


def look_chars(stop_at: int) -> int:
    """The characters of the first prefix read to find `stop_at` tokens."""
    return max(MIN_LOOK_CHARS, LOOK_CHARS_PER_TOKEN * stop_at)


def worth_bounding(chars: int, stop_at: int) -> bool:
    """Whether a text this long is better bounded from prefixes than counted whole."""
    return chars > 2 * look_chars(stop_at)


def count_at_least(
    tokenizer: Tokenizer, text: str, stop_at: int, add_special_tokens: bool, margin: int
) -> tuple[int, bool]:
    """(tokens, exact): `text`'s exact count, or a lower bound >= `stop_at` read from a prefix
    (exact False). Prefixes grow until one holds `stop_at` tokens or the text is read whole."""
    size = look_chars(stop_at)
    while size < len(text):
        (encoding,) = tokenizer.encode_batch([text[:size]], add_special_tokens=add_special_tokens)
        bound = settled_tokens(encoding, size - margin)
        if bound >= stop_at:
            return bound, False
        # At least twice as long, or long enough at the rate seen so far, with some to spare.
        size = max(2 * size, int(size * 1.2 * stop_at / max(bound, 1)))
    (encoding,) = tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
    return len(encoding), True


def settled_tokens(encoding: Encoding, cutoff: int) -> int:
    """The tokens of a prefix's encoding that the whole text holds too: those of the words that
    end before `cutoff` (a character offset), and the post-processor's own (BOS, at 0).

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
