"""Admission as it runs: from a request body to a lease or a refusal. No gRPC, no sockets.

Steps (docs/design.md, "The request path"): parse; find the pool by model; count the prompt tokens
(the injected counter); size the request and build its claim (admission.sequence, shared with
the simulator); reserve it in the injected ledger, waiting in the pool's queue or for a
promise's blocks where that may still admit it; answer with what the protocol layer renders.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvguard.admission import decide, sequence
from kvguard.admission.calibration import Calibration, Growth
from kvguard.admission.capacity import Capacities
from kvguard.admission.policy import Identity, Policy
from kvguard.admission.promises import RateLimit
from kvguard.admission.queue import AdmissionQueue, QueueFull
from kvguard.admission.record import Decision, RequestOutcome
from kvguard.admission.sequence import Asked, DecisionSequence, Wait
from kvguard.errors import Code, Refusal, invalid
from kvguard.ledger import Claim, Lease, Ledger, LedgerUnavailable, Reservation
from kvguard.tokens.counting import PromptCounter
from kvguard.tokens.request import Kind, parse

__all__ = [
    "Admission",
    "AdmissionRequest",
    "AdmissionSettings",
    "Admitted",
]


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One guarded request to decide, as the protocol layer received it."""

    policy: Policy  # the policy it is decided by, however long it waits
    kind: Kind
    identity: Identity
    body: bytes
    decision: Decision  # what the decision finds on the way, whichever way it ends
    retry_token: str = ""  # what the client sent back of a refusal's token, if anything
    subset: frozenset[str] | None = None  # the pods the gateway allows it on (None: any)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that may go upstream: its lease, its rewritten body, and what kvguard tells of
    its decision (extproc.responses renders it as headers and dynamic metadata)."""

    pool: str
    tenant: str
    # None in shadow mode for a request that would be refused, and when the ledger is
    # unreachable and `on_unavailable` is allow.
    lease: Lease | None
    body: bytes | None  # the rewritten body; None when it goes unchanged
    prompt_tokens: int = 0
    blocks: int = 0
    reserved_output: int = 0  # output tokens per sequence its lease reserves
    max_tokens: int = 0  # the output limit vLLM applies
    would_refuse: Code | None = None  # shadow mode: the refusal it passes with
    rate_limit: RateLimit | None = None  # where its tenant stands, when the policy tells it
    # How its lease follows its request as it decodes: its blocks, when it reserved less than
    # its limit, and when it is expected to end.
    growth: Growth | None = None
    sequences: int = 1  # prompts x n: what it produces is shared by this many sequences


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    max_body_bytes: int
    lease_seconds: float
    # With `allow`, a request passes (clamped, without a lease) when the ledger is unreachable;
    # with `reject` (and `local`, whose ledger never reports itself unreachable) it gets 503.
    on_unavailable: str = "reject"


class Admission:
    """Decides requests against the current policy; the ledger and counter are injected."""

    def __init__(
        self,
        ledger: Ledger,
        counter: PromptCounter,
        capacities: Capacities,
        settings: AdmissionSettings,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        decode_rate: Callable[[str], float | None] = lambda _pool: None,
        rng: random.Random | None = None,
        queue: AdmissionQueue | None = None,
    ) -> None:
        self.ledger = ledger
        self.counter = counter
        self.capacities = capacities
        self.settings = settings
        self.clock = clock
        self.decisions = DecisionSequence(
            settings.lease_seconds, calibration, decode_rate=decode_rate, rng=rng
        )
        self.queue = queue  # where refused requests wait, in pools with a queue

    async def admit(self, request: AdmissionRequest) -> Admitted:
        """Admit (a lease is held until `ledger.release`) or raise Refusal; in shadow mode a
        request refused for capacity or availability is admitted without a lease."""
        decision, identity = request.decision, request.identity
        decision.tenant, decision.tier = identity.tenant, identity.tier_name
        decision.metered_tenant = request.policy.tenancy.metered_tenant(identity.tenant)
        try:
            admitted = await self._size_and_reserve(request)
        except Refusal as refusal:
            decision.refused(refusal.code)
            if not decide.passes_in_shadow(request.policy.shadow, refusal.code):
                raise
            decision.outcome = RequestOutcome.SHADOW_REFUSED
            return Admitted(decision.pool, identity.tenant, None, None, would_refuse=refusal.code)
        decision.outcome, decision.reason = RequestOutcome.ADMITTED, ""
        return admitted

    async def _size_and_reserve(self, request: AdmissionRequest) -> Admitted:
        raw, decision, identity = request.body, request.decision, request.identity
        if len(raw) > self.settings.max_body_bytes:
            raise Refusal(
                Code.REQUEST_TOO_LARGE,
                f"the request body is larger than {self.settings.max_body_bytes} bytes",
            )
        parsed = parse(request.kind, raw)
        pool = request.policy.by_model.get(parsed.model)
        if pool is None:
            raise Refusal(
                Code.MODEL_NOT_FOUND, f"the model {parsed.model!r} is not served here", "model"
            )
        decision.pool = pool.name
        capacity = decide.capacity_known(pool.name, self.capacities.get(pool.name))
        prompt_tokens = await self.counter.count(
            pool.tokenizer,
            parsed,
            len(raw),
            media_tokens=pool.config.media_tokens,
            max_model_len=pool.config.max_model_len,
        )
        decision.prompt_tokens = sum(prompt_tokens)
        counted = decide.Counted(
            request.kind,
            parsed.limits,
            prompt_tokens,
            parsed.min_tokens,
            parsed.n,
            parsed.runs_to_limit,
        )
        asked = Asked(
            pool.config,
            identity,
            counted,
            capacity,
            self.clock(),
            request.policy.shadow,
            raw,
            request.retry_token,
            request.subset,
        )
        plan = self.decisions.plan(asked)
        limits = plan.limits
        decision.requested_max_tokens, decision.max_tokens = limits.requested, limits.max_tokens
        # Messages' thinking budget must stay below the limit: vLLM refuses the request else.
        if parsed.thinking_budget and limits.max_tokens <= parsed.thinking_budget:
            raise invalid(
                f"thinking.budget_tokens is {parsed.thinking_budget}, not below the "
                f"{limits.max_tokens} tokens this request may generate (this tenant's cap is "
                f"{identity.tier.max_tokens_cap})",
                "thinking.budget_tokens",
            )
        decision.blocks, decision.reserved_output = plan.blocks, plan.reserved_output
        decision.reserved_from = plan.reserved_from
        claim = self.decisions.claim(asked, plan)
        body = None  # built before the reserve: nothing may fail between it and the answer
        if limits.fields != parsed.limits:
            body = json.dumps({**parsed.body, **limits.fields}, ensure_ascii=False).encode()
        tells = request.policy.tenancy.rate_limit_headers
        reservation = await self._reserve(asked, plan, claim, tells)
        rate_limit = None
        if tells and reservation is not None:
            rate_limit = decide.rate_limit(reservation, claim)
        return Admitted(
            pool.name,
            identity.tenant,
            reservation.lease if reservation is not None else None,
            body,
            decision.prompt_tokens,
            plan.blocks,
            plan.reserved_output,
            limits.max_tokens,
            rate_limit=rate_limit,
            growth=sequence.growth(asked, plan),
            sequences=len(prompt_tokens) * parsed.n,
        )

    async def _reserve(
        self, asked: Asked, plan: decide.Plan, claim: Claim, rate_limit_headers: bool
    ) -> Reservation | None:
        """The admitting reservation, or None when the ledger is unreachable and
        `on_unavailable` is allow. Raises the refusal the ledger's answer means."""
        try:
            reservation = await self._reserve_or_wait(asked, plan, claim)
        except LedgerUnavailable:
            if self.settings.on_unavailable == "allow":
                return None
            raise decide.unavailable() from None
        refused = decide.refusal(reservation, claim, rate_limit_headers=rate_limit_headers)
        if refused is not None:
            raise refused
        return reservation

    async def _reserve_or_wait(self, asked: Asked, plan: decide.Plan, claim: Claim) -> Reservation:
        """Reserve `claim`, waiting when that may still admit it: in a pool with a queue, a
        request refused for the quota or the watermark (promised nothing meanwhile), and a
        promised retry for the rest of its held blocks. A wait in vain ends with one last try
        under a lease id of its own (an attempt of its wait may still be under way): with the
        claim's terms after a queue's wait, told when with nothing held after a promise's or a
        full queue."""
        queue_s = 0.0
        if self.queue is not None:
            queue_s = sequence.queue_seconds(claim, asked.pool, asked.shadow)
        reservation = await self.ledger.reserve(sequence.first_ask(claim, queue_s))
        wait = Wait.NONE if self.queue is None else sequence.wait_after(reservation, queue_s > 0)
        if wait is Wait.NONE:
            return reservation
        assert self.queue is not None
        waiting = sequence.unpromised(claim)

        async def attempt() -> Reservation:
            # The pool's limit as it is now: its capacity or vLLM's unaccounted blocks may
            # have changed while the request waited.
            return await self.ledger.reserve(self._current(waiting, asked, plan))

        if wait is Wait.QUEUE:
            last = claim
            try:
                waited = await self.queue.wait(
                    claim.pool, claim.tenant, attempt, queue_s, asked.pool.queue.max_queued
                )
            except QueueFull:  # a promise would go before those queued
                waited, last = None, sequence.told(claim)
            if waited is not None:
                return waited
            reservation = await self.ledger.reserve(self._fresh(last, asked, plan))
            if sequence.wait_after(reservation, queues=False) is Wait.NONE:
                return reservation
        # Back at its promise's time, its blocks not all free: wait for them, first in line.
        waited = await self.queue.wait(
            claim.pool, claim.tenant, attempt, reservation.waiting_s, 0, promised=True
        )
        if waited is not None:
            return waited
        return await self.ledger.reserve(self._fresh(sequence.told(claim), asked, plan))

    def _current(self, claim: Claim, asked: Asked, plan: decide.Plan) -> Claim:
        """`claim` against its pool's limit as it is now."""
        capacity = self.capacities.get(claim.pool)
        if capacity is None:
            return claim
        limit = decide.claim_limit(
            capacity.limit(asked.pool.watermark),
            plan.calibrated,
            self.decisions.unaccounted(claim.pool),
        )
        try:  # and the pods as they are now (kept as they were when none is left)
            pods = decide.pod_limits(asked.pool, capacity, asked.subset)
        except Refusal:
            pods = claim.pods
        return replace(claim, pool_limit=limit, pods=pods)

    def _fresh(self, claim: Claim, asked: Asked, plan: decide.Plan) -> Claim:
        """`claim` as now, under a new lease id."""
        return replace(self._current(claim, asked, plan), lease_id=self.decisions.lease_ids())
