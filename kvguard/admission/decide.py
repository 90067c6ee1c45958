"""The admission decision as pure functions: no ledger, no tokenizer, no clock, no I/O.

In: the pool, the tenant's tier, the counted request and the pool's capacity. Out: a `Plan`
(the output limits and the blocks they need), then the `Claim` the ledger is asked to grant,
or a `Refusal`. The ledger's answer to a claim maps back to a refusal here too, so `serve`
(`admit.Admission`) and `simulate` (`sim.model.gate.PolicyGate`) refuse with the same codes and
messages; admission.sequence holds the steps they both take with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvguard.admission.calibration import Estimate, ends_in_s
from kvguard.admission.capacity import PodCapacity, PoolCapacity, pool_limit
from kvguard.admission.promises import RETRY_TOKEN_HEADER, RateLimit
from kvguard.admission.record import ReservedFrom
from kvguard.admission.sizing import Limits, blocks_needed, clamp
from kvguard.config.schema import PoolConfig, TierConfig
from kvguard.errors import RETRY_AFTER_S, Code, Refusal
from kvguard.ledger import Claim, Outcome, PodLimit, Reservation, Terms
from kvguard.tokens.request import Kind

# Refusals that shadow mode lets pass: capacity and availability, never malformed input.
SHADOWABLE = frozenset(
    {
        Code.TENANT_BLOCK_QUOTA_EXCEEDED,
        Code.KV_CACHE_WATERMARK_EXCEEDED,
        Code.REQUEST_EXCEEDS_CAPACITY,
        Code.CAPACITY_UNKNOWN,
        Code.LEDGER_UNAVAILABLE,
    }
)


@dataclass(frozen=True, slots=True)
class Counted:
    """What the decision reads of a parsed request, with its prompts counted."""

    kind: Kind
    limits: dict[str, int]  # the limit fields the client sent with a value
    prompt_tokens: list[int]  # one count per prompt, never empty
    min_tokens: int = 0
    n: int = 1  # sequences per prompt
    runs_to_limit: bool = False  # ignore_eos or beam search: it reserves the whole limit


@dataclass(frozen=True, slots=True)
class Plan:
    """A request sized for one pool and tenant: what it may generate and what that holds."""

    pool: str
    tenant: str
    limits: Limits
    blocks: int  # KV blocks of the pool's block size, for every prompt and sequence
    quota: int  # most blocks the tenant may hold in the pool
    pool_limit: int  # most blocks the pool may hold: capacity less the watermark
    reserved_output: int  # output tokens each sequence reserves: the limit, or less
    reserved_from: ReservedFrom = ReservedFrom.WORST_CASE  # what sized reserved_output
    worst_blocks: int = 0  # the blocks of the whole limit, what a lease may grow to
    estimate: Estimate | None = None  # the estimate it was sized with, to size it again
    # The pods it may be reserved on, in order of preference; (): the pool's sum alone.
    pods: tuple[PodLimit, ...] = ()

    @property
    def calibrated(self) -> bool:
        """It reserves less than its whole limit: its claim leaves room for vLLM's
        unaccounted blocks."""
        return self.reserved_from is not ReservedFrom.WORST_CASE


def capacity_known(pool: str, capacity: PoolCapacity | None) -> PoolCapacity:
    """The pool's capacity; refused with 503 while it is not known."""
    if capacity is None:
        raise Refusal(
            Code.CAPACITY_UNKNOWN,
            f"the KV-cache capacity of pool {pool!r} is not known yet",
            retry_after_s=RETRY_AFTER_S,
        )
    return capacity


def pod_limits(
    pool: PoolConfig, capacity: PoolCapacity, subset: frozenset[str] | None = None
) -> tuple[PodLimit, ...]:
    """The pods a request of `pool` may be reserved on, each with its limit, the shorter vLLM
    queue first (then by address): () when kvguard does not pick (`routing: envoy`). Raises
    Refusal (503) when no pod answered its last reading, and when `subset` (the gateway's
    hint: the only pods it may go to) names none of them."""
    if not pool.picks:
        return ()
    pods = capacity.pods
    if not pods:
        raise Refusal(
            Code.CAPACITY_UNKNOWN,
            f"no vLLM server of pool {pool.name!r} answered its last reading",
            retry_after_s=RETRY_AFTER_S,
        )
    if subset is not None:
        pods = tuple(p for p in pods if p.address in subset)
        if not pods:
            raise Refusal(
                Code.NO_ENDPOINT_IN_SUBSET,
                f"none of the endpoints the gateway allows ({', '.join(sorted(subset))}) is a "
                f"pod of pool {pool.name!r} that kvguard reads",
                retry_after_s=RETRY_AFTER_S,
            )
    return _limits(pods, pool.watermark)


