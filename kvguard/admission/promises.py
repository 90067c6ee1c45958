"""What a refusal promises (docs/design.md, "Refusals people can act on").

- `HoldTimes` measures how long a reserved block stays reserved in each pool (a decayed,
  block-weighted mean of lease durations): the ledger's `Terms` take the pool to drain
  `limit / hold_s` blocks a second when full.
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

from kvguard.config.schema import Pool
from kvguard.ledger import Terms

# The client's retry time is spread over this many seconds after its slot, so that clients
# promised neighbouring slots do not come back at the same instant; and its blocks are held
# this long past it (a client's own delays: its timer, connecting, sending the body).
JITTER_S = 0.5
GRACE_S = 2.0
# A hold time assumed until a pool has released leases (about what a 1,000-token answer
# takes), and how many blocks' worth of leases it counts for once they have.
DEFAULT_HOLD_S = 10.0
PRIOR_BLOCKS = 2000
# Each lease's weight in the mean fades by this factor at every new one (~200 leases count).
DECAY = 1 - 1 / 200

# The request header a client sends the token back in, and its form (retry_key's digest).
RETRY_TOKEN_HEADER = "x-kvguard-retry-token"
_TOKEN = re.compile(r"[0-9a-f]{32}")


class HoldTimes:
    """Seconds a reserved block stays reserved, per pool: what the promises' drain rate
    reads. It starts from DEFAULT_HOLD_S, counted as PRIOR_BLOCKS of leases (the first leases
    to end are the short ones, and alone would make it too short), which fades like any lease
    as more end."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, float]] = {}  # pool -> (blocks x seconds, blocks)

    def record(self, pool: str, blocks: int, seconds: float) -> None:
        weighted, total = self._sums.get(pool, _PRIOR)
        self._sums[pool] = (weighted * DECAY + blocks * seconds, total * DECAY + blocks)

    def hold_s(self, pool: str) -> float:
        weighted, total = self._sums.get(pool, _PRIOR)
        return weighted / total


_PRIOR = (PRIOR_BLOCKS * DEFAULT_HOLD_S, float(PRIOR_BLOCKS))


def retry_key(tenant: str, body: bytes, token: str = "") -> str:
    """The key of a request's promise: `token` when it has kvguard's form, else the digest
    of the tenant and the body."""
    if _TOKEN.fullmatch(token):
        return token
    digest = hashlib.blake2b(tenant.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(body)
    return digest.hexdigest()


def terms(pool: Pool, hold_s: float, rng: random.Random) -> Terms | None:
    """The terms a refusal in `pool` is promised a slot by; None when the pool makes no
    promises."""
    if pool.retry_after_max_seconds <= 0:
        return None
    return Terms(hold_s, pool.retry_after_max_seconds, rng.uniform(0, JITTER_S), GRACE_S)


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
