"""`kvguard serve` says which malloc it runs on: the image preloads jemalloc (Dockerfile)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

JEMALLOC = ctypes.util.find_library("jemalloc")  # e.g. libjemalloc.so.2 (Debian's libjemalloc2)


def _allocator_with(preload: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload is not None:
        env["LD_PRELOAD"] = preload
    code = "from kvguard.app import allocator; print(allocator())"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_glibc_malloc_is_reported_as_system() -> None:
    assert _allocator_with(None) == "system"


@pytest.mark.skipif(JEMALLOC is None, reason="libjemalloc is not installed on this machine")
def test_preloaded_jemalloc_is_reported() -> None:
    assert _allocator_with(JEMALLOC) == "jemalloc"
