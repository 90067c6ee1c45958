"""The response path behind the real Envoy: kvguard reads the responses it samples without the
client noticing. The upstream here answers fixed bytes, in chunks with real gaps, so that what
the client gets can be compared byte for byte with what the upstream sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvguard import config as configs
from kvguard.app import Service
from kvguard.extproc.observe import DEFAULT_SAMPLE, Sampler
from kvguard.extproc.responses import OBSERVE_HEADER
from kvguard.extproc.service import ExternalProcessor
from kvguard.testing import free_port
from kvguard.testing.envoy import EnvoyProcess, loopback_config
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.processes import kvguard_serve

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40}
TOKENS = 40
OBSERVE_STREAMS = "http.gateway.ext_proc.observe.streams_started"
GAP_S = 0.01  # between two chunks of a stream


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(text: str, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


USAGE = {"prompt_tokens": 9, "completion_tokens": TOKENS, "total_tokens": 9 + TOKENS}
WHOLE = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * TOKENS},
                "finish_reason": "length",
            },
        ],
        "usage": USAGE,
    }
).encode()
# One event per token, a last one with the finish reason; `usage` only when asked for.
EVENTS = [_event(_chunk("ok ", None)) for _ in range(TOKENS - 1)] + [_event(_chunk("ok", "stop"))]
STREAM_WITH_USAGE = [*EVENTS, _event({"id": "chatcmpl-1", "choices": [], "usage": USAGE})]


class FixedUpstream:
    """Answers a completion with WHOLE (after `answer_delay_s`), or a stream of `events` (one
    write each, GAP_S apart): the same bytes every time."""

    def __init__(self, answer_delay_s: float = 0.0) -> None:
        self._runner: web.AppRunner | None = None
        self._answer_delay_s = answer_delay_s
        self.arrived = asyncio.Event()  # set by each non-streamed request
        self.port = 0

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            self.arrived.set()
            await asyncio.sleep(self._answer_delay_s)
            return web.Response(body=WHOLE, content_type="application/json")
        events = STREAM_WITH_USAGE if body.get("stream_options") else EVENTS
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in [*events, b"data: [DONE]\n\n"]:
            await response.write(event)
            await asyncio.sleep(GAP_S)
        await response.write_eof()
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class Served:
    service: Service
    envoy: EnvoyProcess
    http: aiohttp.ClientSession

    async def post(
        self, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[bytes, float]:
        """The response body as the client got it, and how long it took; a non-streamed one
        keeps the upstream's content-length (no re-framing on the way)."""
        start = time.monotonic()
        async with self.http.post(
            self.envoy.url + "/v1/chat/completions",
            json=payload,
            headers={"x-tenant-id": "a", **(headers or {})},
        ) as response:
            assert response.status == 200
            if not payload.get("stream"):
                assert response.headers.get("content-length") == str(len(WHOLE))
            return await response.read(), time.monotonic() - start


@asynccontextmanager
async def served(tmp_path: Path, sample: float = 1.0) -> AsyncIterator[Served]:
    path = write_config(tmp_path, kvguard_config())
    service = Service(configs.load(path, environ={}), response_sample=sample)
    await service.start()
    upstream = FixedUpstream()
    await upstream.start()
    envoy = EnvoyProcess(loopback_config(service.grpc.port, upstream.port), tmp_path)
    try:
        await envoy.start()
        await envoy.wait_cluster_healthy("kvguard")
        async with aiohttp.ClientSession() as http:
            yield Served(service, envoy, http)
    finally:
        await envoy.stop()
        await upstream.stop()
        await service.stop(0)


def _released(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.__dict__
        for r in caplog.records
        if r.name == "kvguard.release" and r.getMessage() == "released"
    ]


