"""The ext_proc stream: one HTTP exchange, from request headers to the end of the response.

Thin on purpose: it reads what Envoy sends, asks `Admission` for the decision, and answers.
Every exception ends in exactly one place (`_answer_error`), which always replies: closing the
stream without a reply would let Envoy pass the request unmetered.

A second kind of stream carries only response messages, in observability mode: the response
of a sampled exchange, copied for reading. Envoy does not wait for answers there, so none is
written, and nothing on it can fail the exchange (`_on_observed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from kvguard.admission.admit import Admission, AdmissionRequest, Admitted
from kvguard.admission.leases import LeaseKeeper
from kvguard.admission.policy import Identity, Policy, identify_request
from kvguard.admission.promises import RETRY_TOKEN_HEADER
from kvguard.admission.record import Completion, Decision
from kvguard.config.schema import COUNTING_BUDGET_S
from kvguard.errors import Code, Refusal, invalid
from kvguard.extproc import picker, responses
from kvguard.extproc.observe import DEFAULT_SAMPLE, Completions, Sampler
from kvguard.extproc.routes import NOT_SERVED, READ_ONLY, classify, not_served
from kvguard.extproc.usage import BodyReader
from kvguard.ops.telemetry import Telemetry
from kvguard.ops.throttled_log import ThrottledWarnings
from kvguard.tokens.request import Kind

log = logging.getLogger(__name__)

KVGUARD_HEADER_PREFIX = "x-kvguard-"
# Envoy waits message_timeout (200 ms) for each answer. A decision still running after
# SLOW_DECISION_S (a large prompt queued for counting, a request queued for blocks) asks Envoy,
# once, to wait up to COUNTING_BUDGET_S plus the longest queue wait of the policy's pools.
# Envoy ignores (does not cap) a wait above its max_message_timeout, and then answers 504 at
# message_timeout: the shipped configurations hold 35 s, what the configuration allows.
SLOW_DECISION_S = 0.1
FULL_DUPLEX_STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class _Exchange:
    """Protocol state: what Envoy has told us about this HTTP exchange so far."""

    policy: Policy
    kind: Kind | None = None
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None  # the pods the gateway allows (None: any)
    identity: Identity | None = None
    decision: Decision = field(default_factory=Decision)
    recorded: bool = False  # the decision has been counted and logged
    observed: bool = False  # its response is copied to kvguard on an observing stream
    # An observing stream: the lease whose response it reads, and the body read so far.
    observing: str = ""
    reader: BodyReader | None = None
    # FULL_DUPLEX_STREAMED (as the Gateway API Inference Extension's gateways send bodies):
    # the request body comes in chunks that Envoy does not wait on, the headers' answer waits
    # for its end, and every body chunk must be sent back (what is not, upstream never sees).
    streamed: bool = False
    streamed_response: bool = False
    headers_answer: ProcessingResponse | None = None  # held until the body's end
    parts: list[bytes] = field(default_factory=list)  # the body so far
    size: int = 0


def _headers(header_map: HeaderMap) -> dict[str, str]:
    return {
        h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in header_map.headers
    }


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        policy: Callable[[], Policy],
        admission: Admission,
        keeper: LeaseKeeper,
        telemetry: Telemetry,
        *,
        sample: float = DEFAULT_SAMPLE,
        on_completion: Callable[[Completion], None] | None = None,
    ) -> None:
        self._policy = policy
        self._admission = admission
        self._keeper = keeper
        self._telemetry = telemetry
        self._sampler = Sampler(sample)
        self._on_completion = on_completion
        self.completions = Completions(self._completed)
        self._open_streams = 0
        self._own_errors = ThrottledWarnings(log)  # under overload, one a place per 10 s

    @property
    def open_streams(self) -> int:
        """ext_proc streams open now (one per HTTP exchange in flight; observing streams are
        not counted)."""
        return self._open_streams

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> None:
        exchange = _Exchange(self._policy())
        admitted: Admitted | None = None  # domain state: its lease is released however it ends
        self._open_streams += 1
        counted = True  # an observing stream holds no lease: it leaves the count
        try:
            async for message in request_iterator:
                if message.observability_mode:
                    if counted:
                        self._open_streams, counted = self._open_streams - 1, False
                    self._on_observed(exchange, message)
                    continue
                if exchange.subset is None and message.HasField("metadata_context"):
                    exchange.subset = picker.subset_hint(message.metadata_context)
                if message.HasField("protocol_config"):  # the first message says the modes
                    modes = message.protocol_config
                    exchange.streamed = modes.request_body_mode == FULL_DUPLEX_STREAMED
                    exchange.streamed_response = modes.response_body_mode == FULL_DUPLEX_STREAMED
                answers: list[ProcessingResponse]
                try:
                    match message.WhichOneof("request"):
                        case "request_headers":
                            answers = [self._on_request_headers(exchange, message.request_headers)]
                            if exchange.streamed and exchange.kind is not None:
                                exchange.headers_answer = answers.pop()
                        case "request_body" if exchange.streamed:
                            answers, decided = await self._on_streamed_body(
                                exchange, message.request_body, context
                            )
                            admitted = admitted or decided
                        case "request_body":
                            response, decided = await self._on_request_body(
                                exchange, message.request_body, context
                            )
                            answers = [response]
                            admitted = admitted or decided
                        case "request_trailers" if exchange.streamed and exchange.parts:
                            # The body ended with trailers: decided now, trailers after it.
                            end = HttpBody(end_of_stream=True)
                            answers, decided = await self._on_streamed_body(
                                exchange, end, context, trailers=True
                            )
                            admitted = admitted or decided
                            answers.append(responses.continue_response("request_trailers"))
                        case "response_headers":
                            if admitted is not None and admitted.lease is not None:
                                served = picker.served(message.metadata_context)
                                self._keeper.served(admitted.lease.lease_id, served)
                            answers = [responses.continue_response("response_headers")]
                        case "response_body" if exchange.streamed_response:
                            body = message.response_body
                            answers = [
                                responses.streamed_body(
                                    "response_body", body.body, body.end_of_stream
                                )
                            ]
                        case kind:
                            answers = [responses.continue_response(str(kind))]
                except Exception as exc:
                    answers = [self._answer_error(exchange, exc)]
                for answer in answers:
                    await context.write(answer)
        finally:
            if admitted is not None and admitted.lease is not None:
                self._keeper.release(admitted.lease)
                self.completions.released(admitted.lease.lease_id)
            if counted:
                self._open_streams -= 1

    def _on_request_headers(self, exchange: _Exchange, message: HttpHeaders) -> ProcessingResponse:
        headers = exchange.headers = _headers(message.headers)
        remove = [
            name
            for name in headers
            if name.startswith(KVGUARD_HEADER_PREFIX) or name in picker.PICKER_HEADERS
        ]
        exchange.decision.request_id = headers.get("x-request-id", "")
        route = classify(headers.get(":method", ""), headers.get(":path", ""))
        if route == NOT_SERVED:  # deny by default: refused before any body is read
            raise not_served()
        if route != READ_ONLY:
            exchange.kind = route  # before the tenant: a 401 answers in the kind's schema
        # Read-only endpoints too need a known identity (401 without one, as generation does):
        # the gateway may give vLLM its own key, and /tokenize spends vLLM's CPU.
        identity = identify_request(exchange.policy, headers)
        if route == READ_ONLY:
            # Streamed, the body mode stays: its chunks go back as they come.
            return responses.request_headers(remove, guarded=False, override=not exchange.streamed)
        exchange.identity = identity
        if message.end_of_stream:
            raise invalid("this endpoint needs a JSON request body")
        exchange.observed = self._sampler.pick(exchange.decision.request_id)
        return responses.request_headers(remove, guarded=True, observe=exchange.observed)

    async def _on_streamed_body(
        self,
        exchange: _Exchange,
        message: HttpBody,
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
        *,
        trailers: bool = False,
    ) -> tuple[list[ProcessingResponse], Admitted | None]:
        """A FULL_DUPLEX_STREAMED body chunk: a guarded request's chunks are kept until the
        body's end, then decided whole; the answers are the held headers' (with the decision's
        headers) and the body, sent back in chunks (its end left to the `trailers` that follow,
        when they do). Anything else goes back as it came."""
        if exchange.kind is None or exchange.identity is None or exchange.recorded:
            return [
                responses.streamed_body("request_body", message.body, message.end_of_stream)
            ], None
        exchange.size += len(message.body)
        limit = self._admission.settings.max_body_bytes
        if exchange.size > limit:  # refused before it is all held in memory
            raise Refusal(Code.REQUEST_TOO_LARGE, f"the request body is larger than {limit} bytes")
        exchange.parts.append(message.body)
        if not message.end_of_stream:
            return [], None
        body = b"".join(exchange.parts)
        exchange.parts.clear()
        whole = HttpBody(body=body, end_of_stream=True)
        answer, admitted = await self._on_request_body(exchange, whole, context)
        assert exchange.headers_answer is not None
        answers = responses.streamed_admission(
            exchange.headers_answer, answer, body, end_of_stream=not trailers
        )
        return answers, admitted

    async def _on_request_body(
        self,
        exchange: _Exchange,
        message: HttpBody,
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> tuple[ProcessingResponse, Admitted | None]:
        if exchange.kind is None or exchange.identity is None or exchange.recorded:
            # Unguarded, or decided already: one decision and one lease per stream.
            return responses.continue_response("request_body"), None
        exchange.recorded = True
        with self._telemetry.deciding(exchange.decision, exchange.headers):
            try:
                admitted = await self._admit_in_time(
                    exchange, exchange.kind, exchange.identity, message.body, context
                )
            except Refusal:
                raise
            except asyncio.CancelledError:
                exchange.decision.cancelled()
                raise
            except Exception:
                exchange.decision.refused(Code.INTERNAL_ERROR)
                raise
        expose_limit = exchange.policy.tenancy.expose_limit_header
        answer = responses.admitted_body(admitted, expose_limit=expose_limit)
        if admitted.lease is not None:
            decision = exchange.decision
            self.completions.admitted(
                Completion(
                    decision.request_id,
                    decision.tenant,
                    decision.tier,
                    decision.pool,
                    admitted.lease.lease_id,
                    decision.reserved_output,
                    sequences=admitted.sequences,
                ),
                observed=exchange.observed,
            )
        return answer, admitted

    async def _admit_in_time(
        self,
        exchange: _Exchange,
        kind: Kind,
        identity: Identity,
        body: bytes,
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> Admitted:
        """The decision, its lease held; Envoy is asked for more time if it runs long.

        A timer, not a second task: most decisions end long before it fires, and a task with
        asyncio.wait per decision would cost CPU on every request."""
        loop = asyncio.get_running_loop()
        extension: asyncio.Task[None] | None = None

        def ask_for_time() -> None:
            nonlocal extension
            waits = [p.config.queue.max_wait_seconds for p in exchange.policy.pools.values()]
            seconds = COUNTING_BUDGET_S + max(waits, default=0.0)
            extension = loop.create_task(context.write(responses.extend_message_timeout(seconds)))

        timer = loop.call_later(SLOW_DECISION_S, ask_for_time)
        try:
            admitted = await self._admit_and_hold(exchange, kind, identity, body)
        except asyncio.CancelledError:  # the stream is gone
            if extension is not None:
                extension.cancel()
            raise
        except Exception:  # a refusal follows: after the extension, never beside it
            if extension is not None:
                await asyncio.gather(extension, return_exceptions=True)
            raise
        finally:
            timer.cancel()
        if extension is not None:
            try:  # the extension goes out before the answer, or the stream is gone
                await extension
            except BaseException:
                if admitted.lease is not None:
                    self._keeper.release(admitted.lease)
                raise
        return admitted

    async def _admit_and_hold(
        self, exchange: _Exchange, kind: Kind, identity: Identity, body: bytes
    ) -> Admitted:
        admitted = await self._admission.admit(
            AdmissionRequest(
                exchange.policy,
                kind,
                identity,
                body,
                exchange.decision,
                exchange.headers.get(RETRY_TOKEN_HEADER, ""),
                exchange.subset,
            )
        )
        if admitted.lease is not None:
            self._keeper.hold(admitted.lease, admitted.growth)
        return admitted

    def _completed(self, completion: Completion) -> None:
        """A released lease's record: logged and measured, then learnt from."""
        self._telemetry.released(completion)
        if self._on_completion is not None:
            self._on_completion(completion)

    def _on_observed(self, exchange: _Exchange, message: ProcessingRequest) -> None:
        """A message of an observing stream: read the response body of the lease named in the
        forwarded dynamic metadata. Never answers and never raises (the client's response
        does not wait for it)."""
        try:
            if message.WhichOneof("request") != "response_body":
                return
            if exchange.reader is None:
                namespace = message.metadata_context.filter_metadata.get(
                    responses.METADATA_NAMESPACE
                )
                value = namespace.fields.get("lease") if namespace is not None else None
                lease = value.string_value if value is not None else ""
                if not lease:  # a refusal's local reply, or a request kvguard did not lease
                    return
                exchange.observing, exchange.reader = lease, BodyReader()
            body = message.response_body
            exchange.reader.feed(body.body)
            self._keeper.seen(exchange.observing, exchange.reader.events)
            if body.end_of_stream:
                self.completions.produced(exchange.observing, exchange.reader.done())
                exchange.reader = None
        except Exception as exc:  # a bug here must cost the reading, never the exchange
            exchange.reader = None
            self._own_errors.warning(exc, "reading an observed response failed")

    def _answer_error(self, exchange: _Exchange, exc: Exception) -> ProcessingResponse:
        if not isinstance(exc, Refusal):
            log.exception("internal error deciding request %s", exchange.decision.request_id)
            exc = Refusal(Code.INTERNAL_ERROR, "kvguard failed to decide this request")
        elif exc.code is Code.INTERNAL_ERROR:  # kvguard's own 503 (busy counting): where from
            self._own_errors.warning(
                exc,
                "internal_error answered to request %s: %s",
                exchange.decision.request_id,
                exc.message,
            )
        if not exchange.recorded:  # refused before the body: count and log it here
            exchange.recorded = True
            exchange.decision.refused(exc.code)
            self._telemetry.record(exchange.decision)
        # The access log's tenant is kvguard's (dynamic metadata), never a header as sent.
        tenant = exchange.identity.tenant if exchange.identity is not None else ""
        metadata = {"tenant": tenant} if tenant else None
        return responses.refusal(exc, metadata, exchange.kind)
