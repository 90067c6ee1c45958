"""Admission as it runs: from a request body to a lease or a refusal. No gRPC, no sockets.

Steps (docs/design.md, "The request path"): parse; find the pool by model; count the prompt tokens
(the injected counter); size the request and build its claim (`decide`, pure); reserve it in
the injected ledger; build the answer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.admission import decide
from kvguard.admission.calibration import Calibration, Growth
from kvguard.admission.capacity import Capacities
from kvguard.admission.policy import Identity, Policy
from kvguard.admission.promises import retry_key, terms
from kvguard.admission.queue import AdmissionQueue, QueueFull
from kvguard.admission.record import Decision
from kvguard.config.schema import Queue as QueueSettings
from kvguard.errors import Code, Refusal, invalid
from kvguard.ledger import Claim, Lease, Ledger, LedgerUnavailable, Outcome, Reservation
from kvguard.tokens.counting import PromptCounter
from kvguard.tokens.request import Kind, parse

__all__ = [
    "Admission",
    "AdmissionSettings",
    "Admitted",
]


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that may go upstream, with what must change on its way."""

    pool: str
    lease: Lease | None  # None only in shadow mode, for a request that would be refused
    body: bytes | None  # the rewritten body; None when it goes unchanged
    headers: dict[str, str]  # headers to set on the upstream request
    prompt_tokens: int
    blocks: int
    would_refuse: Code | None = None
    # The decision as ext_proc dynamic metadata: envoy.yaml's access log reads it (kvguard's
    # word, not headers a client could send) and its route turns `max_tokens` into
    # x-kvguard-max-tokens.
    metadata: dict[str, str] = field(default_factory=dict)
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
        # Learnt output lengths, for pools and tiers in calibrated mode; None: worst case always.
        self.calibration = calibration
        self.clock = clock
        # Tokens a second per sequence a pool decodes (None: unknown): when a lease is
        # expected to end, what a refusal's time is told from.
        self.decode_rate = decode_rate
        self.rng = rng or random.Random()  # the jitter of promised retry times
        self.queue = queue  # where refused requests wait, in pools with a queue

    async def decide(
        self,
        policy: Policy,
        kind: Kind,
        identity: Identity,
        raw: bytes,
        decision: Decision,
        retry_token: str = "",
    ) -> Admitted:
        """Admit (a lease is held until `ledger.release`) or raise Refusal; `decision` records
        what was found on the way, whichever way it ends. `retry_token`: what the client sent
        back of a refusal's token, if anything."""
        decision.tenant, decision.tier = identity.tenant, identity.tier_name
        decision.metered_tenant = policy.tenancy.metered_tenant(identity.tenant)
        try:
            admitted = await self._decide(policy, kind, identity, raw, decision, retry_token)
        except Refusal as refusal:
            decision.refused(refusal.code)
            if not decide.passes_in_shadow(policy.shadow, refusal.code):
                raise
            decision.outcome = "shadow_refused"
            would_refuse = {"x-kvguard-would-refuse": refusal.code.value}
            metadata = {"would_refuse": refusal.code.value}
            if identity.tenant:
                metadata["tenant"] = identity.tenant
            return Admitted(
                decision.pool, None, None, would_refuse, 0, 0, refusal.code, metadata=metadata
            )
        decision.outcome, decision.reason = "admitted", ""
        return admitted

    async def _decide(
        self,
        policy: Policy,
        kind: Kind,
        identity: Identity,
        raw: bytes,
        decision: Decision,
        retry_token: str,
    ) -> Admitted:
        if len(raw) > self.settings.max_body_bytes:
            raise Refusal(
                Code.REQUEST_TOO_LARGE,
                f"the request body is larger than {self.settings.max_body_bytes} bytes",
            )
        request = parse(kind, raw)
        pool = policy.by_model.get(request.model)
        if pool is None:
            raise Refusal(
                Code.MODEL_NOT_FOUND, f"the model {request.model!r} is not served here", "model"
            )
        decision.pool = pool.name
        capacity = decide.capacity_known(pool.name, self.capacities.get(pool.name))
        prompt_tokens = await self.counter.count(
            pool.tokenizer,
            request,
            len(raw),
            media_tokens=pool.config.media_tokens,
            max_model_len=pool.config.max_model_len,
        )
        prompt_total = decision.prompt_tokens = sum(prompt_tokens)
        counted = decide.Counted(
            kind,
            request.limits,
            prompt_tokens,
            request.min_tokens,
            request.n,
            request.runs_to_limit,
        )
        now = self.clock()
        estimate = None
        if self.calibration is not None:
            estimate = self.calibration.estimate(
                pool.config, identity.tier_name, identity.tier, identity.tenant, now
            )
        plan = decide.plan(counted, pool.config, identity.tenant, identity.tier, capacity, estimate)
        limits = plan.limits
        decision.requested_max_tokens, decision.max_tokens = limits.requested, limits.max_tokens
        # Messages' thinking budget must stay below the limit: vLLM refuses the request else.
        if request.thinking_budget and limits.max_tokens <= request.thinking_budget:
            raise invalid(
                f"thinking.budget_tokens is {request.thinking_budget}, not below the "
                f"{limits.max_tokens} tokens this request may generate (this tenant's cap is "
                f"{identity.tier.max_tokens_cap})",
                "thinking.budget_tokens",
            )
        decision.blocks, decision.reserved_output = plan.blocks, plan.reserved_output
        decision.reserved_from = plan.reserved_from
        # A calibrated claim fits beside what vLLM holds beyond the ledger's count, too.
        unaccounted = 0
        if self.calibration is not None:
            unaccounted = self.calibration.engine.unaccounted(pool.name)
        # Shadow mode promises nothing: its refusals pass, and a promise would hold blocks.
        promise = None if policy.shadow else terms(pool.config, self.rng)
        key = retry_key(identity.tenant, raw, retry_token) if promise is not None else ""
        claim = decide.claim(
            plan,
            uuid.uuid4().hex,
            self.settings.lease_seconds,
            unaccounted,
            retry_key=key,
            terms=promise,
            decode_rate=self.decode_rate(pool.name),
        )
        body = None  # built before the reserve: nothing may fail between it and the answer
        if limits.fields != request.limits:
            body = json.dumps({**request.body, **limits.fields}, ensure_ascii=False).encode()
        rate_limit_headers = policy.tenancy.rate_limit_headers
        queue = None if policy.shadow else pool.config.queue
        reservation = await self._reserve(
            claim,
            rate_limit_headers,
            queue,
            pool.config.watermark,
            plan.reserved_from != "worst_case",
        )
        lease = reservation.lease if reservation is not None else None
        metadata = {
            "blocks": str(plan.blocks),
            "prompt_tokens": str(prompt_total),
            "reserved_output": str(plan.reserved_output),
        }
        headers = {
            "x-kvguard-blocks": metadata["blocks"],
            "x-kvguard-prompt-tokens": metadata["prompt_tokens"],
            "x-kvguard-reserved-output": metadata["reserved_output"],
        }
        if lease is not None:
            headers["x-kvguard-lease"] = metadata["lease"] = lease.lease_id
        if identity.tenant:
            metadata["tenant"] = identity.tenant
        if policy.tenancy.expose_limit_header:
            metadata["max_tokens"] = str(limits.max_tokens)
        if rate_limit_headers and reservation is not None:
            headers_out = decide.rate_limit(reservation, claim).headers()
            metadata["ratelimit"] = headers_out["ratelimit"]
            metadata["ratelimit_policy"] = headers_out["ratelimit-policy"]
        growth = Growth(
            pool.name,
            tuple(prompt_tokens),
            request.n,
            capacity.block_size,
            limits.max_tokens,
            plan.reserved_output,
            now,
            estimate,
        )
        return Admitted(
            pool.name,
            lease,
            body,
            headers,
            prompt_total,
            plan.blocks,
            metadata=metadata,
            growth=growth,
            sequences=len(prompt_tokens) * request.n,
        )

    async def _reserve(
        self,
        claim: Claim,
        rate_limit_headers: bool,
        queue: QueueSettings | None = None,
        watermark: float = 0.0,
        calibrated: bool = False,
    ) -> Reservation | None:
        """The admitting reservation, or None when the ledger is unreachable and
        `on_unavailable` is allow. Raises the refusal the ledger's answer means."""
        try:
            reservation = await self._reserve_or_wait(claim, queue, watermark, calibrated)
        except LedgerUnavailable:
            if self.settings.on_unavailable == "allow":
                return None
            raise decide.unavailable() from None
        refused = decide.refusal(reservation, claim, rate_limit_headers=rate_limit_headers)
        if refused is not None:
            raise refused
        return reservation

    async def _reserve_or_wait(
        self, claim: Claim, queue: QueueSettings | None, watermark: float, calibrated: bool
    ) -> Reservation:
        """Reserve `claim`, waiting when that may still admit it: a promised retry for the
        rest of its held blocks, and in a pool with a queue, a request refused for the quota
        or the watermark (promised nothing meanwhile). The answer of a claim that waited in
        vain comes from one last try under a lease id of its own (an attempt of its wait may
        still be under way): with the claim's terms after a queue's wait, told when with
        nothing held after a promise's or a full queue."""
        possible = claim.blocks <= claim.pool_limit and claim.blocks <= claim.tenant_quota
        queued = (
            queue is not None and queue.max_wait_seconds > 0 and possible and self.queue is not None
        )
        # Waiting, it is promised nothing; built only then (a copy costs on every request).
        bare = dataclasses.replace(claim, terms=None) if queued else claim
        reservation = await self.ledger.reserve(bare)
        if reservation.outcome is Outcome.ADMITTED or self.queue is None:
            return reservation
        if reservation.waiting_s <= 0 and not queued:
            return reservation  # refused, with its promise or its time
        if bare is claim:
            bare = dataclasses.replace(claim, terms=None)

        async def attempt() -> Reservation:
            # The pool's limit as it is now: its capacity or vLLM's unaccounted blocks may
            # have changed while the request waited.
            return await self.ledger.reserve(self._current(bare, watermark, calibrated))

        last = claim
        if reservation.waiting_s <= 0:
            assert queue is not None
            try:
                waited = await self.queue.wait(
                    claim.pool, claim.tenant, attempt, queue.max_wait_seconds, queue.max_queued
                )
            except QueueFull:  # a promise would go before those queued
                waited, last = None, dataclasses.replace(claim, retry_key="")
            if waited is not None:
                return waited
            reservation = await self.ledger.reserve(self._fresh(last, watermark, calibrated))
            if reservation.waiting_s <= 0:
                return reservation
        # Back at its promise's time, its blocks not all free: wait for them, first in line.
        waited = await self.queue.wait(
            claim.pool, claim.tenant, attempt, reservation.waiting_s, 0, promised=True
        )
        if waited is not None:
            return waited
        told = dataclasses.replace(claim, retry_key="")
        return await self.ledger.reserve(self._fresh(told, watermark, calibrated))

    def _current(self, claim: Claim, watermark: float, calibrated: bool) -> Claim:
        """`claim` against its pool's limit as it is now."""
        capacity = self.capacities.get(claim.pool)
        if capacity is None:
            return claim
        unaccounted = 0
        if self.calibration is not None:
            unaccounted = self.calibration.engine.unaccounted(claim.pool)
        limit = decide.claim_limit(capacity.limit(watermark), calibrated, unaccounted)
        return dataclasses.replace(claim, pool_limit=limit)

    def _fresh(self, claim: Claim, watermark: float, calibrated: bool) -> Claim:
        """`claim` as now, under a new lease id."""
        return dataclasses.replace(
            self._current(claim, watermark, calibrated), lease_id=uuid.uuid4().hex
        )