# The candidates of the capacities seen last, by the identity of their pods: a capacity is
# published once per reading and decided on many times (64 pods: 88 µs a decision when built
# each time, 50 µs kept).
_LIMITS: dict[tuple[int, float], tuple[tuple[PodCapacity, ...], tuple[PodLimit, ...]]] = {}


def _limits(pods: tuple[PodCapacity, ...], watermark: float) -> tuple[PodLimit, ...]:
    """Each pod with its limit at `watermark`, the shorter vLLM queue first (then in the
    order given: by address)."""
    key = (id(pods), watermark)
    known = _LIMITS.get(key)
    if known is not None and known[0] is pods:
        return known[1]
    ordered = sorted(pods, key=lambda p: p.waiting or 0)  # stable
    limits = tuple(PodLimit(p.address, pool_limit(p.blocks, watermark)) for p in ordered)
    if len(_LIMITS) >= 64:  # a few pools' capacities of now; older ones are not decided on
        _LIMITS.clear()
    _LIMITS[key] = (pods, limits)
    return limits


def plan(
    request: Counted,
    pool: PoolConfig,
    tenant: str,
    tier: TierConfig,
    capacity: PoolCapacity,
    estimate: Estimate | None = None,
    subset: frozenset[str] | None = None,
) -> Plan:
    """Size `request` for `tenant` of `tier` in `pool`: clamp or inject the output limit and
    turn prompt + reserved output into blocks. Raises Refusal when the prompt leaves no room for
    output or `min_tokens` cannot be honoured, and when the gateway's `subset` leaves no pod.

    Each sequence reserves its whole output limit (the worst case) unless an `estimate` is
    given and the request may stop early (no ignore_eos, no beam search): then what the
    estimate reserves under that limit, at least `min_tokens` (and one token), at most the
    limit."""
    limits = clamp(
        request.kind,
        request.limits,
        tier,
        pool.max_model_len,
        max(request.prompt_tokens),
        request.min_tokens,
    )
    reserved, reserved_from = limits.max_tokens, ReservedFrom.WORST_CASE
    if estimate is not None and not request.runs_to_limit:
        # Never above the limit: an echo-only completion's limit is 0.
        at_least = max(1, request.min_tokens, estimate.reserve(limits.max_tokens))
        reserved = min(limits.max_tokens, at_least)
        if reserved < limits.max_tokens:  # else it is the worst case, whatever sized it
            reserved_from = estimate.source
    blocks = blocks_needed(request.prompt_tokens, reserved, request.n, capacity.block_size)
    worst = blocks_needed(request.prompt_tokens, limits.max_tokens, request.n, capacity.block_size)
    pool_limit = capacity.limit(pool.watermark)
    return Plan(
        pool.name,
        tenant,
        limits,
        blocks,
        tier.max_blocks,
        pool_limit,
        reserved,
        reserved_from,
        worst,
        estimate,
        pod_limits(pool, capacity, subset),
    )


def claim(
    plan: Plan,
    lease_id: str,
    lease_seconds: float,
    unaccounted: int = 0,
    *,
    retry_key: str = "",
    terms: Terms | None = None,
    decode_rate: float | None = None,
) -> Claim:
    """The claim to reserve for `plan`. Raises Refusal (400) when the whole limit needs more
    blocks than the tenant's quota or the pool's limit: no ledger state could ever grant it (a
    calibrated lease may grow to the whole limit). `unaccounted`: blocks vLLM holds beyond the
    ledger's count, taken off the pool's limit for a calibrated plan. With `terms` and a
    `retry_key`, a refusal is promised a slot (kvguard.ledger). Its lease is expected to end
    when its output limit is produced at `decode_rate` (tokens per second per sequence)."""
    need = max(plan.blocks, plan.worst_blocks)
    largest = max((pod.limit for pod in plan.pods), default=plan.pool_limit)
    if need > plan.quota or need > plan.pool_limit or need > largest:
        admissible = f"the pool's admissible capacity ({plan.pool_limit})"
        if largest < plan.pool_limit:
            admissible = f"its largest pod's admissible capacity ({largest})"
        raise Refusal(
            Code.REQUEST_EXCEEDS_CAPACITY,
            f"the request needs {need} KV-cache blocks, more than this tenant's quota "
            f"({plan.quota}) or {admissible} allows; lower max_tokens, n or the prompt length",
        )
    limit = claim_limit(plan.pool_limit, plan.calibrated, unaccounted)
    return Claim(
        lease_id,
        plan.pool,
        plan.tenant,
        plan.blocks,
        limit,
        plan.quota,
        lease_seconds,
        retry_key,
        terms,
        ends_in_s(plan.limits.max_tokens, decode_rate),
        plan.pods,
    )


