"""Ledgers: where reservations of KV-cache blocks live.

A backend is picked from the URL scheme (`kvguard.ledger.url.from_url`): `memory://` (one
process, `memory.MemoryLedger`, its promises in `memory_promises`) or `redis://`/`rediss://`
(shared by every replica, `redis_ledger.RedisLedger` wrapped in `resilient.ResilientLedger`).
The caller wires a ledger through the `Ledger` protocol alone: its callbacks are given to
`from_url`, and `start`, `subscribe` and `close` are no-ops where they do not apply. Every
backend makes the same promise: `reserve` checks the pool limit and the tenant quota and
records the lease in one atomic step, reclaiming expired leases on the way; `release` and
`reassert` are idempotent.
All amounts are KV-cache blocks of the pool's block size. A lease's counted blocks may grow
after it was admitted (a running request's reservation raised as it decodes): `reassert` with
more blocks than the ledger counts raises them, without any check, and never lowers them;
`release` gives back what the ledger counts, grown or not.

A claim may name the pods it may run on (`Claim.pods`, each with its own limit: vLLM preempts
per pod, so each pod bounds what is reserved on it). Then it is admitted only on a pod where it
fits, beside its quota and the pool's limit, and the ledger picks that pod in the same atomic
step: of the pods where it fits, the one left with the most free blocks (the earlier one on a
tie). Its lease is held on that pod (`Lease.pod`) until it ends; `reassert` with another pod
moves it there. A claim without pods is counted in the pool alone, as a pool of one pod.

A lease is expected to end when its claim (or its latest `reassert`) says: `ends_in_s`, its
remaining output at the pool's inter-token time; without one, at its expiry.

A refused claim that carries `Terms` and a `retry_key` may be promised a slot (docs/design.md,
"Retry-After as a promise"): the time when enough leases are expected to end for it to fit
beside the blocks promised to its own tenant before it (the tenant's leases for its quota, the
pool's for the pool's limit). Tenant isolation comes first: another tenant's claims never count
a promise, held or not. Nothing is held for a promise until its client comes back: a retry back
at or after its time that does not fit yet holds its blocks until the slot's grace ends, and
they count against its own tenant's later claims only (its quota, and the pool as that tenant
sees it); the retry takes them once they fit. A tenant has at most PROMISE_BUDGET promises
open, doubled each time a promised client comes back and halved each time one does not; past
it, or at 0 until `max_wait_s` after that, a refusal is told the time, with nothing held.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

# Promises a tenant may have open until its clients have shown whether they come back; each
# that comes back doubles it (up to the most), each that does not halves it.
PROMISE_BUDGET = 4
MAX_PROMISE_BUDGET = 1024


@dataclass(frozen=True, slots=True)
class Terms:
    """How a refused claim is promised a slot: when the leases expected to end first (in order
    of their expected ends) have freed what it needs beyond its quota or the pool's limit, its
    tenant's promises before it included."""

    max_wait_s: float  # no slot later than this: the client is told not to retry
    jitter_s: float  # added to the slot's time, the time the client is told to retry at
    grace_s: float  # how long past that time a retry that came back may wait for its blocks


@dataclass(frozen=True, slots=True)
class PodLimit:
    """A pod a claim may be reserved on, and the most blocks it may hold reserved (its
    capacity minus the watermark)."""

    address: str  # host:port, the endpoint picker's name for the pod
    limit: int


@dataclass(frozen=True, slots=True)
class Claim:
    """What one request asks for. All amounts are KV blocks of the pool's block size."""

    lease_id: str
    pool: str
    tenant: str
    blocks: int
    pool_limit: int  # most blocks the pool may hold reserved: capacity minus the watermark
    tenant_quota: int  # most blocks this tenant may hold reserved in this pool
    lease_seconds: float
    # The request as its retry will be recognised (its promise's key); "" makes no promise.
    retry_key: str = ""
    terms: Terms | None = None  # None: a refusal says nothing of when to retry
    # Seconds until the lease is expected to end: its output limit at the pool's inter-token
    # time. None: at its expiry.
    ends_in_s: float | None = None
    # The pods it may be reserved on, in order of preference (the pick's ties); (): the pool
    # alone counts it.
    pods: tuple[PodLimit, ...] = ()

    def lease(self, pod: str = "") -> Lease:
        """The lease this claim takes when admitted (on `pod`, when it names pods)."""
        return Lease(self.lease_id, self.pool, self.tenant, self.blocks, pod=pod)


