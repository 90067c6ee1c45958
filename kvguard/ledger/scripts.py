"""The Lua scripts of the Redis ledger, the keys they take, and the answers read by name.

Each script is package data (kvguard/ledger/lua/NAME.lua), expanded with its `--#include` lines
(lib.lua) and named by its SHA1 for EVALSHA; every key of a pool is hash-tagged `{pool}`, so a
script's keys share one Redis Cluster slot. lib.lua binds them to named locals in the order of
`all_keys`.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from kvguard.ledger import Claim, Outcome, Reservation

_INCLUDE = re.compile(r"^--#include (\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str  # with lib.lua included
    sha: str  # SHA1 of `source`, as EVALSHA names it


def load_script(name: str) -> Script:
    """Read kvguard/ledger/lua/NAME.lua (package data) and expand its `--#include` lines."""
    folder = importlib.resources.files("kvguard.ledger").joinpath("lua")

    def include(match: re.Match[str]) -> str:
        return folder.joinpath(match.group(1)).read_text(encoding="utf-8")

    source = _INCLUDE.sub(include, folder.joinpath(f"{name}.lua").read_text(encoding="utf-8"))
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


SCRIPT_NAMES = ("reserve", "release", "renew", "reassert", "usage", "leases", "replicas")
# Every kvguard process sharing this Redis registers here (replicas.lua), whatever its pools.
REPLICAS_KEY = "kvguard:replicas"


def pool_keys(pool: str) -> list[str]:
    """KEYS[1..5] of the scripts for `pool`: leases, expiries, tenants, reserved, epoch
    (lib.lua's LEASES, EXPIRIES, TENANTS, RESERVED, EPOCH)."""
    tag = f"kvguard:{{{pool}}}"
    return [f"{tag}:leases", f"{tag}:expiries", f"{tag}:tenants", f"{tag}:reserved", f"{tag}:epoch"]


def promise_keys(pool: str) -> list[str]:
    """KEYS[6..15], after `pool_keys`: promises, promise lines, promise sequence, promise
    expiries, promised, promised tenants, holding, holding tenants, unreturned, promise budgets
    (lib.lua's PROMISES to BUDGETS)."""
    tag = f"kvguard:{{{pool}}}"
    names = (
        "promises",
        "promise-lines",
        "promise-seq",
        "promise-expiries",
        "promised",
        "promised-tenants",
        "holding",
        "holding-tenants",
        "unreturned",
        "promise-budgets",
    )
    return [f"{tag}:{name}" for name in names]


def end_keys(pool: str) -> list[str]:
    """KEYS[16..17], after `promise_keys`: the leases' expected ends, the pool's and each
    tenant's (lib.lua's ENDS, TENANT_ENDS)."""
    tag = f"kvguard:{{{pool}}}"
    return [f"{tag}:ends", f"{tag}:tenant-ends"]


def pod_keys(pool: str) -> list[str]:
    """KEYS[18..20], after `end_keys`: the blocks reserved on each pod, each pod's leases by
    their expected ends, each lease's pod (lib.lua's POD_RESERVED, POD_ENDS, LEASE_PODS)."""
    tag = f"kvguard:{{{pool}}}"
    return [f"{tag}:pod-reserved", f"{tag}:pod-ends", f"{tag}:lease-pods"]


def all_keys(pool: str) -> list[str]:
    """The KEYS of every script for `pool`, in the order lib.lua binds them to names."""
    return [*pool_keys(pool), *promise_keys(pool), *end_keys(pool), *pod_keys(pool)]


_OUTCOMES = {0: Outcome.ADMITTED, 1: Outcome.TENANT_QUOTA, 2: Outcome.POOL_WATERMARK}
_NONE = -1  # reserve.lua's times for "never" / "no retry" / "nothing due"
T = TypeVar("T")


def text(value: Any) -> str:
    """A string as Redis returns it (bytes, or text with decode_responses)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _seconds(ms: Any, none: T) -> float | T:
    """A script's ms as seconds, or `none` for -1."""
    value = int(ms)
    return none if value == _NONE else value / 1000


class ReserveAnswer(NamedTuple):
    """reserve.lua's answer, its slots in this order (the header of reserve.lua, which builds
    it by these names in `answer`), as Redis returns them: integers, and the epoch as bytes or
    text. Times are ms of Redis TIME, -1 for none; amounts blocks."""

    outcome: int  # 0 admitted, 1 tenant quota, 2 pool watermark
    pool_reserved: int  # after this step; promised blocks not included
    tenant_reserved: int
    epoch: Any  # the pool's epoch; '' when an impossible claim was refused without reading it
    wait: int  # until a refused claim with terms is expected to fit (-1: never)
    retry_after: int  # until the client should retry (-1: not within max wait, or no terms)
    promised: int  # 1: promised that slot; 0: the time only told
    changes_in: int  # refused: until a lease or a promise expires by itself (-1: none due)
    waiting: int  # refused, back at its promise's time: how long its blocks stay held
    held: int  # the blocks held for its tenant's retries that this claim counted
    pod: Any  # the pod an admitted claim is held on, as bytes or text; '' for none

    @classmethod
    def from_script(cls, answer: Sequence[Any]) -> ReserveAnswer:
        """The script's array, read slot by slot in the order of the fields (TypeError when
        it has another length)."""
        return cls._make(answer)

    def reservation(self, claim: Claim) -> Reservation:
        """The answer to `claim` as the Ledger protocol gives it."""
        outcome = _OUTCOMES[int(self.outcome)]
        return Reservation(
            outcome=outcome,
            pool_reserved=int(self.pool_reserved),
            tenant_reserved=int(self.tenant_reserved),
            lease=claim.lease(text(self.pod)) if outcome is Outcome.ADMITTED else None,
            wait_s=_seconds(self.wait, math.inf),
            retry_after_s=_seconds(self.retry_after, None),
            promised=bool(int(self.promised)),
            changes_in_s=_seconds(self.changes_in, math.inf),
            waiting_s=int(self.waiting) / 1000,
            holding=int(self.held),
        )


class UsageAnswer(NamedTuple):
    """usage.lua's answer, its slots in this order (the `Returns` of usage.lua's header), as
    Redis returns them: integers, amounts in blocks."""

    reserved: int  # the pool's reserved blocks; promised blocks not included
    leases: int  # how many leases the pool holds
    tenants: Sequence[Any]  # flat: tenant (bytes or text), its reserved blocks, tenant, ...
    promised: int  # blocks promised, not in `reserved`
    promises: int  # how many promises the pool holds
    holding: int  # of the promised blocks, those held for retries that came back
    pods: Sequence[Any]  # flat: pod (bytes or text), its reserved blocks, pod, ...

    @classmethod
    def from_script(cls, answer: Sequence[Any]) -> UsageAnswer:
        """As ReserveAnswer.from_script."""
        return cls._make(answer)


class ReassertAnswer(NamedTuple):
    """reassert.lua's answer, its slots in this order (the `Returns` of reassert.lua's header),
    as Redis returns them: integers, and the epoch as bytes or text."""

    added: int  # leases recorded again (the others were held, and renewed)
    reserved: int  # the pool's reserved blocks after this step
    epoch: Any  # the pool's epoch

    @classmethod
    def from_script(cls, answer: Sequence[Any]) -> ReassertAnswer:
        """As ReserveAnswer.from_script."""
        return cls._make(answer)


class LeasesAnswer(NamedTuple):
    """leases.lua's answer, its slots in this order (the `Returns` of leases.lua's header), as
    Redis returns them."""

    now: int  # ms of Redis TIME
    # flat: lease id, "<blocks>:<tenant>", expiry (ms of Redis TIME), pod ('': none), ...
    leases: Sequence[Any]

    @classmethod
    def from_script(cls, answer: Sequence[Any]) -> LeasesAnswer:
        """As ReserveAnswer.from_script."""
        return cls._make(answer)
