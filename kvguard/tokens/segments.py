"""Exact token counts, segment by segment, remembering the segments seen before.

The `tokenizers` pipeline first cuts a text at its added tokens (`<|im_start|>`, `<|eot_id|>`,
…: leftmost-longest matching on the raw text), then normalizes, pre-tokenizes and runs the model
on each segment between them on its own. So where no step depends on a segment's position in the
whole text, count(text) = Σ count(segment) + one per added token matched, plus what the
post-processor adds (BOS). Chat traffic repeats most of its text from request to request (the
system prompt, earlier turns: segments between the template's special tokens), and a segment
counted once need not be tokenized again.

`SegmentCounter.for_tokenizer` returns None where that equality is not known to hold (an added
token that strips or matches whole words only, a pre-tokenizer that treats the text's first
segment differently such as Metaspace with prepend_scheme "first", a component not listed
here): the caller then tokenizes whole texts.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter, OrderedDict
from typing import Any, cast

from tokenizers import Tokenizer

from kvguard.tokens.prefix_bound import PrefixBound, look_chars, worth_bounding
from kvguard.tokens.pretokens import PreTokenCounter, component_state

# Normalizers and pre-tokenizers that act on each segment alone, whatever precedes it. Every
# normalizer does; pre-tokenizers too, but Metaspace with prepend_scheme "first" (which
# prepends only at offset 0 of the whole text) and anything newer than this list.
_SEGMENT_LOCAL_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "Metaspace",  # unless prepend_scheme is "first": see _segment_local
        "Punctuation",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)
# Counts kept per tokenizer, in characters of the segments they belong to (and as much again
# in bookkeeping): at ~4 characters per token, about 8M tokens of distinct recent text.
MAX_CACHED_CHARS = 32 * 2**20
_ENTRY_OVERHEAD_CHARS = 100  # an OrderedDict entry, its key's header and an int


def _segment_local(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_segment_local(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Metaspace":
        return pre_tokenizer.get("prepend_scheme") in ("always", "never")
    return kind in _SEGMENT_LOCAL_PRE_TOKENIZERS


class SegmentCounter:
    """Counts texts segment by segment, and keeps the counts of recent segments.

    Thread-safe: the cache is locked only around its bookkeeping, never while tokenizing.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        added_tokens: list[str],
        max_cached_chars: int = MAX_CACHED_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        # Leftmost-longest, as the tokenizers crate matches added tokens: at the first position
        # where any token matches, the alternation tries the longest first.
        by_length = sorted(set(added_tokens), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, by_length)) + ")").split
        processor = tokenizer.post_processor
        self._added_by_post_processor = (
            processor.num_special_tokens_to_add(False) if processor is not None else 0
        )
        # Segments of common text are counted by pre-tokens where the tokenizer allows it.
        self._pre_tokens = PreTokenCounter.for_tokenizer(tokenizer)
        self.bound = PrefixBound(tokenizer, whole_texts=False)  # for segments, not whole texts
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._cached_chars = 0
        self._max_cached_chars = max_cached_chars
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Tokenizer, max_cached_chars: int = MAX_CACHED_CHARS
    ) -> SegmentCounter | None:
        """A counter for `tokenizer`, or None where counting by segments might differ from
        counting the whole text."""
        if tokenizer.encode_special_tokens:
            return None
        if not _segment_local(component_state(tokenizer.pre_tokenizer)):
            return None
        splitting = [t for t in tokenizer.get_added_tokens_decoder().values() if not t.normalized]
        if not splitting or any(t.lstrip or t.rstrip or t.single_word for t in splitting):
            return None
        return cls(tokenizer, [t.content for t in splitting if t.content], max_cached_chars)

    @property
    def cached_segments(self) -> int:
        return len(self._counts)

    def count(self, text: str, add_special_tokens: bool, stop_at: int | None = None) -> int:
        """Tokens in `text`, exactly as `len(tokenizer.encode(text, add_special_tokens))`; with
        `stop_at`, a count of `stop_at` or more may be a lower bound (a long text is then
        counted only until it is known to reach `stop_at`)."""
        parts = self._split(text)  # segment, token, segment, …, segment
        segments = parts[::2]
        total = len(parts) // 2 + (self._added_by_post_processor if add_special_tokens else 0)
        missing: list[str] = []
        with self._lock:
            for segment in segments:
                if not segment:
                    continue
                known = self._counts.get(segment)
                if known is None:
                    missing.append(segment)
                else:
                    self._counts.move_to_end(segment)
                    total += known
        if not missing:
            return total
        if stop_at is not None and worth_bounding(sum(map(len, missing)), stop_at):
            return self._count_until(missing, total, stop_at)
        unique = list(dict.fromkeys(missing))
        counted = dict(zip(unique, self._tokenize(unique), strict=True))
        total += sum(counted[s] for s in missing)
        self._remember(counted)
        return total

    def _count_until(self, missing: list[str], total: int, stop_at: int) -> int:
        """`total` plus the tokens of the `missing` segments, counted in text order, a batch of
        about look_chars(stop_at) characters at a time, until the sum reaches `stop_at`.
        A segment longer than that is bounded by its length or its prefixes
        (kvguard.tokens.prefix_bound)."""
        look = look_chars(stop_at)
        repeats = Counter(missing)
        # Their lengths alone may tell (kvguard.tokens.prefix_bound): then none is tokenized.
        floor = total + sum(self.bound.floor(s) * n for s, n in repeats.items())
        if floor >= stop_at:
            return floor
        batch: list[str] = []
        batch_chars = 0
        for segment in repeats:  # in the order of first appearance
            if total >= stop_at:
                return total
            if len(segment) <= look:
                batch.append(segment)
                batch_chars += len(segment)
                if batch_chars >= look:
                    total += self._count_batch(batch, repeats)
                    batch, batch_chars = [], 0
                continue
            need = math.ceil((stop_at - total) / repeats[segment])
            tokens, exact = self.bound.count_at_least(segment, need, False)
            if exact:
                self._remember({segment: tokens})
            total += tokens * repeats[segment]
        if batch and total < stop_at:
            total += self._count_batch(batch, repeats)
        return total

    def _count_batch(self, segments: list[str], repeats: Counter[str]) -> int:
        counted = dict(zip(segments, self._tokenize(segments), strict=True))
        self._remember(counted)
        return sum(tokens * repeats[s] for s, tokens in counted.items())

    def _tokenize(self, segments: list[str]) -> list[int]:
        counter = self._pre_tokens
        known = [counter.count(s) if counter else None for s in segments]
        rest = [s for s, c in zip(segments, known, strict=True) if c is None]
        if not rest:  # all counted by pre-tokens: no call into tokenizers (and no GIL handoff)
            return cast(list[int], known)
        # encode_batch_fast: no offsets kept (only lengths are needed), and the GIL released.
        encoded = iter(self._tokenizer.encode_batch_fast(rest, add_special_tokens=False))
        return [len(next(encoded)) if c is None else c for c in known]

    def _remember(self, counted: dict[str, int]) -> None:
        with self._lock:
            for segment, tokens in counted.items():
                if segment in self._counts:
                    continue  # another thread counted it meanwhile
                self._counts[segment] = tokens
                self._cached_chars += len(segment) + _ENTRY_OVERHEAD_CHARS
            while self._cached_chars > self._max_cached_chars and self._counts:
                segment, _ = self._counts.popitem(last=False)
                self._cached_chars -= len(segment) + _ENTRY_OVERHEAD_CHARS