class Outcome(enum.Enum):
    ADMITTED = "admitted"
    TENANT_QUOTA = "tenant_quota"
    POOL_WATERMARK = "pool_watermark"


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    pool: str
    tenant: str
    blocks: int
    # As sent to `reassert`: seconds from then until it is expected to end (its remaining
    # output at the pool's inter-token time); None keeps what the ledger has.
    ends_in_s: float | None = None
    pod: str = ""  # the pod it is held on; "": the pool alone (sent to reassert: keep its own)


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: Outcome
    pool_reserved: int  # blocks reserved in the pool after this step
    tenant_reserved: int  # blocks reserved by the tenant after this step
    lease: Lease | None = None
    # Refused with Terms: seconds until the claim is expected to fit (inf when the leases'
    # expected ends cannot free enough), the seconds until its retry (None: not within
    # max_wait_s), and whether it is promised that slot, or the time is only told.
    wait_s: float = 0.0
    retry_after_s: float | None = None
    promised: bool = False
    # Refused: seconds until a lease or a promise expires by itself, a moment when room may
    # appear without a release; inf when nothing is due.
    changes_in_s: float = math.inf
    # Refused, back at its promise's time with its blocks not all free yet: how long they stay
    # held for it (the caller may wait that long for them); 0 otherwise.
    waiting_s: float = 0.0
    # Blocks held for its tenant's promised retries (back and waiting) that this claim counted,
    # in its quota and in the pool alike; another tenant's are never counted.
    holding: int = 0


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """An open lease as the ledger holds it (for operators)."""

    lease: Lease
    expires_in_s: float  # seconds until it expires unless renewed


@dataclass(frozen=True, slots=True)
class PoolUsage:
    reserved: int
    leases: int
    tenants: dict[str, int] = field(default_factory=dict)
    promised: int = 0  # blocks promised to retries (not in `reserved`)
    promises: int = 0
    holding: int = 0  # of the promised blocks, those held for retries that came back
    pods: dict[str, int] = field(default_factory=dict)  # blocks reserved on each pod (not 0)


class LedgerUnavailable(Exception):
    """The ledger cannot be reached; the caller applies `on_unavailable`."""


class Ledger(Protocol):
    async def reserve(self, claim: Claim) -> Reservation:
        """Admit `claim` (record its lease, expiring after `claim.lease_seconds` unless renewed)
        or refuse it, in one atomic step that first refuses an impossible claim and reclaims
        expired leases and promises. Raises LedgerUnavailable when the ledger cannot be
        reached.

        A claim fits when its tenant's reserved blocks, the blocks held for its tenant's
        retries that came back and its own stay within its quota, and the pool's reserved
        blocks with those same held ones within its limit: another tenant's promises never
        count. A claim whose `retry_key` (and tenant) holds a promise counts only the held
        promises of its tenant made before its own, and takes its promise when admitted. A
        refused claim with `terms` is told when the leases expected to end first free what it
        needs beyond its quota and the pool's limit, counting every promise its tenant has
        before it; with a `retry_key` it is promised that slot when it is within `max_wait_s`
        and its tenant's budget of open promises allows. A claim holding a promise whose time
        has not come keeps it; one whose time has come that does not fit yet starts holding
        its blocks and is told how long they stay held for it (`waiting_s`).

        A claim with `pods` fits only on one of them whose reserved blocks and its own stay
        within that pod's limit (held promises are the pool's and the tenant's, not a pod's);
        the admitted lease is on the pod left with the most free blocks, the earliest on a
        tie. A claim larger than every pod's limit is impossible. A refused one is told, as
        well, when the first of its pods is expected to free enough."""

    async def release(self, lease: Lease) -> None:
        """Give back the blocks the ledger counts for the lease (grown ones included).
        Idempotent: releasing an unknown or already released lease does nothing."""

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend a live lease, its counted blocks unchanged; False when it is gone (expired
        and reclaimed, or released)."""

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """Hold each lease for `lease_seconds` more: renew it, or record it again with
        `lease.blocks` and without any check when the ledger lost it (its request is running,
        so the ledger must count it). A lease with `ends_in_s` is expected to end that many
        seconds from now; one without keeps its expected end (recorded again: its expiry).

        A held lease whose `lease.blocks` is more than the blocks counted for it grows to
        `lease.blocks`: the pool's and the tenant's reserved blocks rise by the difference,
        always granted (no limit or quota check; it may take the pool past its limit, and new
        reservations are then refused until leases end). Counted blocks never shrink: a
        smaller (stale) copy only renews. A held lease sent with a `pod` other than its own
        is moved there, its blocks with it (its request was served there). Idempotent.
        Returns how many leases were recorded again (a lease that grew was held, so it does
        not count)."""

    async def usage(self, pool: str) -> PoolUsage:
        """Blocks and leases held in `pool` (expired leases reclaimed first), per tenant."""

    async def leases(self, pool: str) -> list[LeaseInfo]:
        """The pool's open leases (expired ones reclaimed first), for operators."""

    # -- lifecycle and subscription: what the process wires, whichever the backend ------------

    @property
    def shared(self) -> bool:
        """Whether other kvguard processes share this ledger (Redis: they count as replicas);
        False for the memory ledger, which is this process's alone."""

    async def start(self) -> None:
        """Get ready before the first request: a shared ledger reaches its store (registering
        its scripts) and starts watching it; nothing for the memory ledger. The Redis ledger as
        kvguard runs it (`ResilientLedger`) reports an unreachable Redis through its
        `on_reachability` instead of raising; a bare `RedisLedger` raises LedgerUnavailable."""

    def subscribe(self, pools: Iterable[str]) -> None:
        """From now on, call the `on_freed(pool)` given at construction whenever blocks of one
        of `pools` are freed, by any process sharing the ledger (replacing the pools given
        before; needs a running event loop). A no-op for the memory ledger: all its releases
        are this process's own, which the process hears of itself."""

    async def close(self) -> None:
        """Stop what `start` and `subscribe` started and let go of the store (no-op for the
        memory ledger)."""
