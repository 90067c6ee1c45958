"""The refusals kvguard answers with: one stable code each, with its HTTP status and error type.

The codes are public (clients and dashboards key on them); docs/design.md lists them under
"Status codes". Statuses and types follow OpenAI's API, so that its SDKs raise the error class
they raise for OpenAI's own answers; kvguard's reason is the `code`. On Anthropic's Messages
API the body is Anthropic's error schema instead, with its types.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


class Code(enum.StrEnum):
    """A refusal code; its value is the wire form (`x-kvguard-reason`, the body's `code`)."""

    TENANT_BLOCK_QUOTA_EXCEEDED = "tenant_block_quota_exceeded"
    KV_CACHE_WATERMARK_EXCEEDED = "kv_cache_watermark_exceeded"
    REQUEST_EXCEEDS_CAPACITY = "request_exceeds_capacity"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    ENDPOINT_NOT_SERVED = "endpoint_not_served"
    UNKNOWN_TENANT = "unknown_tenant"
    REQUEST_TOO_LARGE = "request_too_large"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    CAPACITY_UNKNOWN = "capacity_unknown"
    NO_ENDPOINT_IN_SUBSET = "no_endpoint_in_subset"
    INTERNAL_ERROR = "internal_error"

    @property
    def status(self) -> int:
        return _STATUS[self]

    @property
    def error_type(self) -> str:
        """The OpenAI error schema's `type` for this code (by its status)."""
        return _ERROR_TYPE[self.status]

    @property
    def anthropic_type(self) -> str:
        """Anthropic's error `type` for this code (by its status; a fault is `api_error`)."""
        return "api_error" if self is Code.INTERNAL_ERROR else _ANTHROPIC_TYPE[self.status]


_STATUS = {
    Code.TENANT_BLOCK_QUOTA_EXCEEDED: 429,
    Code.KV_CACHE_WATERMARK_EXCEEDED: 429,
    Code.REQUEST_EXCEEDS_CAPACITY: 400,
    Code.CONTEXT_LENGTH_EXCEEDED: 400,
    Code.INVALID_REQUEST: 400,
    Code.MODEL_NOT_FOUND: 404,  # as OpenAI's API and vLLM answer
    Code.ENDPOINT_NOT_SERVED: 404,  # as OpenAI's API answers an unknown URL
    Code.UNKNOWN_TENANT: 401,
    Code.REQUEST_TOO_LARGE: 413,
    Code.LEDGER_UNAVAILABLE: 503,
    Code.CAPACITY_UNKNOWN: 503,
    Code.NO_ENDPOINT_IN_SUBSET: 503,  # as the endpoint-picker protocol answers it
    Code.INTERNAL_ERROR: 503,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's 401 for a bad key: code invalid_api_key
    404: "invalid_request_error",
    413: "invalid_request_error",
    # OpenAI's rate-limit answers name the limit: `tokens` (per minute) or `requests`. kvguard's
    # quotas are KV blocks, which hold tokens.
    429: "tokens",
    503: "server_error",  # OpenAI's answer when its servers are overloaded
}


# Anthropic's error types (docs.claude.com/en/api/errors), for the refusals of /v1/messages.
# Its SDK picks the exception class by status; the type tells an overload (retry) from a fault.
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # kvguard's 503s say when to retry, as Anthropic's 529 does
}

# Seconds a refusal asks the client to wait when nothing is promised: the 503s (the capacity or
# the ledger is unknown, kvguard is busy counting) and 429s in pools that make no promises.
RETRY_AFTER_S = 1


@dataclass
class Refusal(Exception):
    """A request kvguard answers itself. `message` must never contain prompt text.

    Not frozen: tracebacks are assigned to exceptions as they propagate.
    """

    code: Code
    message: str
    param: str | None = None
    retry_after_s: float | None = None  # when to retry; None says nothing
    should_retry: bool | None = None  # False: retrying soon will not help; None says nothing
    headers: dict[str, str] = field(default_factory=dict)  # more response headers

    def body(self) -> bytes:
        """The OpenAI error schema."""
        error = {
            "message": self.message,
            "type": self.code.error_type,
            "param": self.param,
            "code": self.code.value,
        }
        return json.dumps({"error": error}).encode()

    def anthropic_body(self) -> bytes:
        """Anthropic's error schema (the code is in x-kvguard-reason)."""
        error = {"type": self.code.anthropic_type, "message": self.message}
        return json.dumps({"type": "error", "error": error}).encode()


def invalid(message: str, param: str | None = None) -> Refusal:
    return Refusal(Code.INVALID_REQUEST, message, param)
