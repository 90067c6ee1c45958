"""The record of one request's decision, filled in as the decision goes: metrics, the span and
the log line are made from it."""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.errors import Code


@dataclass
class Decision:
    """What one request's decision found out, filled in as it goes: metrics, the span and the
    log line are made from it. Never holds prompt text."""

    request_id: str = ""
    tenant: str = ""
    tier: str = ""
    pool: str = ""
    prompt_tokens: int | None = None
    blocks: int | None = None
    requested_max_tokens: int | None = None  # the client's limit; None when it sent none
    max_tokens: int | None = None  # the limit vLLM applies (clamped or injected)
    reserved_output: int | None = None  # output tokens per sequence the lease reserves
    outcome: str = "refused"  # admitted | refused | shadow_refused | cancelled
    reason: str = ""  # the refusal code; "" when admitted or cancelled

    def refused(self, code: Code) -> None:
        self.outcome, self.reason = "refused", code.value

    def cancelled(self) -> None:
        """The stream ended before its answer went out (the client left, or Envoy timed out)."""
        self.outcome, self.reason = "cancelled", ""

    def attributes(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "tier": self.tier,
            "pool": self.pool,
            "outcome": self.outcome,
            "reason": self.reason,
        }
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
        if self.blocks is not None:
            out["blocks"] = self.blocks
        if self.requested_max_tokens is not None:
            out["requested_max_tokens"] = self.requested_max_tokens
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.reserved_output is not None:
            out["reserved_output"] = self.reserved_output
        return out


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

    def attributes(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "tier": self.tier,
            "pool": self.pool,
            "lease": self.lease,
        }
        if self.reserved_output is not None:
            out["reserved_output"] = self.reserved_output
        if self.completion_tokens is not None:
            out["completion_tokens"] = self.completion_tokens
            out["completion_source"] = self.source
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        return out