def claim_limit(pool_limit: int, calibrated: bool, unaccounted: int) -> int:
    """The pool limit a claim is checked against: a calibrated one's leaves room for what
    vLLM holds beyond the ledger's count (`unaccounted`); a worst-case one's needs none."""
    return max(0, pool_limit - unaccounted) if calibrated else pool_limit


def rate_limit(reservation: Reservation, claim: Claim) -> RateLimit:
    """Where the claim's tenant stands after the ledger's answer: its quota, the blocks it
    could reserve now (within its quota and the pool's limit, beside the blocks held for its
    own promised retries), and for a refusal the seconds until its blocks are expected free."""
    remaining = min(
        claim.tenant_quota - reservation.tenant_reserved - reservation.holding,
        claim.pool_limit - reservation.pool_reserved - reservation.holding,
    )
    return RateLimit(claim.tenant_quota, remaining, reservation.wait_s)


def refusal(
    reservation: Reservation, claim: Claim, *, rate_limit_headers: bool = False
) -> Refusal | None:
    """The refusal the ledger's answer to `claim` means; None when it admitted the claim.

    With terms, retry-after is when the ledger expects room: a promised slot, with the token
    that names its retry, or a time told with nothing held; past their `max_wait_s` the
    refusal says not to retry. Without terms, retry-after is RETRY_AFTER_S, a hint."""
    if reservation.outcome is Outcome.TENANT_QUOTA:
        refused = Refusal(
            Code.TENANT_BLOCK_QUOTA_EXCEEDED,
            f"tenant quota of {claim.tenant_quota} KV-cache blocks in pool {claim.pool!r} is in "
            "use by this tenant's requests in flight",
        )
    elif reservation.outcome is Outcome.POOL_WATERMARK:
        refused = Refusal(
            Code.KV_CACHE_WATERMARK_EXCEEDED, f"the KV cache of pool {claim.pool!r} is full"
        )
    else:
        return None
    standing = rate_limit(reservation, claim)
    if claim.terms is None:  # nothing measured says when the blocks free
        standing = replace(standing, reset_s=math.inf)
    headers = standing.headers() if rate_limit_headers else {}
    if claim.terms is None:
        message = f"{refused.message}; retry later"
        return replace(refused, message=message, retry_after_s=RETRY_AFTER_S, headers=headers)
    if reservation.retry_after_s is None:
        message = (
            f"{refused.message}, and no room for this request is expected within "
            f"{claim.terms.max_wait_s:g} s: do not retry soon"
        )
        return replace(refused, message=message, should_retry=False, headers=headers)
    if reservation.promised:
        headers[RETRY_TOKEN_HEADER] = claim.retry_key
        message = (
            f"{refused.message}; this request's retry at the time retry-after-ms gives goes "
            "before this tenant's later requests"
        )
    else:
        message = f"{refused.message}; room is expected at the time retry-after-ms gives"
    return replace(
        refused, message=message, retry_after_s=reservation.retry_after_s, headers=headers
    )


def unavailable() -> Refusal:
    """The refusal when the ledger cannot be reached and `on_unavailable` is reject."""
    return Refusal(
        Code.LEDGER_UNAVAILABLE,
        "the admission ledger cannot be reached; retry later",
        retry_after_s=RETRY_AFTER_S,
    )


def passes_in_shadow(shadow: bool, code: Code) -> bool:
    """Whether a request refused with `code` goes upstream anyway (marked as would-refuse)."""
    return shadow and code in SHADOWABLE
