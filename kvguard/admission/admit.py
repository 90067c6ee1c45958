"""The admission decision: from a request body to a lease or a refusal. No gRPC, no sockets.

Steps (DESIGN.md, "The request path"): parse; find the pool by model; count the prompt tokens;
clamp or inject the output limit; turn prompt + output into blocks; reserve in the ledger.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvguard.admission.capacity import Capacities
from kvguard.admission.estimate import blocks_needed, clamp
from kvguard.admission.policy import Identity, Policy
from kvguard.admission.record import Decision
from kvguard.errors import Code, Refusal
from kvguard.ledger import Claim, Lease, Ledger, LedgerUnavailable, Outcome
from kvguard.tokens.counting import PromptCounter
from kvguard.tokens.request import Kind, parse

# Seconds a 429 asks the client to wait. A constant for now: leases end when responses do,
# which kvguard cannot foresee.
RETRY_AFTER_S = 1

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
    ) -> None:
        self.ledger = ledger
        self.counter = counter
        self.capacities = capacities
        self.settings = settings

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
            if not policy.shadow or refusal.code not in SHADOWABLE:
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
        capacity = self.capacities.get(pool.name)
        if capacity is None:
            raise Refusal(
                Code.CAPACITY_UNKNOWN,
                f"the KV-cache capacity of pool {pool.name!r} is not known yet",
                retry_after_s=RETRY_AFTER_S,
            )
        prompt_tokens = await self.counter.count(
            pool.tokenizer,
            request,
            len(raw),
            media_tokens=pool.config.media_tokens,
            max_model_len=pool.config.max_model_len,
        )
        prompt_total = decision.prompt_tokens = sum(prompt_tokens)
        limits = clamp(
            kind,
            request.limits,
            identity.tier,
            pool.config.max_model_len,
            max(prompt_tokens),
            request.min_tokens,
        )
        decision.requested_max_tokens, decision.max_tokens = limits.requested, limits.max_tokens
        blocks = blocks_needed(prompt_tokens, limits.max_tokens, request.n, capacity.block_size)
        decision.blocks = blocks
        quota = identity.tier.max_blocks
        pool_limit = capacity.limit(pool.config.watermark)
        if blocks > quota or blocks > pool_limit:
            raise Refusal(
                Code.REQUEST_EXCEEDS_CAPACITY,
                f"the request needs {blocks} KV-cache blocks, more than this tenant's quota "
                f"({quota}) or the pool's admissible capacity ({pool_limit}) allows; "
                "lower max_tokens, n or the prompt length",
            )
        claim = Claim(
            uuid.uuid4().hex,
            pool.name,
            identity.tenant,
            blocks,
            pool_limit,
            quota,
            self.settings.lease_seconds,
        )
        body = None  # built before the reserve: nothing may fail between it and the answer
        if limits.fields != request.limits:
            body = json.dumps({**request.body, **limits.fields}, ensure_ascii=False).encode()
        lease = await self._reserve(claim, quota)
        metadata = {"blocks": str(blocks), "prompt_tokens": str(prompt_total)}
        headers = {
            "x-kvguard-blocks": metadata["blocks"],
            "x-kvguard-prompt-tokens": metadata["prompt_tokens"],
        }
        if lease is not None:
            headers["x-kvguard-lease"] = metadata["lease"] = lease.lease_id
        if identity.tenant:
            metadata["tenant"] = identity.tenant
        if policy.tenancy.expose_limit_header:
            metadata["max_tokens"] = str(limits.max_tokens)
        return Admitted(pool.name, lease, body, headers, prompt_total, blocks, metadata=metadata)

    async def _reserve(self, claim: Claim, quota: int) -> Lease | None:
        """The lease, or None when the ledger is unreachable and `on_unavailable` is allow."""
        try:
            reservation = await self.ledger.reserve(claim)
        except LedgerUnavailable:
            if self.settings.on_unavailable == "allow":
                return None
            raise Refusal(
                Code.LEDGER_UNAVAILABLE,
                "the admission ledger cannot be reached; retry later",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        if reservation.outcome is Outcome.TENANT_QUOTA:
            raise Refusal(
                Code.TENANT_BLOCK_QUOTA_EXCEEDED,
                f"tenant quota of {quota} KV-cache blocks in pool {claim.pool!r} is in "
                "use by this tenant's requests in flight; retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        if reservation.outcome is Outcome.POOL_WATERMARK:
            raise Refusal(
                Code.KV_CACHE_WATERMARK_EXCEEDED,
                f"the KV cache of pool {claim.pool!r} is full; retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        assert reservation.lease is not None
        return reservation.lease
