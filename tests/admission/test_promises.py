"""What a refusal promises, in pure code (kvguard.admission.promises): the retry key, the
promise's terms (their jitter drawn from the injected generator), the hold times learnt from
releases, and the RateLimit headers' structured-field form."""

from __future__ import annotations

import math
import random

from kvguard.admission.promises import (
    DEFAULT_HOLD_S,
    GRACE_S,
    JITTER_S,
    PRIOR_BLOCKS,
    HoldTimes,
    RateLimit,
    retry_key,
    terms,
)
from kvguard.config.schema import Capacity, Pool

POOL = Pool(
    name="p",
    models=["m"],
    tokenizer="/models/p",
    max_model_len=4096,
    capacity=Capacity(blocks=1000, block_size=16),
)


def test_a_retry_is_known_by_its_token_or_by_its_tenant_and_body() -> None:
    body = b'{"model": "m", "prompt": "hi"}'
    key = retry_key("acme", body)
    assert len(key) == 32 and key == retry_key("acme", body)
    assert key != retry_key("globex", body)  # another tenant's same body is another request
    assert key != retry_key("acme", body + b" ")
    assert retry_key("acme", b"other body", token=key) == key  # the token handed back
    assert retry_key("acme", body, token="not a token") == key  # anything else is ignored


def test_terms_draw_their_jitter_from_the_generator_given() -> None:
    first = terms(POOL, 7.5, random.Random(42))
    again = terms(POOL, 7.5, random.Random(42))
    assert first == again and first is not None
    assert (first.hold_s, first.max_wait_s, first.grace_s) == (7.5, 30.0, GRACE_S)
    assert 0 <= first.jitter_s <= JITTER_S
    draws = {terms(POOL, 7.5, random.Random(seed)).jitter_s for seed in range(20)}  # type: ignore[union-attr]
    assert len(draws) == 20  # spread, not one value
    silent = POOL.model_copy(update={"retry_after_max_seconds": 0.0})
    assert terms(silent, 7.5, random.Random(0)) is None


def test_hold_times_start_from_the_assumed_one_and_learn_block_weighted() -> None:
    holds = HoldTimes()
    assert holds.hold_s("p") == DEFAULT_HOLD_S
    holds.record("p", PRIOR_BLOCKS, 2.0)  # as many blocks as the prior counts for
    assert math.isclose(holds.hold_s("p"), (DEFAULT_HOLD_S + 2.0) / 2, rel_tol=0.01)
    for _ in range(5000):  # the prior's weight fades as leases end
        holds.record("p", 50, 2.0)
    assert math.isclose(holds.hold_s("p"), 2.0, rel_tol=0.2)
    assert holds.hold_s("other") == DEFAULT_HOLD_S


def test_rate_limit_headers_are_structured_fields() -> None:
    assert RateLimit(400, 391).headers() == {
        "ratelimit-policy": '"kv";q=400',
        "ratelimit": '"kv";r=391;t=0',
    }
    assert RateLimit(40, -3, 2.1).headers()["ratelimit"] == '"kv";r=0;t=3'  # never below 0
    assert RateLimit(40, 0, math.inf).headers()["ratelimit"] == '"kv";r=0'  # no time to tell
