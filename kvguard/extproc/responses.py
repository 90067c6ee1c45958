"""Building ext_proc ProcessingResponses. The one place where a refusal becomes HTTP."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from kvguard.admission.admit import Admitted
from kvguard.errors import Refusal
from kvguard.extproc.picker import DESTINATION, LB_NAMESPACE

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# The namespace of the dynamic metadata kvguard sets: the one envoy.yaml's ext_proc filter
# accepts (metadata_options.receiving_namespaces) and its route reads.
METADATA_NAMESPACE = "envoy.filters.http.ext_proc"

# The request header that marks an exchange for envoy.yaml's observing filter, which copies
# its response body to kvguard (the route removes it before the request goes upstream).
OBSERVE_HEADER = "x-kvguard-observe"
_OBSERVE = {OBSERVE_HEADER: "1"}
# A streamed body goes back to Envoy in chunks no larger than this, as GIE gateways take them.
STREAMED_CHUNK_BYTES = 62_000

# For the read-only paths (routes.READ_ONLY_PATHS): no body buffering, no response messages.
PASS_THROUGH_MODE = ProcessingMode(
    request_body_mode=ProcessingMode.NONE,
    response_header_mode=ProcessingMode.SKIP,
    response_body_mode=ProcessingMode.NONE,
    request_trailer_mode=ProcessingMode.SKIP,
    response_trailer_mode=ProcessingMode.SKIP,
)


def _mutate(
    mutation: HeaderMutation, set_headers: dict[str, str], remove: Iterable[str] = ()
) -> None:
    """Fill `mutation` in place: it takes less CPU than building the answer from nested
    constructors, and every admitted body's answer is built here."""
    for key, value in set_headers.items():
        option = mutation.set_headers.add(append_action=_OVERWRITE)
        option.header.key = key
        option.header.raw_value = value.encode()
    mutation.remove_headers.extend(remove)


def request_headers(
    remove: list[str], *, guarded: bool, observe: bool = False, override: bool = True
) -> ProcessingResponse:
    """Continue after request headers, dropping client-sent kvguard headers. With `observe`,
    OBSERVE_HEADER is set: envoy.yaml's observing filter, after this one, reads the headers as
    changed here, so only kvguard's mark (never a client's) sends it the response body. An
    unguarded request's messages stop here (PASS_THROUGH_MODE) unless not to `override`."""
    response = ProcessingResponse()
    common = response.request_headers.response
    if observe:
        _mutate(common.header_mutation, _OBSERVE, [r for r in remove if r != OBSERVE_HEADER])
    elif remove:
        _mutate(common.header_mutation, {}, remove)
    else:
        common.SetInParent()
    if not guarded and override:
        response.mode_override.CopyFrom(PASS_THROUGH_MODE)
    return response


def admitted_body(admitted: Admitted, *, expose_limit: bool = False) -> ProcessingResponse:
    """Continue with the rewritten body (when there is one) and the x-kvguard-* headers; the
    decision also goes as dynamic metadata in METADATA_NAMESPACE, which envoy.yaml's access log
    reads (kvguard's word, not headers a client could send) and its route turns into response
    headers (`max_tokens`, with `expose_limit`, into x-kvguard-max-tokens; the RateLimit
    fields). A lease on a pod names it to the gateway: the destination header, and the same
    value in `envoy.lb` metadata."""
    headers, metadata = _decision(admitted, expose_limit)
    response = ProcessingResponse()
    common = response.request_body.response
    body = admitted.body
    if body is None:
        _mutate(common.header_mutation, headers)
    else:
        # Envoy answers 500 when content-length disagrees with the body it forwards.
        _mutate(common.header_mutation, {**headers, "content-length": str(len(body))})
        common.body_mutation.body = body
    _set_metadata(response, metadata)
    if admitted.lease is not None and admitted.lease.pod:
        lb = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
        lb[DESTINATION].string_value = admitted.lease.pod
    return response


def streamed_admission(
    headers_answer: ProcessingResponse,
    body_answer: ProcessingResponse,
    body: bytes,
    *,
    end_of_stream: bool = True,
) -> list[ProcessingResponse]:
    """A FULL_DUPLEX_STREAMED admission as Envoy takes it: the request headers' answer (held
    until the body's end) with the decision's headers, content-length and dynamic metadata of
    `body_answer` (admitted_body's), then the body it forwards (the rewritten one, else `body`)
    in chunks of at most STREAMED_CHUNK_BYTES, the last one ending the stream unless trailers
    follow (not `end_of_stream`)."""
    decided = body_answer.request_body.response
    forwarded = decided.body_mutation.body if decided.HasField("body_mutation") else body
    answer = ProcessingResponse()
    answer.CopyFrom(headers_answer)
    mutation = answer.request_headers.response.header_mutation
    mutation.MergeFrom(decided.header_mutation)
    if not decided.HasField("body_mutation"):  # as sent: its length said all the same
        _mutate(mutation, {"content-length": str(len(forwarded))})
    answer.dynamic_metadata.CopyFrom(body_answer.dynamic_metadata)
    chunks = [forwarded[i : i + STREAMED_CHUNK_BYTES]
              for i in range(0, len(forwarded), STREAMED_CHUNK_BYTES)] or [b""]  # fmt: skip
    last = len(chunks) - 1
    return [answer] + [
        streamed_body("request_body", c, end_of_stream and i == last) for i, c in enumerate(chunks)
    ]


