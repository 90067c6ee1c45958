"""What a refusal promises, in pure code (kvguard.admission.promises): the retry key, the
promise's terms (their jitter drawn from the injected generator), and the RateLimit headers'
structured-field form."""

from __future__ import annotations

import math
import random

from kvguard.admission.promises import GRACE_S, JITTER_S, RateLimit, retry_key, terms
from kvguard.config.schema import CapacityConfig, PoolConfig

POOL = PoolConfig(
    name="p",
    models=["m"],
    tokenizer="/models/p",
    max_model_len=4096,
    capacity=CapacityConfig(blocks=1000, block_size=16),
    retry_after_max_seconds=30.0,
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
    first = terms(POOL, random.Random(42))
    again = terms(POOL, random.Random(42))
    assert first == again and first is not None
    assert (first.max_wait_s, first.grace_s) == (30.0, GRACE_S)
    assert 0 <= first.jitter_s <= JITTER_S
    draws = {terms(POOL, random.Random(seed)).jitter_s for seed in range(20)}  # type: ignore[union-attr]
    assert len(draws) == 20  # spread, not one value
    silent = POOL.model_copy(update={"retry_after_max_seconds": 0.0})
    assert terms(silent, random.Random(0)) is None
    default = PoolConfig.model_fields["retry_after_max_seconds"].default
    by_default = POOL.model_copy(update={"retry_after_max_seconds": default})
    assert terms(by_default, random.Random(0)) is None  # no promises unless asked for


def test_rate_limit_headers_are_structured_fields() -> None:
    assert RateLimit(400, 391).headers() == {
        "ratelimit-policy": '"kv";q=400',
        "ratelimit": '"kv";r=391;t=0',
    }
    assert RateLimit(40, -3, 2.1).headers()["ratelimit"] == '"kv";r=0;t=3'  # never below 0
    assert RateLimit(40, 0, math.inf).headers()["ratelimit"] == '"kv";r=0'  # no time to tell
