"""Count a request's prompt tokens exactly as vLLM will, without stalling the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvguard.errors import invalid
from kvguard.request import InferenceRequest, add_special_tokens, prompts_of
from kvguard.tokenizer import PoolTokenizer, TokenizerError

# Bodies up to this size are counted on the event loop: a thread hop costs more than the
# count itself. Larger ones go to the pool, where encode_batch releases the GIL.
INLINE_BODY_BYTES = 16 * 1024


def count_prompts(tokenizer: PoolTokenizer, request: InferenceRequest, *, batch: bool) -> list[int]:
    """Prompt tokens per sequence: one entry for chat, one per prompt of a completion.

    `batch` selects encode_batch, which releases the GIL (for worker threads).
    """
    special = add_special_tokens(request)
    try:
        if request.kind == "chat":
            texts: list[str] = [tokenizer.render_chat(request.body)]
            prompts: list[str | list[int]] = list(texts)
        else:
            prompts = prompts_of(request)
            texts = [p for p in prompts if isinstance(p, str)]
        if batch:
            text_counts = iter(tokenizer.count_many(texts, special)) if texts else iter(())
        else:
            text_counts = iter([tokenizer.count(t, special) for t in texts])
    except TokenizerError as exc:
        raise invalid(str(exc), "messages" if request.kind == "chat" else "prompt") from None
    return [len(p) if isinstance(p, list) else next(text_counts) for p in prompts]


class PromptCounter:
    """Counts small requests inline and large ones on a bounded thread pool."""

    def __init__(self, workers: int = 2) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvguard-count")

    async def count(
        self, tokenizer: PoolTokenizer, request: InferenceRequest, body_bytes: int
    ) -> list[int]:
        if body_bytes <= INLINE_BODY_BYTES:
            return count_prompts(tokenizer, request, batch=False)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: count_prompts(tokenizer, request, batch=True)
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
