"""Real redis-server processes on loopback ports, for the tests and the ledger benchmark.

`RedisServer` runs one `redis-server` without persistence on a free 127.0.0.1 port and can stop
and start again on that same port (an outage, and a restart that comes back empty).
`RedisCluster` runs three masters joined with `redis-cli --cluster create`. Both wait on
conditions with deadlines (PING answered, `cluster_state:ok`), never on fixed sleeps, and never
touch a Redis the machine may already run on 6379.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from kvguard.testing import LOOPBACK

_POLL_S = 0.02
_START_DEADLINE_S = 10.0
_CLUSTER_DEADLINE_S = 30.0
_DEFAULT_PORT = 6379  # the machine's own Redis, if any: never ours
_CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus listens on port + 10000


class RedisProcessError(RuntimeError):
    """redis-server failed to start, exited, or did not reach the expected state in time."""


def require_binaries() -> None:
    """Raise RedisProcessError naming the fix when redis-server or redis-cli is missing."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        raise RedisProcessError(
            f"{' and '.join(missing)} not found: run tools/ensure_redis.sh "
            "(apt-get install redis-server)"
        )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port that is free now (and, for a cluster node, free at port + 10000 too)."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        if port == _DEFAULT_PORT or not _port_free(port):
            continue
        if with_cluster_bus and not _port_free(port + _CLUSTER_BUS_OFFSET):
            continue
        return port
    raise RedisProcessError("no free loopback port found")


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis on `port` answers PING (raw RESP: no client library needed); one with
    a password answers that it wants it."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1:`port` (a free one by default), no RDB, no AOF.

    `start` waits until PING is answered; `stop` ends the process (its data is gone: nothing is
    persisted); `start` again brings it back, empty, on the same port. With `password`, clients
    must give it (`requirepass`), and `url` holds it.
    """

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        *,
        cluster: bool = False,
        password: str | None = None,
    ) -> None:
        require_binaries()
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(with_cluster_bus=cluster)
        if self.port == _DEFAULT_PORT:
            raise RedisProcessError("port 6379 belongs to the machine's own Redis")
        self.cluster = cluster
        self.password = password
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}{LOOPBACK}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.folder / "redis.log"

    def _command(self) -> list[str]:
        command = [
            "redis-server",
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.folder),
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.password:
            command += ["--requirepass", self.password]
        if self.cluster:
            command += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return command

    def start(self) -> None:
        """Start the process and wait until it answers; try other ports if one was taken."""
        for attempt in range(3):
            if self._try_start():
                return
            if self._fixed_port or attempt == 2:
                break
            self.port = free_port(with_cluster_bus=self.cluster)
        raise RedisProcessError(f"redis-server did not start on {self.port}: {self.log_tail()}")

    def _try_start(self) -> bool:
        if self.running:
            raise RedisProcessError(f"redis-server on {self.port} is already running")
        if self.cluster:
            # A node that starts again must be a new, empty node.
            (self.folder / "nodes.conf").unlink(missing_ok=True)
        self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            self._command(), stdout=self._log, stderr=subprocess.STDOUT, cwd=self.folder
        )
        deadline = time.monotonic() + _START_DEADLINE_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._reap()
                return False  # most likely the port was taken in the meantime
            if _ping(self.port):
                return True
            time.sleep(_POLL_S)
        self.stop()
        return False

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """End the process (SIGKILL after 5 s of SIGTERM) and wait until the port is closed."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reap()
        deadline = time.monotonic() + _START_DEADLINE_S
        while _ping(self.port):
            if time.monotonic() > deadline:
                raise RedisProcessError(f"something still answers on {self.port}")
            time.sleep(_POLL_S)

    def _reap(self) -> None:
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        """Stop, then start empty on the same port."""
        self.stop()
        fixed, self._fixed_port = self._fixed_port, True
        try:
            self.start()
        finally:
            self._fixed_port = fixed

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def cli(self, *args: str) -> str:
        """Run `redis-cli -p PORT ARGS...` and return its output; raise on failure."""
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        done = subprocess.run(
            ["redis-cli", "-h", LOOPBACK, "-p", str(self.port), *auth, *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode != 0:
            raise RedisProcessError(f"redis-cli {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def flushall(self) -> None:
        """Empty the server (tests share one)."""
        self.cli("flushall")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.stop()


class RedisCluster:
    """A Redis Cluster of `masters` (≥ 3) master nodes and no replicas, on loopback ports."""

    def __init__(self, folder: Path, masters: int = 3) -> None:
        if masters < 3:
            raise ValueError("Redis Cluster needs at least 3 masters")
        self.nodes = [RedisServer(folder / f"node{i}", cluster=True) for i in range(masters)]

    @property
    def url(self) -> str:
        """A seed node's URL; the client discovers the rest."""
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> None:
        """Start the nodes, join them, and wait until every node reports cluster_state:ok."""
        try:
            for node in self.nodes:
                node.start()
            nodes = [f"{LOOPBACK}:{port}" for port in self.ports]
            options = ["--cluster-replicas", "0", "--cluster-yes"]
            create = subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, *options],
                capture_output=True,
                text=True,
                timeout=_CLUSTER_DEADLINE_S,
                check=False,
            )
            if create.returncode != 0:
                raise RedisProcessError(f"redis-cli --cluster create failed: {create.stdout}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + _CLUSTER_DEADLINE_S
        while True:
            infos = [node.cli("cluster", "info") for node in self.nodes]
            if all(
                "cluster_state:ok" in info
                and "cluster_slots_ok:16384" in info
                and f"cluster_known_nodes:{len(self.nodes)}" in info
                for info in infos
            ):
                return
            if time.monotonic() > deadline:
                raise RedisProcessError(f"cluster not ok within {_CLUSTER_DEADLINE_S}s: {infos}")
            time.sleep(_POLL_S * 5)

    def flushall(self) -> None:
        """Empty every master (tests share one cluster)."""
        for node in self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.stop()