async def test_sampled_responses_are_read_and_reach_the_client_byte_for_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with served(tmp_path) as gateway:
        whole, _ = await gateway.post(CHAT)
        stream, _ = await gateway.post({**CHAT, "stream": True})
        with_usage, _ = await gateway.post(
            {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        )
        await wait_until(lambda: len(_released(caplog)) == 3, "three releases recorded")
        stats = await gateway.envoy.stats("ext_proc")
        assert len(gateway.service.processor.completions) == 0

    assert stats[OBSERVE_STREAMS] == 3  # one observing stream per sampled exchange
    assert "http.gateway.ext_proc.observe.stream_msgs_received" not in stats  # never answered
    assert whole == WHOLE
    assert stream == b"".join(EVENTS) + b"data: [DONE]\n\n"
    assert with_usage == b"".join(STREAM_WITH_USAGE) + b"data: [DONE]\n\n"
    records = _released(caplog)
    got = [(r["completion_tokens"], r["completion_source"], r["finish_reason"]) for r in records]
    # Without usage a stream counts its events; each is one token here.
    assert sorted(got) == sorted(
        [(TOKENS, "usage", "length"), (TOKENS, "events", "stop"), (TOKENS, "usage", "stop")]
    )
    assert {r["reserved_output"] for r in records} == {40}  # the limit asked for, worst case


def _sampled_request_id() -> str:
    """A request id that kvguard's default share samples (the id decides)."""
    sampler = Sampler(DEFAULT_SAMPLE)
    return next(f"req-{i}" for i in itertools.count() if sampler.pick(f"req-{i}"))


async def test_a_kvguard_stopped_mid_response_delays_and_cuts_nothing(tmp_path: Path) -> None:
    """`kvguard serve` is frozen (SIGSTOP) while the responses it reads are under way: a stream
    after its first event, a non-streamed answer before the upstream sends it. Both arrive
    whole, byte for byte, in their own time; once kvguard runs again it records what they
    produced and releases their leases."""
    port = free_port()
    path = write_config(tmp_path, kvguard_config(grpc_port=port))
    log_path = tmp_path / "kvguard.log"
    upstream = FixedUpstream(answer_delay_s=0.5)
    await upstream.start()
    headers = {"x-tenant-id": "a", "x-request-id": _sampled_request_id()}
    try:
        async with (
            kvguard_serve(path, port, log_path) as process,
            EnvoyProcess(loopback_config(port, upstream.port), tmp_path) as envoy,
            aiohttp.ClientSession() as http,
        ):
            await envoy.wait_cluster_healthy("kvguard")
            url = envoy.url + "/v1/chat/completions"
            async with http.post(url, json={**CHAT, "stream": True}, headers=headers) as stream:
                assert stream.status == 200
                first = await stream.content.readline()
                process.send_signal(signal.SIGSTOP)
                try:
                    start = time.monotonic()
                    rest = await asyncio.wait_for(stream.read(), timeout=TOKENS * GAP_S + 5)
                    stream_s = time.monotonic() - start
                finally:
                    process.send_signal(signal.SIGCONT)
            assert first + rest == b"".join(EVENTS) + b"data: [DONE]\n\n"
            assert stream_s < TOKENS * GAP_S + 2

            headers["x-request-id"] += "-whole"  # sampled or not, the answer is the same
            whole = asyncio.create_task(_read(http, url, CHAT, headers))
            await upstream.arrived.wait()
            process.send_signal(signal.SIGSTOP)
            try:
                assert await asyncio.wait_for(whole, timeout=5) == WHOLE
            finally:
                process.send_signal(signal.SIGCONT)

            def releases() -> list[dict[str, Any]]:
                lines = [json.loads(x) for x in log_path.read_text().splitlines()]
                return [r for r in lines if r.get("message") == "released"]

            await wait_until(lambda: len(releases()) == 2, "both releases logged", timeout_s=10)
            streamed = next(r for r in releases() if r["request_id"] == _sampled_request_id())
            assert streamed["completion_tokens"] == TOKENS
            assert streamed["finish_reason"] == "stop"
            assert streamed["reserved_output"] == CHAT["max_tokens"]
    finally:
        await upstream.stop()


async def _read(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> bytes:
    async with http.post(url, json=payload, headers=headers) as response:
        assert response.status == 200
        return await response.read()


async def test_a_kvguard_slow_to_read_delays_no_response(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """kvguard takes SLOW_S over each message of an observing stream, far longer than the
    whole response: the client's response is not held back by it."""
    slow_s = 0.5
    process = ExternalProcessor.Process

    async def slow(
        iterator: AsyncIterator[pb.ProcessingRequest],
    ) -> AsyncIterator[pb.ProcessingRequest]:
        async for message in iterator:
            if message.observability_mode:
                await asyncio.sleep(slow_s)
            yield message

    async def slow_process(self: ExternalProcessor, iterator: Any, context: Any) -> None:
        await process(self, slow(iterator), context)

    monkeypatch.setattr(ExternalProcessor, "Process", slow_process)
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with served(tmp_path) as gateway:
        stream, stream_s = await gateway.post({**CHAT, "stream": True})
        assert stream == b"".join(EVENTS) + b"data: [DONE]\n\n"
        assert stream_s < slow_s * (TOKENS + 1) / 4  # ~TOKENS * GAP_S, nowhere near it
        whole, _ = await gateway.post(CHAT)
        assert whole == WHOLE


async def test_an_observing_stream_that_fails_cuts_no_response(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvguard ends the observing stream with an error at its first chunk: Envoy fails that
    side open and the client's stream goes on to its end; the lease is still released."""

    def failing(self: ExternalProcessor, exchange: Any, message: Any) -> None:
        raise grpc.RpcError("the observing stream fails")

    monkeypatch.setattr(ExternalProcessor, "_on_observed", failing)
    async with served(tmp_path) as gateway:
        stream, _ = await gateway.post({**CHAT, "stream": True})
        assert stream == b"".join(EVENTS) + b"data: [DONE]\n\n"
        whole, _ = await gateway.post(CHAT)
        assert whole == WHOLE

        async def released() -> bool:
            return (await gateway.service.ledger.usage("qwen")).reserved == 0

        await wait_until(released, "the leases released")
        assert gateway.service.keeper.open_leases == 0


async def test_a_share_of_zero_reads_no_response(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no share sampled, no response is copied to kvguard, not even for a client that
    marks its own request; releases are recorded at once, without what the requests produced."""
    caplog.set_level(logging.INFO, logger="kvguard.release")
    async with served(tmp_path, sample=0.0) as gateway:
        assert (await gateway.post(CHAT))[0] == WHOLE
        marked = {OBSERVE_HEADER: "1"}
        assert (await gateway.post({**CHAT, "stream": True}, marked))[0] == (
            b"".join(EVENTS) + b"data: [DONE]\n\n"
        )
        await wait_until(lambda: len(_released(caplog)) == 2, "both releases recorded")
        stats = await gateway.envoy.stats("ext_proc")
    assert not any("completion_tokens" in r for r in _released(caplog))
    assert all(r["reserved_output"] == TOKENS for r in _released(caplog))
    assert stats.get(OBSERVE_STREAMS, 0) == 0  # Envoy started no observing stream
    assert stats["http.gateway.ext_proc.streams_started"] == 2  # kvguard's own, one each
