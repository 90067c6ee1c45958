"""A count that outlasts Envoy's 200 ms message_timeout, through the real Envoy: kvguard asks for
more time (override_message_timeout, up to envoy.yaml's max_message_timeout) and the request
is still decided, instead of Envoy answering 504."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvguard.extproc import service
from tests.gateway import gateway

pytestmark = pytest.mark.integration

# Longer than Envoy's message_timeout (0.2 s), well under the 5 s kvguard asks for.
SLOW_COUNT_S = 0.6


@pytest.mark.parametrize("extend", [True, False])
async def test_a_slow_count_is_decided_not_timed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extend: bool
) -> None:
    if not extend:  # the control: without the extension Envoy gives up at 200 ms
        monkeypatch.setattr(service, "SLOW_DECISION_S", 60.0)
    async with gateway(tmp_path, max_model_len=40_000, blocks=100_000) as gw:
        tokenizer = gw.service.policy.pools["qwen"].tokenizer
        count_many = tokenizer.count_many
        never = threading.Event()

        def slow(texts: list[str], special: bool, stop_at: int | None = None) -> list[int]:
            never.wait(SLOW_COUNT_S)  # stands for a count this slow on the worker thread
            return count_many(texts, special, stop_at)

        monkeypatch.setattr(tokenizer, "count_many", slow)
        payload = {
            "model": "qwen",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "token " * 3000}],  # counted on the pool
        }
        status, _, _ = await gw.post("/v1/chat/completions", payload)
        if extend:
            assert status == 200
            (seen,) = gw.upstream.requests
            assert int(seen.headers["x-kvguard-prompt-tokens"]) > 3000
        else:
            assert status == 504
            assert gw.upstream.requests == []
