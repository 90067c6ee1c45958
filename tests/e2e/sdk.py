"""What the SDK tests share (test_openai_sdk.py, test_anthropic_sdk.py, test_refusals.py): the
gateway's limits, an openai client through it, a reservation held directly in the ledger, a pool
whose capacity cannot be known, and calls made after a setup step."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import openai

from kvguard.ledger import Claim
from tests.gateway import Gateway

MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 4000


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def client(gw: Gateway, tenant: str | None = "acme") -> openai.AsyncOpenAI:
    headers = {"x-tenant-id": tenant} if tenant else {}
    return openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, default_headers=headers
    )


async def hold(gw: Gateway, tenant: str, blocks: int) -> None:
    """Reserve `blocks` of pool qwen for `tenant` directly in the ledger, as a request in
    flight would, expected to end in 10 s (whatever a case before promised a retry)."""
    claim = Claim(uuid.uuid4().hex, "qwen", tenant, blocks, 10**6, 10**6, 60, ends_in_s=10.0)
    assert (await gw.service.ledger.reserve(claim)).lease is not None


def with_a_pool_of_unknown_capacity(data: dict[str, Any]) -> None:
    ghost = {**data["pools"][0], "name": "ghost", "models": ["ghost"]}
    ghost["capacity"] = {"endpoints": [f"http://127.0.0.1:{refused_port()}"]}
    data["pools"].append(ghost)


Call = Callable[[Gateway], Awaitable[Any]]


def after(setup: Callable[[Gateway], Awaitable[None]], call: Call) -> Call:
    async def both(gw: Gateway) -> Any:
        await setup(gw)
        return await call(gw)

    return both
