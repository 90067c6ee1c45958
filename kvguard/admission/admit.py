"""Admission as it runs: from a request body to a lease or a refusal. No gRPC, no sockets.

Steps (docs/design.md, "The request path"): parse; find the pool by model; count the prompt tokens
(the injected counter); size the request and build its claim (`decide`, pure); reserve it in
the injected ledger; build the answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.admission import decide
from kvguard.admission.calibration import Calibration, Growth
from kvguard.admission.capacity import Capacities
from kvguard.admission.decide import RETRY_AFTER_S, SHADOWABLE
from kvguard.admission.policy import Identity, Policy
from kvguard.admission.record import Decision
from kvguard.errors import Code, Refusal
from kvguard.ledger import Claim, Lease, Ledger, LedgerUnavailable
from kvguard.tokens.counting import PromptCounter
from kvguard.tokens.request import Kind, parse

__all__ = [
    "RETRY_AFTER_S",
    "SHADOWABLE",
    "Admission",
    "AdmissionSettings",
    "Admitted",
    "reserve",
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
    # How its lease grows as it decodes; None when it reserved its whole limit.
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
    ) -> None:
        self.ledger = ledger
        self.counter = counter
        self.capacities = capacities
        self.settings = settings
        # Learnt output lengths, for pools and tiers in calibrated mode; None: worst case always.
        self.calibration = calibration
        self.clock = clock

    async def decide(
        self, policy: Policy, kind: Kind, identity: Identity, raw: bytes, decision: Decision
    ) -> Admitted:
        """Admit (a lease is held until `ledger.release`) or raise Refusal; `decision` records
        what was found on the way, whichever way it ends."""
        decision.tenant, decision.tier = identity.tenant, identity.tier_name
        try:
            admitted = await self._decide(policy, kind, identity, raw, decision)
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
        self, policy: Policy, kind: Kind, identity: Identity, raw: bytes, decision: Decision
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
        decision.blocks, decision.reserved_output = plan.blocks, plan.reserved_output
        decision.reserved_from = plan.reserved_from
        # A calibrated claim fits beside what vLLM holds beyond the ledger's count, too.
        unaccounted = 0
        if self.calibration is not None:
            unaccounted = self.calibration.engine.unaccounted(pool.name)
        claim = decide.claim(plan, uuid.uuid4().hex, self.settings.lease_seconds, unaccounted)
        body = None  # built before the reserve: nothing may fail between it and the answer
        if limits.fields != request.limits:
            body = json.dumps({**request.body, **limits.fields}, ensure_ascii=False).encode()
        lease = await self._reserve(claim)
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
        growth = None
        if plan.reserved_output < limits.max_tokens:
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

    async def _reserve(self, claim: Claim) -> Lease | None:
        """The lease, or None when the ledger is unreachable and `on_unavailable` is allow."""
        try:
            return await reserve(self.ledger, claim)
        except LedgerUnavailable:
            if self.settings.on_unavailable == "allow":
                return None
            raise decide.unavailable() from None


async def reserve(ledger: Ledger, claim: Claim) -> Lease:
    """Reserve `claim` in `ledger`: its lease, or the Refusal the ledger's answer means.
    LedgerUnavailable goes to the caller, whose setting says what it means."""
    reservation = await ledger.reserve(claim)
    refused = decide.refusal(reservation.outcome, claim)
    if refused is not None:
        raise refused
    assert reservation.lease is not None
    return reservation.lease
