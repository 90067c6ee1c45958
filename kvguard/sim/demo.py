"""`kvguard demo`: one burst, unguarded and then behind Envoy + kvguard, side by side.

The upstream is kvguard's vLLM simulator (kvguard/sim: vLLM's scheduling and KV-block
accounting, real time, no GPU): 512 usable blocks of 16 tokens. Two tenants share it:

- `acme` (tier pro) sends a burst of long report generations (1200 output tokens each,
  `ignore_eos`), all at once;
- `hobbyist` (unmapped, so the default tier free) asks for short jokes, one every 0.25 s, with
  no output limit (they end naturally after 40-120 tokens).

Unguarded, acme's requests fill the KV cache, vLLM preempts and recomputes, and the hobbyist's
small requests queue behind them. Guarded, kvguard (capacity discovered from the simulator's
/metrics, memory ledger) clamps acme to its tier and admits only what fits: no preemptions, and
the hobbyist's latency stays low. What does not fit waits in the pool's short queue (the
hobbyist, holding fewer blocks, first), and past its wait gets a 429 that promises a time; the
clients retry once when told to, as the OpenAI SDK does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvguard import config as configs
from kvguard.admission.capacity import PoolCapacity
from kvguard.app import Service
from kvguard.sim.envoy import EnvoyProcess, loopback_config
from kvguard.sim.load import Answer, Planned, send_all
from kvguard.sim.model.engine import EngineConfig, StepCost
from kvguard.sim.model.report import percentile
from kvguard.sim.server import SimServer

# Where `make demo` (tools/fetch_tokenizers.py) puts the model's tokenizer files, relative to
# the working directory (a checkout's root); `kvguard demo --tokenizer DIR` names another.
TOKENIZER = Path(".cache", "models", "qwen")
MODEL = "qwen2.5-7b-instruct"
ENGINE = EngineConfig(
    num_gpu_blocks=513,  # 512 usable
    block_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    max_model_len=4096,
    cost=StepCost(base_s=0.003, prefill_token_s=0.00001, decode_seq_s=0.00005),
)
NATURAL_TOKENS = (40, 120)  # where a request without ignore_eos ends
TIERS = {"acme": "pro", "hobbyist": "free"}
QUEUE_WAIT_S = 3.0  # the pool's queue.max_wait_seconds
RETRIES = 1  # each client retries a 429 once when told to


def demo_config(sim_url: str, tokenizer: Path) -> dict[str, Any]:
    return {
        "server": {"grpc_listen": "127.0.0.1:0", "metrics_listen": ""},
        "ledger": {"url": "memory://", "lease_seconds": 120},
        "tenancy": {
            "header": "x-tenant-id",
            "default_tier": "free",
            "tiers": {
                "free": {"max_tokens_cap": 256, "default_max_tokens": 128, "max_blocks": 160},
                "pro": {"max_tokens_cap": 512, "default_max_tokens": 256, "max_blocks": 320},
            },
            "tenants": {"acme": "pro"},
        },
        "pools": [
            {
                "name": "qwen",
                "models": [MODEL],
                "tokenizer": str(tokenizer),
                "max_model_len": ENGINE.max_model_len,
                "watermark": 0.15,
                "capacity": {"endpoints": [sim_url], "refresh_seconds": 1},
                "queue": {"max_wait_seconds": QUEUE_WAIT_S},
                "retry_after_max_seconds": 30,  # past its wait, a 429 promises a time
            }
        ],
    }


def plan(requests_per_tenant: int) -> list[Planned]:
    report = "Write a thorough report on the history of lighthouses and their keepers. " * 16
    burst = []
    for i in range(requests_per_tenant):
        burst.append(
            Planned(
                0.01 * i,
                "acme",
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "max_tokens": 1200,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{i}: {report}"}],
                },
                {"x-sim-tag": f"acme-{i}"},
            )
        )
        burst.append(
            Planned(
                0.5 + 0.25 * i,
                "hobbyist",
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "stream": True,
                    "messages": [{"role": "user", "content": f"Joke #{i}, please"}],
                },
                {"x-sim-tag": f"hobbyist-{i}"},
            )
        )
    return sorted(burst, key=lambda p: p.at_s)


class Progress:
    """One line per run: a bar of answered requests (redrawn in place on a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = time.monotonic()
        self.tty = sys.stdout.isatty()

    def __call__(self, _: Answer) -> None:
        self.done += 1
        if self.tty:
            print("\r" + self._line(), end="", flush=True)

    def finish(self) -> None:
        print(("\r" if self.tty else "") + self._line(), flush=True)

    def _line(self) -> str:
        filled = 30 * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (30 - filled)
        return (
            f"{self.label:<10} [{bar}] {self.done}/{self.total} answered "
            f"{time.monotonic() - self.started:5.1f} s"
        )


async def _unguarded(burst: list[Planned]) -> tuple[list[Answer], SimServer]:
    sim = SimServer(ENGINE, model=MODEL, natural_tokens=NATURAL_TOKENS)
    await sim.start()
    try:
        progress = Progress("unguarded", len(burst))
        answers = await send_all(sim.url, burst, on_done=progress, retries=RETRIES)
        progress.finish()
        return answers, sim
    finally:
        await sim.stop()


async def _guarded(
    burst: list[Planned], workdir: Path, tokenizer: Path
) -> tuple[list[Answer], SimServer, int, int]:
    sim = SimServer(ENGINE, model=MODEL, natural_tokens=NATURAL_TOKENS)
    await sim.start()
    path = workdir / "kvguard.yaml"
    path.write_text(yaml.safe_dump(demo_config(sim.url, tokenizer.resolve()), sort_keys=False))
    service = Service(configs.load(path, environ={}))
    await service.start()
    rendered = loopback_config(service.grpc.port, sim.port)
    envoy = EnvoyProcess(rendered, workdir)
    try:
        await envoy.start()
        await envoy.wait_cluster_healthy("kvguard")  # ready once capacity is discovered
        capacity = service.capacities.get("qwen")
        assert capacity is not None
        print(
            f"kvguard    capacity from {sim.url}/metrics: {capacity.blocks} blocks of "
            f"{capacity.block_size} tokens; watermark 0.15 admits up to {capacity.limit(0.15)}"
        )
        stop, peak = asyncio.Event(), [0]
        sampler = asyncio.create_task(_sample_peak(service, stop, peak))
        progress = Progress("kvguard", len(burst))
        answers = await send_all(envoy.url, burst, on_done=progress, retries=RETRIES)
        progress.finish()
        left = await _drained(service)
        stop.set()
        await sampler
        return answers, sim, peak[0], left
    finally:
        await envoy.stop()
        await service.stop(0)
        await sim.stop()


async def _drained(service: Service, timeout_s: float = 5.0) -> int:
    """Blocks still reserved once every lease is released (kvguard releases within 1 s of the
    end of a response; Envoy ends the ext_proc stream just after the client's response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await service.keeper.settle()
        left = (await service.ledger.usage("qwen")).reserved
        if left == 0 or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.02)


async def _sample_peak(service: Service, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], (await service.ledger.usage("qwen")).reserved)
        # A sampling period, not a synchronisation: stop ends the wait at once.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.005)


def _row(answers: list[Answer], sim: SimServer, tenant: str) -> dict[str, str]:
    mine = [a for a in answers if a.planned.tenant == tenant]
    served = [a.latency_s for a in mine if a.ok]
    refused = collections.Counter(f"{a.status} {a.reason}" for a in mine if not a.ok)
    clamped = sum(
        1
        for a in mine
        if a.ok
        and sim.received_limits.get(a.planned.headers["x-sim-tag"])
        != {k: v for k, v in a.planned.body.items() if k in ("max_tokens", "max_completion_tokens")}
    )
    p50, p99 = percentile(served, 0.5), percentile(served, 0.99)
    retried = sum(1 for a in mine if a.ok and a.attempts > 1)
    return {
        "preempted": str(sim.tenant_preemptions.get(tenant, 0)),
        "latency": "-" if p50 is None or p99 is None else f"{p50:.1f} / {p99:.1f} s",
        "served": str(len(served)),
        "retried": str(retried),
        "clamped": str(clamped),
        "refused": ", ".join(f"{n} x {why}" for why, n in refused.most_common()) or "-",
    }


def _table(before: tuple[list[Answer], SimServer], after: tuple[list[Answer], SimServer]) -> str:
    lines = [
        f"{'':<20}{'unguarded: straight to vLLM':<38}{'guarded: Envoy + kvguard'}",
        f"{'tenant':<9}{'tier':<5}{'sent':>5}  {'preempted':>9} {'latency p50/p99':>16} "
        f"{'served':>7}  {'preempted':>9} {'latency p50/p99':>16} {'served':>7} "
        f"{'retried':>7} {'clamped':>7}  refused",
    ]
    for tenant, tier in TIERS.items():
        sent = sum(1 for a in before[0] if a.planned.tenant == tenant)
        b, a = _row(*before, tenant), _row(*after, tenant)
        lines.append(
            f"{tenant:<9}{tier:<5}{sent:>5}  {b['preempted']:>9} {b['latency']:>16} "
            f"{b['served']:>7}  {a['preempted']:>9} {a['latency']:>16} {a['served']:>7} "
            f"{a['retried']:>7} {a['clamped']:>7}  {a['refused']}"
        )
    return "\n".join(lines)


async def _run(requests_per_tenant: int, tokenizer: Path) -> int:
    burst = plan(requests_per_tenant)
    print(
        f"vLLM simulator: {ENGINE.usable_blocks} KV blocks of {ENGINE.block_size} tokens, "
        f"max_num_seqs {ENGINE.max_num_seqs}\nacme (pro): {requests_per_tenant} x 1200 output "
        f"tokens at once; hobbyist (free): {requests_per_tenant} short jokes, 4 a second\n"
        f"guarded: a queue of up to {QUEUE_WAIT_S:g} s before a 429; clients retry a 429 "
        f"{RETRIES} time when told to\n"
    )
    unguarded = await _unguarded(burst)
    with tempfile.TemporaryDirectory(prefix="kvguard-demo-") as tmp:
        answers, sim, peak, left = await _guarded(burst, Path(tmp), tokenizer)
    limit = PoolCapacity(ENGINE.usable_blocks, ENGINE.block_size).limit(0.15)
    print()
    print(_table(unguarded, (answers, sim)))
    print(
        f"\npreemptions (vllm:num_preemptions_total): {unguarded[1].engine.preemptions_total} "
        f"unguarded, {sim.engine.preemptions_total} guarded"
    )
    print(
        f"ledger peak: {peak} of {ENGINE.usable_blocks} blocks reserved (limit {limit}); "
        f"after the burst: {left}"
    )
    failed = [a for a in unguarded[0] + answers if a.error is not None]
    for answer in failed[:3]:
        print(f"transport error: {answer.planned.tenant}: {answer.error}")
    return 0 if left == 0 and not failed else 1


def run_demo(requests_per_tenant: int = 16, tokenizer: Path = TOKENIZER) -> int:
    if not (tokenizer / "tokenizer.json").is_file():
        print(
            f"kvguard demo: no tokenizer.json in {tokenizer.resolve()}: run `make demo` in a "
            "kvguard checkout (it fetches the tokenizer files), or give --tokenizer DIR with "
            "Qwen2.5's tokenizer files",
            file=sys.stderr,
        )
        return 1
    import uvloop

    logging.getLogger().setLevel(logging.WARNING)  # the table says it all; warnings still show
    return uvloop.run(_run(requests_per_tenant, tokenizer))
