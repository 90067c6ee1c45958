"""Count a request's prompt tokens exactly as vLLM will, without stalling the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from kvguard.errors import RETRY_AFTER_S, Code, Refusal, invalid
from kvguard.tokens import messages_api, responses_api
from kvguard.tokens.request import (
    PROMPT_FIELD,
    InferenceRequest,
    TokenizerError,
    are_token_ids,
    lax_bool,
)
from kvguard.tokens.tokenizer import ChatPrompt, PoolTokenizer

# Where a count runs, by body size (bench/bench_tokens.py measures the costs). Bodies up to
# INLINE_BODY_BYTES are counted on the event loop: they stall it for well under a millisecond,
# and a thread hop would save little and could queue behind longer counts. Larger ones go to
# threads (tokenizing releases the GIL, so they run in parallel). Counts that weigh more than
# LONG_WORK_BYTES (`work_bytes`: some 15k tokens of new text) may take all threads but one, so
# that shorter counts never queue behind a long prompt.
INLINE_BODY_BYTES = 4 * 1024
LONG_WORK_BYTES = 64 * 1024
# What rendering a chat template costs per message, in body bytes of counting work; the
# template's own text around each message is counted too.
MESSAGE_WORK_BYTES = 64
# Counting work queued or running, in expected seconds at the measured speed: past this a
# request is refused rather than left to wait near the 5 s an extended Envoy message timeout
# allows. The speed starts at INITIAL_BYTES_PER_S a thread and follows the counts actually run,
# so a slow or busy host refuses sooner.
MAX_BACKLOG_S = 2.0
INITIAL_BYTES_PER_S = 2_000_000


def count_prompts(
    tokenizer: PoolTokenizer,
    request: InferenceRequest,
    *,
    media_tokens: Mapping[str, int] | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Prompt tokens per sequence, as vLLM reports them: one entry for chat, one per prompt
    of a completion. Raises Refusal(invalid_request) where vLLM would answer 400, and
    Refusal(context_length_exceeded) for a prompt that reaches `max_model_len`: such a prompt
    is counted only until it is known to (a long one is never tokenized whole).

    `media_tokens` is the pool's declared cost per media content-part type (chat only);
    `max_model_len` resolves `truncate_prompt_tokens: -1`.
    """
    special = add_special_tokens(request)
    param = PROMPT_FIELD[request.kind]
    stop_at = _enough(request, max_model_len)
    media = 0
    try:
        if request.kind != "completion":
            chat = _chat_prompt(tokenizer, request, media_tokens)
            prompts: list[str | list[int]] = [chat.text]
            media = chat.media_tokens
        else:
            prompts = prompts_of(request)
        texts = [p for p in prompts if isinstance(p, str)]
        counted = tokenizer.count_many(texts, special, stop_at)
    except TokenizerError as exc:
        raise invalid(str(exc), param) from None
    text_counts = iter(counted)
    counts = [
        _kept(len(p) if isinstance(p, list) else next(text_counts) + media, request, max_model_len)
        for p in prompts
    ]
    if 0 in counts:
        raise invalid("a prompt is empty after tokenization, which vLLM refuses", param)
    if max_model_len is not None and max(counts) >= max_model_len:
        # Counting may have stopped at max_model_len: what is known is a lower bound.
        raise Refusal(
            Code.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has at least {max(counts)} tokens, which reaches this model's maximum "
            f"context length of {max_model_len} tokens",
            param,
        )
    return counts


def _chat_prompt(
    tokenizer: PoolTokenizer, request: InferenceRequest, media_tokens: Mapping[str, int] | None
) -> ChatPrompt:
    """The rendered prompt of a chat, or of a Responses or Messages body turned into the chat
    vLLM renders for it."""
    if request.kind == "chat":
        return tokenizer.chat_prompt(request.body, media_tokens)
    if request.kind == "responses":
        converted = responses_api.chat_input(request.body)
    else:
        converted = messages_api.chat_input(request.body, tokenizer)
    return tokenizer.messages_prompt(
        converted.messages, converted.tools, converted.options, media_tokens
    )


# Where vLLM's tokenization ignores the body: its Responses API adds special tokens (its
# default TokenizeParams), its Messages API goes through a chat request that does not.
_FIXED_SPECIAL_TOKENS = {"responses": True, "messages": False}


def add_special_tokens(request: InferenceRequest) -> bool:
    """vLLM's default: False for chat (the template adds them), True for completions; a
    request's own `add_special_tokens` where vLLM reads one."""
    fixed = _FIXED_SPECIAL_TOKENS.get(request.kind)
    if fixed is not None:
        return fixed
    try:
        return lax_bool(
            request.body.get("add_special_tokens", request.kind == "completion"),
            "add_special_tokens",
        )
    except TokenizerError as exc:
        raise invalid(str(exc), "add_special_tokens") from None


def _enough(request: InferenceRequest, max_model_len: int | None) -> int | None:
    """The count past which the exact number changes nothing (None: none): at max_model_len a
    prompt is refused, and vLLM keeps at most `truncate_prompt_tokens` of it."""
    if max_model_len is None:
        return None
    keep = request.truncate_prompt_tokens
    if keep is None:
        return max_model_len
    return min(max_model_len, max_model_len - 1 if keep == -1 else keep)


def prompts_of(request: InferenceRequest) -> list[str | list[int]]:
    """A completion's prompts, each its own sequence (a string or token ids)."""
    prompt = request.body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if are_token_ids(prompt):
        return [prompt]
    return list(prompt)


