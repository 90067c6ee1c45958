"""Shared test fixtures: the real tokenizers, configuration files written per test, a recording
upstream and a refusing port."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.testing.upstream import RecordingUpstream
from kvguard.tokens.tokenizer import PoolTokenizer

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / ".cache" / "models"


def model_dir(name: str) -> Path:
    folder = MODELS / name
    if not (folder / "tokenizer.json").is_file():
        pytest.fail(f"{folder} is missing: run `python tools/fetch_tokenizers.py` (make test does)")
    return folder


def kvguard_config(
    *,
    grpc_port: int = 0,
    blocks: int = 1000,
    block_size: int = 16,
    watermark: float = 0.15,
    max_model_len: int = 4096,
    tiers: dict[str, Any] | None = None,
    tenants: dict[str, str] | None = None,
    default_tier: str | None = "free",
    shadow: bool = False,
    expose_limit_header: bool = True,
    retry_after_max_seconds: float = 30.0,
    **server: Any,
) -> dict[str, Any]:
    """A configuration with one pool `qwen` (model "qwen") on the real Qwen tokenizer. Its
    429s promise retries (`retry_after_max_seconds`, 0 by default in kvguard): what the tests
    of refusals read."""
    return {
        "server": {"grpc_listen": f"127.0.0.1:{grpc_port}", "metrics_listen": "", **server},
        "ledger": {"url": "memory://", "lease_seconds": 60},
        "tenancy": {
            "header": "x-tenant-id",
            "default_tier": default_tier,
            "tiers": tiers
            or {
                "free": {"max_tokens_cap": 64, "default_max_tokens": 32, "max_blocks": 40},
                "pro": {"max_tokens_cap": 512, "default_max_tokens": 128, "max_blocks": 400},
            },
            "tenants": tenants if tenants is not None else {"acme": "pro", "globex": "pro"},
            "expose_limit_header": expose_limit_header,
        },
        "shadow": shadow,
        "pools": [
            {
                "name": "qwen",
                "models": ["qwen"],
                "tokenizer": str(model_dir("qwen")),
                "max_model_len": max_model_len,
                "watermark": watermark,
                "capacity": {"blocks": blocks, "block_size": block_size},
                "retry_after_max_seconds": retry_after_max_seconds,
            }
        ],
    }


def write_config(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "kvguard.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# The real tokenizers, and transformers' as the reference, loaded once per session.
@pytest.fixture(scope="session")
def qwen() -> PoolTokenizer:
    return PoolTokenizer.load(model_dir("qwen"))


@pytest.fixture(scope="session")
def qwen_hf() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir("qwen"))


@pytest.fixture(scope="session")
def llama() -> PoolTokenizer:
    return PoolTokenizer.load(model_dir("llama3.2"))


@pytest.fixture(scope="session")
def llama_hf() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir("llama3.2"))


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    server = RecordingUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# Fixtures that start a redis-server: a test that uses one must carry the `redis` marker, so
# that `-m "not redis"` really runs without Redis.
REDIS_FIXTURES = frozenset({"redis_server", "redis_cluster"})  # the others build on these


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if REDIS_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("redis") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start a redis-server need @pytest.mark.redis: " + ", ".join(unmarked)
        )
