"""gRPC's core does its I/O on the thread that polls its completion queue (kvguard/ops/grpc_io.py):
while `kvguard serve` answers ext_proc streams, its EventEngine threads do none of the work,
unless GRPC_EXPERIMENTS in its environment says otherwise. Fails when the pinned grpcio stops
knowing or honouring the experiments kvguard turns off."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard.testing import free_port
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers
from tests.processes import kvguard_serve

pytestmark = pytest.mark.integration

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}]}
# Streams are answered until the process has spent this much CPU (0.4 s), whatever the host's
# speed: where EventEngine threads do the I/O they take ~10-15 % of it (~5 ticks).
SPENT_TICKS = 40


def cpu_ticks_by_thread_name(pid: int) -> Counter[str]:
    ticks: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        ticks[task.joinpath("comm").read_text().strip()] += int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.parametrize(
    ("experiments", "event_engine_io"),
    [(None, False), ("", True)],
    ids=["kvguard's default", "GRPC_EXPERIMENTS set empty"],
)
async def test_io_runs_on_the_polling_thread(
    tmp_path: Path, experiments: str | None, event_engine_io: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if experiments is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    port = free_port()
    config = write_config(tmp_path, kvguard_config(grpc_port=port))
    log = tmp_path / "kvguard.log"
    async with kvguard_serve(config, port, log, env) as process:
        before = cpu_ticks_by_thread_name(process.pid)
        spent: Counter[str] = Counter()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def spent_enough() -> bool:
                """Answer 50 more streams, then look at the CPU the process has spent."""
                nonlocal spent
                for _ in range(50):
                    call, (_, answer) = await exchange(
                        stub, headers("/v1/chat/completions"), body(CHAT)
                    )
                    assert answer.WhichOneof("response") == "request_body"
                    call.cancel()
                spent = cpu_ticks_by_thread_name(process.pid) - before
                return spent.total() >= SPENT_TICKS

            await wait_until(
                spent_enough,
                lambda: f"{SPENT_TICKS} ticks spent answering streams (spent: {spent})",
                timeout_s=60,
                poll_s=0,
            )
    assert "Unknown experiment" not in log.read_text()
    if event_engine_io:
        assert spent["event_engine"] >= 2, spent
    else:
        assert spent["event_engine"] <= 1, spent  # a timer's wake-up at most
