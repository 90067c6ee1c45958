"""The simulated vLLM behind an OpenAI-compatible HTTP server (aiohttp, 127.0.0.1 by default).

POST /v1/chat/completions and /v1/completions (JSON or SSE streams; `max_tokens`,
`max_completion_tokens`, `n`, batch prompts, `ignore_eos`, `stream_options.include_usage`),
GET /metrics (vLLM's names, see metrics.py), /health and /v1/models. Any `model` is served.

The engine runs in real time: a task takes one step (engine.py), waits the step's modelled
duration (divided by `speed`), then hands the sampled tokens to the requests. A client that
goes away aborts its sequences, freeing their blocks, as vLLM does.

Output: every token is the text "tok ". A request that sets `ignore_eos` produces exactly its
limit; one that does not ends at its natural length when `natural_tokens=(lo, hi)` is given (a
length in [lo, hi] derived from the prompt, so the same prompt always stops at the same point),
otherwise at its limit too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvguard.sim.model import prompts
from kvguard.sim.model.engine import Engine, EngineConfig, Sequence, Status
from kvguard.sim.model.metrics import render

TOKEN_TEXT = "tok "
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_DONE = (Status.FINISHED, Status.ABORTED)


@dataclass
class _Pending:
    seqs: list[Sequence]
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return all(s.status in _DONE for s in self.seqs)


class SimServer:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: str = "qwen",
        natural_tokens: tuple[int, int] | None = None,
        speed: float = 1.0,
        tenant_header: str = "x-tenant-id",
    ) -> None:
        self.engine = Engine(config)
        self.model = model
        self.natural_tokens = natural_tokens
        self.speed = speed
        self.tenant_header = tenant_header
        self.tenant_preemptions: Counter[str] = Counter()
        # The limit fields each request tagged `x-sim-tag` arrived with (to see kvguard clamp).
        self.received_limits: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, _Pending] = {}
        self._work = asyncio.Event()
        self._ids = itertools.count()
        self._t0 = 0.0
        self._driver: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._host = "127.0.0.1"
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulator is not started")
        return self._port

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the server."""
        host = "127.0.0.1" if self._host in ("", "0.0.0.0") else self._host
        if host == "::":
            host = "::1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def now(self) -> float:
        """Simulated seconds since start."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speed

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> None:
        """Listen on `host`:`port` (0: a free port) and start the engine's clock."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self._complete)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", self._models)
        # handler_cancellation: a client that goes away ends its handler (and its sequences).
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._host = runner, host
        self._port = int(runner.addresses[0][1])
        self._t0 = asyncio.get_running_loop().time()
        self._driver = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._port = None

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.engine.idle:
                self._work.clear()
                await self._work.wait()
                continue
            result = self.engine.step(self.now())
            assert result is not None
            for seq in result.preempted:
                self.tenant_preemptions[seq.tenant] += 1
            # The modelled compute time of the step (what it took to schedule already counts).
            wake = self._t0 + result.end / self.speed
            await asyncio.sleep(max(0.0, wake - loop.time()))
            for seq in result.emitted:
                pending = self._pending.get(seq.uid)
                if pending is not None:
                    pending.changed.set()
            # Let the woken handlers read this step's tokens before the next step runs.
            await asyncio.sleep(0)

    async def _metrics(self, _: web.Request) -> web.Response:
        text = render(self.engine, self.model, self.tenant_preemptions)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _models(self, _: web.Request) -> web.Response:
        model = {
            "id": self.model,
            "object": "model",
            "owned_by": "kvguard-sim",
            "max_model_len": self.engine.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "the body is not valid JSON")
        config = self.engine.config
        try:
            parsed = prompts.parse(
                request.path,
                body,
                request.headers.get("x-kvguard-prompt-tokens"),
                max_model_len=config.max_model_len,
                block_size=config.block_size,
            )
        except prompts.BadRequest as exc:
            return _error(400, str(exc))
        tag = request.headers.get("x-sim-tag")
        if tag is not None:
            self.received_limits[tag] = {k: body[k] for k in prompts.LIMIT_KEYS if k in body}
        pending = self._submit(parsed, request.headers.get(self.tenant_header, ""))
        try:
            if parsed.stream:
                return await self._stream(request, parsed, pending)
            while not pending.done:
                await pending.changed.wait()
                pending.changed.clear()
            return web.json_response(_whole(parsed, pending.seqs, self.model))
        finally:
            now = self.now()
            for seq in pending.seqs:
                self.engine.abort(seq, now)
                self._pending.pop(seq.uid, None)

    def _submit(self, parsed: prompts.Parsed, tenant: str) -> _Pending:
        request_id = next(self._ids)
        now, seqs = self.now(), []
        for index, prompt in enumerate(parsed.prompts):
            for choice in range(parsed.n):
                stop_after = None
                if self.natural_tokens is not None and not parsed.ignore_eos:
                    low, high = self.natural_tokens
                    stop_after = low + (prompt.digest + 7919 * choice) % (high - low + 1)
                seqs.append(
                    Sequence(
                        f"{request_id}-{index}-{choice}",
                        prompt.tokens,
                        parsed.max_tokens,
                        arrival=now,
                        tenant=tenant,
                        prompt_keys=prompt.keys,
                        stop_after=stop_after,
                    )
                )
        pending = _Pending(seqs)
        for seq in seqs:
            self._pending[seq.uid] = pending
            self.engine.add(seq)
        self._work.set()
        return pending

    async def _stream(
        self, request: web.Request, parsed: prompts.Parsed, pending: _Pending
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        envelope = _envelope(parsed, self.model, chunk=True)
        sent = [0] * len(pending.seqs)
        closed = [False] * len(pending.seqs)
        while not all(closed):
            await pending.changed.wait()
            pending.changed.clear()
            events = []
            for index, seq in enumerate(pending.seqs):
                for _ in range(seq.output_tokens - sent[index]):
                    events.append(
                        _chunk(envelope, parsed.chat, index, TOKEN_TEXT, None, sent[index])
                    )
                    sent[index] += 1
                if seq.status in _DONE and not closed[index]:
                    events.append(_chunk(envelope, parsed.chat, index, "", seq.finish_reason, 1))
                    closed[index] = True
            await response.write(b"".join(events))
        if parsed.include_usage:
            usage = envelope | {"choices": [], "usage": _usage(parsed, pending.seqs)}
            await response.write(_event(usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="")


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    return web.json_response({"error": error}, status=status)


def _usage(parsed: prompts.Parsed, seqs: list[Sequence]) -> dict[str, int]:
    completion = sum(s.output_tokens for s in seqs)
    return {
        "prompt_tokens": parsed.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": parsed.prompt_tokens + completion,
    }


def _envelope(parsed: prompts.Parsed, model: str, *, chunk: bool) -> dict[str, Any]:
    kind = "chat.completion" if parsed.chat else "text_completion"
    if chunk and parsed.chat:
        kind = "chat.completion.chunk"
    prefix = "chatcmpl" if parsed.chat else "cmpl"
    return {
        "id": f"{prefix}-sim-{time.monotonic_ns()}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def _whole(parsed: prompts.Parsed, seqs: list[Sequence], model: str) -> dict[str, Any]:
    choices = []
    for index, seq in enumerate(seqs):
        text = TOKEN_TEXT * seq.output_tokens
        choice: dict[str, Any] = {"index": index, "finish_reason": seq.finish_reason}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    envelope = _envelope(parsed, model, chunk=False)
    return envelope | {"choices": choices, "usage": _usage(parsed, seqs)}


def _chunk(
    envelope: dict[str, Any], chat: bool, index: int, text: str, finish: str | None, sent: int
) -> bytes:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text} if sent else {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return _event(envelope | {"choices": [choice]})


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
