"""What a refusal promises (docs/design.md, "Refusals people can act on").

- `retry_key` names a request as its retry will be recognised: the token kvguard handed out
  with the refusal, when the client sends it back, else a digest of the tenant and the body (an
  SDK retries the same body).
- `terms` are the promise's terms for a pool; `rate_limit` the RateLimit headers
  (draft-ietf-httpapi-ratelimit-headers-10, structured fields).

Pure: times and randomness are arguments.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

from kvguard.config.schema import PoolConfig
from kvguard.ledger import Terms

# The client's retry time is spread over this many seconds after its slot, so that clients
# promised neighbouring slots do not come back at the same instant; and a retry that came back
# may wait this long past it for its blocks (the slot is an expectation, not an instant).
JITTER_S = 0.5
GRACE_S = 2.0
# The request header a client sends the token back in, and its form (retry_key's digest).
RETRY_TOKEN_HEADER = "x-kvguard-retry-token"
_TOKEN = re.compile(r"[0-9a-f]{32}")


def retry_key(tenant: str, body: bytes, token: str = "") -> str:
    """The key of a request's promise: `token` when it has kvguard's form, else the digest
    of the tenant and the body."""
    if _TOKEN.fullmatch(token):
        return token
    digest = hashlib.blake2b(tenant.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(body)
    return digest.hexdigest()


def terms(pool: PoolConfig, rng: random.Random) -> Terms | None:
    """The terms a refusal in `pool` is promised a slot by; None when the pool makes no
    promises."""
    if pool.retry_after_max_seconds <= 0:
        return None
    return Terms(pool.retry_after_max_seconds, rng.uniform(0, JITTER_S), GRACE_S)


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Where a tenant stands in a pool, in blocks: its quota, what it could reserve now, and
    the seconds until the blocks its request needs are expected free (0 when admitted;
    inf when that cannot be told)."""

    quota: int
    remaining: int
    reset_s: float = 0.0

    def headers(self) -> dict[str, str]:
        """`RateLimit-Policy` and `RateLimit`, as draft-10's structured fields."""
        state = f'"kv";r={max(0, self.remaining)}'
        if math.isfinite(self.reset_s):
            state += f";t={math.ceil(self.reset_s)}"
        return {"ratelimit-policy": f'"kv";q={self.quota}', "ratelimit": state}
