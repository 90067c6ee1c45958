"""The gRPC server: ext_proc and grpc.health.v1 on one port, plaintext or TLS."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvguard.extproc.service import ExternalProcessor
from kvguard.ops.health import Health

# Health service names: "", "readiness" and the ext_proc service mean "ready to admit";
# "liveness" means "the process serves at all", so an outage never restart-loops kvguard. The
# named ones are those an InferencePool's endpoint picker answers (GIE's probes and gateways).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
LIVENESS_SERVICE = "liveness"

# grpc's own grace is set this much longer than the drain's, so that kvguard counts the streams
# still open before anything cuts them.
CUT_MARGIN_S = 5.0

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Adds one more gRPC service to the server (the composition root passes the admin API).
AddService = Callable[[grpc.aio.Server], None]


def load_tls(certificate_file: str, key_file: str) -> tuple[bytes, bytes]:
    """The key and certificate chain a TLS port serves, checked to be a certificate and its
    key: OSError (ssl.SSLError for a bad pair) saying which files, before any port is bound."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certificate_file, key_file)
    except ssl.SSLError as exc:
        raise ssl.SSLError(
            f"server.tls: {certificate_file} and {key_file} are not a PEM certificate and its "
            f"key ({exc.reason or exc})"
        ) from None
    return Path(key_file).read_bytes(), Path(certificate_file).read_bytes()


class GrpcServer:
    def __init__(
        self,
        listen: str,
        processor: ExternalProcessor,
        health: Health,
        max_message_bytes: int,
        services: Iterable[AddService] = (),
        *,
        reuse_port: bool = False,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        """`tls`: the key and certificate chain (load_tls) to serve TLS with; None: plaintext."""
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # Only workers share a port; otherwise a second process must fail to bind.
                ("grpc.so_reuseport", 1 if reuse_port else 0),
            ]
        )
        self._processor = processor
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, self._server)
        for add in services:
            add(self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        try:
            if tls is None:
                self.port = self._server.add_insecure_port(listen)
            else:
                credentials = grpc.ssl_server_credentials([tls])
                self.port = self._server.add_secure_port(listen, credentials)
        except RuntimeError:  # grpc's way of saying the address is taken or invalid
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {listen}")
        self._state = health
        self._pending: set[asyncio.Task[None]] = set()
        health.subscribe(self._on_readiness)

    def _on_readiness(self, _ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._publish())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self) -> None:
        # Read the state at each write, so that the last write always carries the latest.
        for service in READINESS_SERVICES:
            await self._health.set(service, _SERVING if self._state.ready else _NOT_SERVING)

    async def start(self) -> None:
        await self._health.set(LIVENESS_SERVICE, _SERVING)
        await self._server.start()

    async def stop(self, grace_s: float) -> int:
        """Refuse new streams, give open ones `grace_s` seconds to finish, then cut the rest.

        Returns how many ext_proc streams were still open at the end of the grace (cut)."""
        # gRPC's own stop refuses new streams at once and ends once every call it took has ended,
        # one whose handler has not started yet included (kvguard's count cannot see that one).
        # Its grace is longer than ours so that nothing is cut before it is counted.
        graceful = asyncio.ensure_future(self._server.stop(grace_s + CUT_MARGIN_S))
        await asyncio.wait({graceful}, timeout=grace_s)
        cut = 0
        if not graceful.done():
            cut = self._processor.open_streams
            await self._server.stop(None)  # grpc: a later call with a shorter grace stops sooner
        await graceful
        return cut
