"""Capacity discovery from /metrics that demand a Bearer key (`capacity.api_key_file`): an
aiohttp server on 127.0.0.1 that answers the real vLLM text only to the key it expects."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvguard import config as configs
from kvguard.admission.capacity import Capacities, PoolCapacity
from kvguard.admission.policy import build
from kvguard.ops.discovery import Discovery
from kvguard.ops.scrape import read_credential
from tests.conftest import kvguard_config, write_config
from tests.ops.fakes import FakeVllm

KEY = "vllm-key-0123456789abcdef"


class GuardedMetrics(FakeVllm):
    """/metrics for `Authorization: Bearer <key>` only (401 otherwise), recording what each
    request sent; `redirect_to` makes it answer 302 to that URL instead."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.seen: list[str | None] = []  # the Authorization header of each request
        self.redirect_to: str | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.seen.append(request.headers.get("Authorization"))
        if self.redirect_to is not None:
            raise web.HTTPFound(self.redirect_to)
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.Response(status=401, text='{"error": "Unauthorized"}')
        return await super()._metrics(request)


@asynccontextmanager
async def guarded(*keys: str) -> AsyncIterator[list[GuardedMetrics]]:
    async with AsyncExitStack() as stack:
        servers = []
        for key in keys:
            server = GuardedMetrics(key)
            await server.start()
            stack.push_async_callback(server.stop)
            servers.append(server)
        yield servers


class Pool:
    """The pool `qwen` discovered from `urls`, asked with the key in `api_key_file`."""

    def __init__(self, tmp_path: Path, urls: list[str], api_key_file: Path | None) -> None:
        data = kvguard_config()
        data["pools"][0]["capacity"] = {"endpoints": urls}
        if api_key_file is not None:
            data["pools"][0]["capacity"]["api_key_file"] = str(api_key_file)
        policy = build(configs.load(write_config(tmp_path, data), environ={}))
        self.capacities = Capacities()
        self.discovery = Discovery(lambda: policy, self.capacities)

    async def refresh(self) -> PoolCapacity | None:
        """One round over every endpoint; the capacity it published (its pods left out: one
        endpoint here)."""
        async with aiohttp.ClientSession() as session:
            await self.discovery.refresh(session)
        capacity = self.capacities.get("qwen")
        return None if capacity is None else replace(capacity, pods=())

    @property
    def unknown(self) -> str:
        return self.discovery.unknown()["qwen"]


async def test_the_key_file_is_sent_as_a_bearer_key(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")  # a Secret written from a file ends with a newline
    async with guarded(KEY) as (vllm,):
        assert await Pool(tmp_path, [vllm.url], key_file).refresh() == PoolCapacity(63, 128)
    assert vllm.seen == [f"Bearer {KEY}"]


async def test_without_the_key_a_guarded_endpoint_is_a_failing_one(tmp_path: Path) -> None:
    async with guarded(KEY) as (vllm,):
        pool = Pool(tmp_path, [vllm.url], None)
        assert await pool.refresh() is None
        assert pool.unknown.endswith("/metrics answered HTTP 401)")
        # Named but absent (its Secret not mounted): nothing is sent, and the reason says so.
        absent = tmp_path / "absent"
        pool = Pool(tmp_path, [vllm.url], absent)
        assert await pool.refresh() is None
        assert f"HTTP 401 (no key sent: capacity.api_key_file {absent} does not exist)" in (
            pool.unknown
        )
    assert vllm.seen == [None, None]


async def test_a_rotated_key_is_read_at_the_next_refresh(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("old-key")
    async with guarded("old-key") as (vllm,):
        pool = Pool(tmp_path, [vllm.url], key_file)
        assert await pool.refresh() == PoolCapacity(63, 128)
        vllm.key = "new-key"
        key_file.write_text("new-key")
        assert await pool.refresh() == PoolCapacity(63, 128)  # refresh() ignores the interval
        assert pool.discovery.unknown() == {}
    assert vllm.seen == ["Bearer old-key", "Bearer new-key"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [("", "is empty"), ("  \n", "is empty"), ("one\ntwo\n", "holds more than one line")],
)
async def test_an_unusable_key_file_asks_no_endpoint(
    tmp_path: Path, content: str, reason: str
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(content)
    async with guarded(KEY) as (vllm,):
        pool = Pool(tmp_path, [vllm.url], key_file)
        assert await pool.refresh() is None
    assert f"capacity.api_key_file {key_file} {reason}" in pool.unknown
    assert vllm.seen == []


async def test_a_key_is_never_carried_by_a_redirect(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    async with guarded(KEY, KEY) as (vllm, elsewhere):
        vllm.redirect_to = f"{elsewhere.url}/metrics"
        pool = Pool(tmp_path, [vllm.url], key_file)
        assert await pool.refresh() is None
    assert "/metrics answered HTTP 302" in pool.unknown
    assert elsewhere.seen == []


async def test_the_key_appears_in_no_log_line_and_no_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    async with guarded("another-key") as (vllm,):
        pool = Pool(tmp_path, [vllm.url], key_file)
        with caplog.at_level(logging.DEBUG, logger="kvguard.ops.discovery"):
            assert await pool.refresh() is None
    assert vllm.seen == [f"Bearer {KEY}"]
    assert caplog.records and KEY not in caplog.text
    assert KEY not in pool.unknown
    assert KEY not in repr(read_credential(str(key_file)))


def test_an_unreadable_key_file_is_named_not_quoted(tmp_path: Path) -> None:
    credential = read_credential(str(tmp_path))  # a folder, not a file
    assert credential.headers == {}
    assert credential.error is not None
    assert credential.error.startswith(f"capacity.api_key_file {tmp_path} cannot be read: ")
