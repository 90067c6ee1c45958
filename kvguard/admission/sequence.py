"""The decision's steps after counting, shared by serve (admit.Admission) and simulate
(sim.model.gate.PolicyGate): size the request, build its claim, ask the ledger, read its answer.

A request is `Asked` once its prompts are counted. `DecisionSequence.plan` sizes it for its
tier (the calibrated estimate, or the simulator's oracle); `DecisionSequence.claim` builds what
the ledger is asked (vLLM's unaccounted blocks off a calibrated limit, the promise's terms and
the retry key, the expected end); `first_ask` is what is reserved first, and `wait_after` reads
the ledger's answer: answered, or waiting in the pool's queue or for a promise's held blocks.
Serve awaits its waits (admit.py); the simulator replays them in simulated time.
"""

from __future__ import annotations

import enum
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvguard.admission import decide
from kvguard.admission.calibration import Calibration, Estimate, Growth
from kvguard.admission.capacity import PoolCapacity
from kvguard.admission.policy import Identity
from kvguard.admission.promises import retry_key, terms
from kvguard.config.schema import PoolConfig
from kvguard.ledger import Claim, Outcome, Reservation


class Wait(enum.Enum):
    """What a request does after the ledger's answer."""

    NONE = "none"  # answered: admitted, or refused
    QUEUE = "queue"  # refused for the quota or the watermark: it waits in its pool's queue
    PROMISE = "promise"  # back at its promise's time, its held blocks not all free: it waits


@dataclass(frozen=True, slots=True)
class Asked:
    """One counted request, as the decision's steps read it."""

    pool: PoolConfig
    identity: Identity
    counted: decide.Counted
    capacity: PoolCapacity
    at: float  # when it is decided: the estimate's time, and its lease's growth starts then
    shadow: bool  # shadow mode: refusals pass and nothing is promised
    # What names its retry, when a refusal is promised a slot (promises.retry_key): the body
    # and the token the client sent back in serve, the request's id in the simulator.
    retry_source: bytes
    retry_token: str = ""
    subset: frozenset[str] | None = None  # the pods the gateway allows (None: any)


def _new_lease_id() -> str:
    return uuid.uuid4().hex


class DecisionSequence:
    """Plans and claims with what this process knows now: the calibration's estimates and
    vLLM's unaccounted blocks, the pools' decode rates, the promises' jitter."""

    def __init__(
        self,
        lease_seconds: float,
        calibration: Calibration | None = None,
        *,
        decode_rate: Callable[[str], float | None] = lambda _pool: None,
        rng: random.Random | None = None,
        lease_ids: Callable[[], str] = _new_lease_id,
    ) -> None:
        self.lease_seconds = lease_seconds
        # Learnt output lengths, for pools and tiers in calibrated mode; None: worst case always.
        self.calibration = calibration
        # Tokens a second per sequence a pool decodes (None: unknown): when a lease is expected
        # to end, what a refusal's time is told from.
        self.decode_rate = decode_rate
        self.rng = rng or random.Random()  # the jitter of promised retry times
        self.lease_ids = lease_ids

    def plan(self, asked: Asked, estimate: Estimate | None = None) -> decide.Plan:
        """Size `asked` (decide.plan) with `estimate` when one is given (the simulator's
        oracle), else the calibration's for its tier and tenant. Raises Refusal."""
        identity = asked.identity
        if estimate is None and self.calibration is not None:
            estimate = self.calibration.estimate(
                asked.pool, identity.tier_name, identity.tier, identity.tenant, asked.at
            )
        return decide.plan(
            asked.counted,
            asked.pool,
            identity.tenant,
            identity.tier,
            asked.capacity,
            estimate,
            asked.subset,
        )

    def claim(self, asked: Asked, plan: decide.Plan) -> Claim:
        """The claim to reserve for `plan` under a new lease id (decide.claim: raises Refusal
        when it could never fit). Shadow mode promises nothing: a promise would hold blocks."""
        promise = None if asked.shadow else terms(asked.pool, self.rng)
        key = ""
        if promise is not None:
            key = retry_key(asked.identity.tenant, asked.retry_source, asked.retry_token)
        return decide.claim(
            plan,
            self.lease_ids(),
            self.lease_seconds,
            self.unaccounted(plan.pool),
            retry_key=key,
            terms=promise,
            decode_rate=self.decode_rate(plan.pool),
        )

    def unaccounted(self, pool: str) -> int:
        """Blocks vLLM holds in `pool` beyond the ledger's count (0 without a calibration): a
        calibrated claim fits beside them too."""
        return self.calibration.engine.unaccounted(pool) if self.calibration is not None else 0


def queue_seconds(claim: Claim, pool: PoolConfig, shadow: bool) -> float:
    """How long `claim` may wait in its pool's queue when the quota or the watermark refuses it;
    0 when it does not queue (shadow mode, or more blocks than its limits could ever grant)."""
    possible = claim.blocks <= claim.pool_limit and claim.blocks <= claim.tenant_quota
    return 0.0 if shadow or not possible else pool.queue.max_wait_seconds


def first_ask(claim: Claim, queue_s: float) -> Claim:
    """What is reserved first: a claim that may queue is promised nothing meanwhile."""
    return unpromised(claim) if queue_s > 0 else claim


def unpromised(claim: Claim) -> Claim:
    """`claim` as it waits: refused, it is promised nothing."""
    return replace(claim, terms=None)


def told(claim: Claim) -> Claim:
    """`claim` as its last try after a wait: refused, it is told when, with nothing held."""
    return replace(claim, retry_key="")


def wait_after(reservation: Reservation, queues: bool) -> Wait:
    """What the ledger's answer leaves a request to do; `queues`: it may wait in the queue."""
    if reservation.outcome is Outcome.ADMITTED:
        return Wait.NONE
    if reservation.waiting_s > 0:
        return Wait.PROMISE
    return Wait.QUEUE if queues else Wait.NONE


def growth(asked: Asked, plan: decide.Plan) -> Growth:
    """How the lease of `plan` follows its request as it decodes."""
    counted = asked.counted
    return Growth(
        plan.pool,
        tuple(counted.prompt_tokens),
        counted.n,
        asked.capacity.block_size,
        plan.limits.max_tokens,
        plan.reserved_output,
        asked.at,
        plan.estimate,
    )
