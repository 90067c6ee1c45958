"""When kvguard's load generator (kvguard/sim/load.py, the demo's clients) retries, as the
OpenAI SDK does (sdk_retry_delay): x-should-retry first, then the status; retry-after-ms
before retry-after, within 60 s; else the SDK's backoff."""

from __future__ import annotations

import random

from kvguard.sim.load import sdk_retry_delay


def test_the_answer_says_whether_and_when() -> None:
    rng = random.Random(0)
    promised = {"x-should-retry": "true", "retry-after-ms": "2500", "retry-after": "3"}
    assert sdk_retry_delay(429, promised, 0, rng) == 2.5
    assert sdk_retry_delay(429, {"retry-after": "3"}, 0, rng) == 3.0
    assert sdk_retry_delay(429, {"x-should-retry": "false", "retry-after": "3"}, 0, rng) is None
    assert sdk_retry_delay(200, {}, 0, rng) is None
    assert sdk_retry_delay(400, {}, 0, rng) is None  # a request error is not retried
    assert sdk_retry_delay(400, {"x-should-retry": "true", "retry-after": "1"}, 0, rng) == 1.0


def test_without_a_usable_time_the_sdks_backoff() -> None:
    rng = random.Random(0)
    first = sdk_retry_delay(503, {}, 0, rng)
    later = sdk_retry_delay(503, {"retry-after": "90"}, 5, rng)  # past 60 s: ignored
    assert first is not None and 0.375 <= first <= 0.5
    assert later is not None and 6.0 <= later <= 8.0
