"""The record of one request's decision, filled in as the decision goes: metrics, the span and
the log line are made from it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvguard.errors import Code


class RequestOutcome(enum.StrEnum):
    """How a guarded request's decision ended: kvguard_admissions_total's outcome label."""

    ADMITTED = "admitted"
    REFUSED = "refused"  # kvguard answered with an error
    SHADOW_REFUSED = "shadow_refused"  # shadow mode: it would refuse, and let the request through
    CANCELLED = "cancelled"  # the stream ended before the answer went out


class ReservedFrom(enum.StrEnum):
    """What sized the output a lease reserves per sequence."""

    WORST_CASE = "worst_case"  # the whole output limit
    TENANT = "tenant"  # the tenant's learnt output lengths
    TIER = "tier"  # its tier's
    POOL = "pool"  # the pool's, from vLLM's histogram
    ORACLE = "oracle"  # the simulator's truth


@dataclass
class Decision:
    """What one request's decision found out, filled in as it goes: metrics, the span and the
    log line are made from it. Never holds prompt text."""

    request_id: str = ""
    tenant: str = ""
    metered_tenant: str = ""  # the tenant as metrics label it (Tenancy.metered_tenant)
    tier: str = ""
    pool: str = ""
    prompt_tokens: int | None = None
    blocks: int | None = None
    requested_max_tokens: int | None = None  # the client's limit; None when it sent none
    max_tokens: int | None = None  # the limit vLLM applies (clamped or injected)
    reserved_output: int | None = None  # output tokens per sequence the lease reserves
    reserved_from: ReservedFrom | None = None
    outcome: RequestOutcome = RequestOutcome.REFUSED
    reason: str = ""  # the refusal code; "" when admitted or cancelled

    def refused(self, code: Code) -> None:
        self.outcome, self.reason = RequestOutcome.REFUSED, code.value

    def cancelled(self) -> None:
        """The stream ended before its answer went out (the client left, or Envoy timed out)."""
        self.outcome, self.reason = RequestOutcome.CANCELLED, ""

    def attributes(self) -> dict[str, str | int]:
        return _present(self, _DECISION_ATTRIBUTES)


@dataclass
class Completion:
    """What an admitted request produced, as far as kvguard saw it, when its lease is released:
    the release log line and kvguard_completion_tokens are made from it."""

    request_id: str
    tenant: str
    tier: str
    pool: str
    lease: str
    reserved_output: int | None  # output tokens per sequence the lease reserved
    completion_tokens: int | None = None  # where known: the response's usage, or its events
    finish_reason: str | None = None  # the first choice's, where seen
    source: str = ""  # usage | events (a stream without usage: one event per token) | ""
    sequences: int = 1  # prompts x n: completion_tokens is their sum

    def attributes(self) -> dict[str, str | int]:
        out = _present(self, _COMPLETION_ATTRIBUTES)
        if self.completion_tokens is not None:
            out["completion_source"] = self.source
        return out


# The fields the span and log lines carry, in their order; a field that is None is left out.
_DECISION_ATTRIBUTES = (
    "request_id", "tenant", "tier", "pool", "outcome", "reason", "prompt_tokens", "blocks",
    "requested_max_tokens", "max_tokens", "reserved_output", "reserved_from",
)  # fmt: skip
_COMPLETION_ATTRIBUTES = (
    "request_id", "tenant", "tier", "pool", "lease", "reserved_output", "completion_tokens",
    "finish_reason",
)  # fmt: skip


def _present(record: Decision | Completion, names: tuple[str, ...]) -> dict[str, str | int]:
    return {name: value for name in names if (value := getattr(record, name)) is not None}
