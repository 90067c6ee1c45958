"""`kvguard demo`: the real Envoy + kvguard (memory ledger) + a local OpenAI-style upstream.

Two tenants send one burst: `acme` (tier pro) asks for far more output than its tier allows,
`hobbyist` (unmapped, so the default tier free) sends many small requests at once. The demo
prints, per tenant, what was admitted, clamped and refused (with reasons), and the ledger's
peak reserved blocks against the pool's capacity.
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvguard import config as configs
from kvguard.capacity import PoolCapacity
from kvguard.server import Service
from kvguard.testing.envoy import SHIPPED_CONFIG, EnvoyProcess, render_envoy_config
from kvguard.testing.upstream import RecordingUpstream

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / ".cache" / "models" / "qwen"
MODEL = "qwen2.5-7b-instruct"
CAPACITY_BLOCKS = 520
BLOCK_SIZE = 16
LIMIT = PoolCapacity(CAPACITY_BLOCKS, BLOCK_SIZE).limit(0.15)

DEMO_CONFIG: dict[str, Any] = {
    "server": {"grpc_listen": "127.0.0.1:0", "metrics_listen": ""},
    "ledger": {"url": "memory://", "lease_seconds": 120},
    "tenancy": {
        "header": "x-tenant-id",
        "default_tier": "free",
        "tiers": {
            "free": {"max_tokens_cap": 256, "default_max_tokens": 128, "max_blocks": 120},
            "pro": {"max_tokens_cap": 1024, "default_max_tokens": 512, "max_blocks": 400},
        },
        "tenants": {"acme": "pro"},
    },
    "pools": [
        {
            "name": "qwen",
            "models": [MODEL],
            "tokenizer": str(TOKENIZER),
            "max_model_len": 32768,
            "watermark": 0.15,  # LIMIT above uses the same
            "capacity": {"blocks": CAPACITY_BLOCKS, "block_size": BLOCK_SIZE},
        }
    ],
}


@dataclass
class TenantTally:
    sent: int = 0
    admitted: int = 0
    clamped: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)


def _burst(requests_per_tenant: int) -> list[tuple[str, dict[str, Any]]]:
    question = "Summarise the plot of a long novel about a lighthouse keeper. " * 8
    burst = []
    for i in range(requests_per_tenant):
        burst.append(
            (
                "acme",
                {
                    "model": MODEL,
                    "max_tokens": 8000,
                    "stream": True,
                    "messages": [
                        {"role": "system", "content": "Be thorough."},
                        {"role": "user", "content": f"{i}: {question}"},
                    ],
                },
            )
        )
        burst.append(
            (
                "hobbyist",
                {
                    "model": MODEL,
                    "stream": True,
                    "messages": [{"role": "user", "content": f"Joke #{i}, please"}],
                },
            )
        )
    return burst


async def _send(
    http: aiohttp.ClientSession, url: str, tenant: str, body: dict[str, Any], demo_id: str
) -> tuple[int, str]:
    headers = {"x-tenant-id": tenant, "x-demo-id": demo_id}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status, response.headers.get("x-kvguard-reason", "")


async def _sample_peak(service: Service, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], (await service.ledger.usage("qwen")).reserved)
        await asyncio.sleep(0.005)


async def _run(requests_per_tenant: int) -> int:
    with tempfile.TemporaryDirectory(prefix="kvguard-demo-") as tmp:
        workdir = Path(tmp)
        path = workdir / "kvguard.yaml"
        path.write_text(yaml.safe_dump(DEMO_CONFIG, sort_keys=False))
        service = Service(configs.load(path, environ={}))
        await service.start()
        upstream = RecordingUpstream(token_delay=0.002)
        await upstream.start()
        envoy = EnvoyProcess(
            render_envoy_config(
                SHIPPED_CONFIG,
                listen_port=0,
                admin_port=0,
                kvguard_port=service.grpc.port,
                upstream_port=upstream.port,
            ),
            workdir,
        )
        try:
            await envoy.start()
            await envoy.wait_cluster_healthy("kvguard")
            print(
                f"Envoy {envoy.url} -> kvguard 127.0.0.1:{service.grpc.port} "
                f"-> upstream {upstream.url}"
            )
            print(
                f"pool qwen: {CAPACITY_BLOCKS} blocks of {BLOCK_SIZE} tokens, watermark 0.15 "
                f"(admits up to {LIMIT} blocks)\n"
            )
            return await _replay(service, upstream, envoy, requests_per_tenant)
        finally:
            await envoy.stop()
            await upstream.stop()
            await service.stop(0)


async def _replay(
    service: Service, upstream: RecordingUpstream, envoy: EnvoyProcess, requests_per_tenant: int
) -> int:
    burst = _burst(requests_per_tenant)
    tallies: dict[str, TenantTally] = collections.defaultdict(TenantTally)
    sent: dict[str, dict[str, Any]] = {}
    stop, peak = asyncio.Event(), [0]
    sampler = asyncio.create_task(_sample_peak(service, stop, peak))
    async with aiohttp.ClientSession() as http:
        tasks = []
        for tenant, body in burst:
            demo_id = uuid.uuid4().hex
            sent[demo_id] = body
            tasks.append(_send(http, envoy.url, tenant, body, demo_id))
            tallies[tenant].sent += 1
        results = await asyncio.gather(*tasks)
    await service.keeper.settle()
    stop.set()
    await sampler
    for (tenant, _), (status, reason) in zip(burst, results, strict=True):
        if status == 200:
            tallies[tenant].admitted += 1
        else:
            tallies[tenant].refused[f"{status} {reason}"] += 1
    for seen in upstream.requests:
        original = sent[seen.headers["x-demo-id"]]
        if original.get("max_tokens") != seen.json().get("max_tokens"):
            tallies[seen.headers["x-tenant-id"]].clamped += 1
    _print_table(tallies)
    left = (await service.ledger.usage("qwen")).reserved
    print(
        f"\nledger peak: {peak[0]} of {CAPACITY_BLOCKS} blocks reserved "
        f"(limit {LIMIT}); after the burst: {left}"
    )
    return 0 if left == 0 else 1


def _print_table(tallies: dict[str, TenantTally]) -> None:
    print(f"{'tenant':<10} {'tier':<5} {'sent':>5} {'admitted':>9} {'clamped':>8}  refused")
    for tenant, tally in tallies.items():
        tier = DEMO_CONFIG["tenancy"]["tenants"].get(tenant, "free")
        refused = ", ".join(f"{n} x {why}" for why, n in tally.refused.most_common()) or "-"
        print(
            f"{tenant:<10} {tier:<5} {tally.sent:>5} {tally.admitted:>9} {tally.clamped:>8}  "
            f"{refused}"
        )


def run_demo(requests_per_tenant: int = 24) -> int:
    if not (TOKENIZER / "tokenizer.json").is_file():
        print(f"missing {TOKENIZER}: run `make demo` (it fetches the tokenizer files)")
        return 1
    import uvloop

    return uvloop.run(_run(requests_per_tenant))
