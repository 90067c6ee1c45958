"""Each refusal code's HTTP status and error type follow OpenAI's API, and the body is its error
schema."""

from __future__ import annotations

import json

import pytest

from kvguard.errors import Code, Refusal

# code -> (status, type): the status-code table of docs/design.md.
EXPECTED = {
    Code.TENANT_BLOCK_QUOTA_EXCEEDED: (429, "tokens"),
    Code.KV_CACHE_WATERMARK_EXCEEDED: (429, "tokens"),
    Code.REQUEST_EXCEEDS_CAPACITY: (400, "invalid_request_error"),
    Code.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    Code.INVALID_REQUEST: (400, "invalid_request_error"),
    Code.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    Code.ENDPOINT_NOT_SERVED: (404, "invalid_request_error"),
    Code.UNKNOWN_TENANT: (401, "invalid_request_error"),
    Code.REQUEST_TOO_LARGE: (413, "invalid_request_error"),
    Code.LEDGER_UNAVAILABLE: (503, "server_error"),
    Code.CAPACITY_UNKNOWN: (503, "server_error"),
    Code.NO_ENDPOINT_IN_SUBSET: (503, "server_error"),
    Code.INTERNAL_ERROR: (503, "server_error"),
}


def test_every_code_is_listed() -> None:
    assert set(EXPECTED) == set(Code)


@pytest.mark.parametrize("code", list(Code), ids=str)
def test_status_and_type_follow_openai(code: Code) -> None:
    assert (code.status, code.error_type) == EXPECTED[code]


def test_body_is_the_openai_error_schema() -> None:
    refusal = Refusal(Code.MODEL_NOT_FOUND, "the model 'x' is not served here", "model")
    assert json.loads(refusal.body()) == {
        "error": {
            "message": "the model 'x' is not served here",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# status -> Anthropic's error type (docs.claude.com/en/api/errors), for refusals on /v1/messages.
ANTHROPIC = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


@pytest.mark.parametrize("code", list(Code), ids=str)
def test_anthropic_types_follow_the_status(code: Code) -> None:
    expected = "api_error" if code is Code.INTERNAL_ERROR else ANTHROPIC[code.status]
    assert code.anthropic_type == expected


def test_anthropic_body_is_its_error_schema() -> None:
    refusal = Refusal(Code.TENANT_BLOCK_QUOTA_EXCEEDED, "tenant quota in use", None, 2.5)
    assert json.loads(refusal.anthropic_body()) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "tenant quota in use"},
    }