def _kept(tokens: int, request: InferenceRequest, max_model_len: int | None) -> int:
    """What vLLM keeps of a prompt under `truncate_prompt_tokens` (its default side, left).

    -1 keeps what fits beside the output limit; kvguard then clamps that limit to the room
    left, so `max_model_len - 1` is exactly what vLLM keeps with the rewritten body.
    """
    keep = request.truncate_prompt_tokens
    if keep is None or (keep == -1 and max_model_len is None):
        return tokens
    return min(tokens, max_model_len - 1 if keep == -1 and max_model_len else keep)


class PromptCounter:
    """Counts small requests inline and the rest on `workers + 1` threads, of which long
    counts may take `workers`.

    The bound is on work, not only on threads: the work queued or running (`work_bytes` of
    each body: what its count reads at most) must take at most MAX_BACKLOG_S to count at the
    measured speed (or stay under `pending_bytes`, when given). Past it a request is refused
    at once (503, retry-after) instead of waiting past Envoy's message timeout. Work stays
    counted until its thread finishes, even when the stream that asked for it is gone.
    """

    def __init__(self, workers: int = 2, pending_bytes: int | None = None) -> None:
        self._executor = ThreadPoolExecutor(workers + 1, thread_name_prefix="kvguard-count")
        self._workers = workers
        self._long = asyncio.Semaphore(workers)
        self._max_pending = pending_bytes
        self._pending = 0
        self._bytes_per_s = float(INITIAL_BYTES_PER_S)  # per thread, a moving average

    @property
    def pending_bytes(self) -> int:
        """Work (`work_bytes` of each body) queued or being counted off the event loop."""
        return self._pending

    @property
    def bytes_per_s(self) -> float:
        """The measured counting speed of one thread, in `work_bytes` per second."""
        return self._bytes_per_s

    def _too_busy(self, work: int) -> bool:
        if not self._pending:  # one request larger than the bound is still served, alone
            return False
        backlog = self._pending + work
        if self._max_pending is not None:
            return backlog > self._max_pending
        return backlog / (self._workers * self._bytes_per_s) > MAX_BACKLOG_S

    async def count(
        self,
        tokenizer: PoolTokenizer,
        request: InferenceRequest,
        body_bytes: int,
        *,
        media_tokens: Mapping[str, int] | None = None,
        max_model_len: int | None = None,
    ) -> list[int]:
        """count_prompts, inline or on a thread by body size. Raises Refusal."""
        work = partial(
            count_prompts,
            tokenizer,
            request,
            media_tokens=media_tokens,
            max_model_len=max_model_len,
        )
        if body_bytes <= INLINE_BODY_BYTES:
            return work()
        read = work_bytes(tokenizer, request, body_bytes, max_model_len)
        if not read:  # token ids only: nothing to tokenize
            return work()
        if self._too_busy(read):
            raise Refusal(
                Code.INTERNAL_ERROR,
                "kvguard is busy counting other large prompts; retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        self._pending += read
        long = read > LONG_WORK_BYTES
        if long:
            try:
                await self._long.acquire()
            except BaseException:  # the stream went away while waiting: nothing ran
                self._pending -= read
                raise
        loop = asyncio.get_running_loop()
        future = self._executor.submit(_timed, work)
        # When the thread finishes, or at once if cancelled while still queued.
        future.add_done_callback(partial(self._finished, loop, read, long))
        counts, _ = await asyncio.wrap_future(future)
        return counts

    def _finished(
        self,
        loop: asyncio.AbstractEventLoop,
        body_bytes: int,
        long: bool,
        future: Future[tuple[list[int], float]],
    ) -> None:
        ran = not future.cancelled() and future.exception() is None
        seconds = future.result()[1] if ran else 0.0

        def release() -> None:
            self._pending -= body_bytes
            if long:
                self._long.release()
            if seconds > 0:
                self._bytes_per_s = 0.8 * self._bytes_per_s + 0.2 * body_bytes / seconds

        if not loop.is_closed():
            loop.call_soon_threadsafe(release)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# Top-level strings that a count reads: the others are left out of a body's weight.
_PROMPT_STRINGS = {"responses": ("input", "instructions"), "messages": ("system",)}


def work_bytes(
    tokenizer: PoolTokenizer, request: InferenceRequest, body_bytes: int, max_model_len: int | None
) -> int:
    """About the most that counting this body reads, in body bytes: its prompts, each read
    only until it is known to reach max_model_len (`PoolTokenizer.reads_at_most`), and a chat
    template's work for each message. Top-level strings other than a prompt are never read
    (`user`, `model`, …): a small chat padded in one weighs what the chat does."""
    body = request.body
    read = _PROMPT_STRINGS.get(request.kind, ("prompt",))
    text = body_bytes - sum(len(v) for k, v in body.items() if k not in read and isinstance(v, str))
    stop_at = _enough(request, max_model_len)
    if request.kind != "completion":
        messages = body.get(PROMPT_FIELD[request.kind])  # chat messages, or Responses' input
        rendering = MESSAGE_WORK_BYTES * (len(messages) if isinstance(messages, list) else 1)
        return rendering + tokenizer.reads_at_most(text + rendering, stop_at)
    return sum(
        # At most 4 UTF-8 bytes a character, and at most the body's own bytes.
        tokenizer.reads_at_most(len(p) if p.isascii() else min(text, 4 * len(p)), stop_at)
        for p in prompts_of(request)
        if isinstance(p, str)
    )


def _timed(work: Callable[..., list[int]]) -> tuple[list[int], float]:
    """The pool's count and the seconds its thread spent on it."""
    start = time.perf_counter()
    counts = work()
    return counts, time.perf_counter() - start