def streamed_body(kind: str, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
    """A FULL_DUPLEX_STREAMED body chunk sent back (`kind`: request_body or response_body)."""
    response = ProcessingResponse()
    streamed = getattr(response, kind).response.body_mutation.streamed_response
    streamed.body, streamed.end_of_stream = chunk, end_of_stream
    return response


def _decision(admitted: Admitted, expose_limit: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The upstream request's x-kvguard-* headers and the dynamic metadata of `admitted`."""
    if admitted.would_refuse is not None:  # shadow mode: passed as sent, without a lease
        code = admitted.would_refuse.value
        headers, metadata = {"x-kvguard-would-refuse": code}, {"would_refuse": code}
    else:
        blocks, prompt_tokens = str(admitted.blocks), str(admitted.prompt_tokens)
        reserved_output = str(admitted.reserved_output)
        headers = {
            "x-kvguard-blocks": blocks,
            "x-kvguard-prompt-tokens": prompt_tokens,
            "x-kvguard-reserved-output": reserved_output,
        }
        metadata = {
            "blocks": blocks,
            "prompt_tokens": prompt_tokens,
            "reserved_output": reserved_output,
        }
        if admitted.lease is not None:
            headers["x-kvguard-lease"] = metadata["lease"] = admitted.lease.lease_id
            if admitted.lease.pod:
                headers[DESTINATION] = metadata["pod"] = admitted.lease.pod
        if expose_limit:
            metadata["max_tokens"] = str(admitted.max_tokens)
        if admitted.rate_limit is not None:
            standing = admitted.rate_limit.headers()
            metadata["ratelimit"] = standing["ratelimit"]
            metadata["ratelimit_policy"] = standing["ratelimit-policy"]
    if admitted.tenant:
        metadata["tenant"] = admitted.tenant
    return headers, metadata


def _set_metadata(response: ProcessingResponse, metadata: Mapping[str, str]) -> None:
    fields = response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    for key, value in metadata.items():
        fields[key].string_value = value


def extend_message_timeout(seconds: float) -> ProcessingResponse:
    """Asks Envoy to wait up to `seconds` for the answer to the current message (once per
    message; Envoy ignores it above its max_message_timeout)."""
    timeout = Duration()
    timeout.FromMilliseconds(round(seconds * 1000))
    return ProcessingResponse(override_message_timeout=timeout)


def continue_response(kind: str) -> ProcessingResponse:
    """CONTINUE for a message kvguard only observes."""
    match kind:
        case "response_headers":
            return ProcessingResponse(response_headers=HeadersResponse())
        case "response_trailers":
            return ProcessingResponse(response_trailers=TrailersResponse())
        case "request_trailers":
            return ProcessingResponse(request_trailers=TrailersResponse())
        case "response_body":
            return ProcessingResponse(response_body=BodyResponse())
        case "request_body":
            return ProcessingResponse(request_body=BodyResponse())
        case _:
            return ProcessingResponse(request_headers=HeadersResponse())


def refusal(
    refused: Refusal, metadata: Mapping[str, str] | None = None, kind: str | None = None
) -> ProcessingResponse:
    """The local reply for a refusal: the error body in the schema of the request's API
    (`kind`: Anthropic's for "messages", OpenAI's for the others and for requests of no
    kind), reason header, when to retry (RFC 9110's delay-seconds in `retry-after`,
    milliseconds in `retry-after-ms`, which the OpenAI and Anthropic SDKs read first, both
    rounded up) or `x-should-retry: false`, and the refusal's own headers; `metadata` as in
    admitted_body (Envoy applies it with an immediate response too)."""
    headers = {"content-type": "application/json", "x-kvguard-reason": refused.code.value}
    if refused.should_retry is False:
        headers["x-should-retry"] = "false"
    elif refused.retry_after_s is not None:
        headers["retry-after"] = str(math.ceil(refused.retry_after_s))
        headers["retry-after-ms"] = str(math.ceil(refused.retry_after_s * 1000))
        headers["x-should-retry"] = "true"
    headers.update(refused.headers)
    response = ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=refused.code.status),
            body=refused.anthropic_body() if kind == "messages" else refused.body(),
            details=f"kvguard_{refused.code.value}",
        )
    )
    _mutate(response.immediate_response.headers, headers)
    if metadata:
        _set_metadata(response, metadata)
    return response
