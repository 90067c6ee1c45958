"""server.workers > 1: one Prometheus endpoint per pod, on metrics_listen, served by the supervisor.

Each worker serves its own exposition on an ephemeral loopback port and writes that port to a
pipe the supervisor made before the fork (kvguard.ops.worker_metrics). On every scrape, and
every READ_EVERY_S between scrapes, the supervisor reads every live worker at once (loopback,
READ_TIMEOUT_S) and answers with their merge (kvguard.ops.metrics_merge). A worker killed
outright loses from the pod's totals what it counted since the supervisor last read it: at most
READ_EVERY_S of it. An answer shorter than its Content-Length (a worker killed mid-answer) is
no answer: the worker's last reading stands.

All of it runs on the supervisor's one thread, from its select loop (kvguard.ops.workers): the
supervisor forks workers again, and a fork copies no thread.
"""

from __future__ import annotations

import io
import logging
import selectors
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric

from kvguard.ops.metrics_merge import PodMetrics
from kvguard.ops.worker_metrics import LOOPBACK

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger(__name__)

# Between scrapes, how often the supervisor reads its workers: what a killed worker can lose.
READ_EVERY_S = 5.0
# How long a scrape waits for the workers' expositions (all read at once).
READ_TIMEOUT_S = 2.0
# How long one scrape may hold the supervisor's loop, its request and its answer together.
SCRAPER_TIMEOUT_S = 5.0
_REQUEST = b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"


def read_expositions(ports: Mapping[int, int], timeout_s: float) -> dict[int, str | None]:
    """GET /metrics from each worker's loopback port at once: worker -> its exposition, or None
    where it did not answer 200 within `timeout_s`."""
    answers: dict[int, str | None] = dict.fromkeys(ports)
    received = {worker: bytearray() for worker in ports}
    sockets: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        try:
            for worker, port in ports.items():
                sock = sockets[worker] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.connect_ex((LOOPBACK, port))
                selector.register(sock, selectors.EVENT_WRITE, worker)
            deadline = time.monotonic() + timeout_s
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    worker = key.data
                    answered = _step(selector, sockets[worker], worker, received[worker])
                    if answered is not None:
                        selector.unregister(sockets[worker])
                        answers[worker] = _body(received[worker]) if answered else None
        finally:
            for sock in sockets.values():
                sock.close()
    return answers


def _step(
    selector: selectors.BaseSelector, sock: socket.socket, worker: int, into: bytearray
) -> bool | None:
    """One step of one worker's request: None while under way, True once the answer is in
    full, False when the connection failed."""
    try:
        if selector.get_key(sock).events & selectors.EVENT_WRITE:
            sock.sendall(_REQUEST)  # far below a socket buffer: sent at once
            selector.modify(sock, selectors.EVENT_READ, worker)
            return None
        chunk = sock.recv(1 << 16)
    except OSError:  # refused (the worker is gone), reset
        return False
    into += chunk
    return None if chunk else True


def _body(response: bytearray) -> str | None:
    """An HTTP/1.0 response's body when its status is 200 and it is whole: as long as its
    Content-Length says (a worker killed mid-answer closes early, on a text that may parse)."""
    head, _, body = bytes(response).partition(b"\r\n\r\n")
    status_line, *fields = head.split(b"\r\n")
    status = status_line.split()
    ok = len(status) >= 2 and status[1] == b"200"
    whole = _content_length(fields) == len(body)
    return body.decode(errors="replace") if ok and whole else None


def _content_length(fields: list[bytes]) -> int | None:
    for line in fields:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


class _Deadline:
    """One scrape's deadline, set on its socket as a timeout before each read and each write:
    a timeout per read alone lets a scraper that trickles bytes hold the loop for ever."""

    def __init__(self, sock: socket.socket, seconds: float, clock: Callable[[], float]) -> None:
        self.sock, self._clock = sock, clock
        self._at = clock() + seconds

    def arm(self) -> socket.socket:
        left = self._at - self._clock()
        if left <= 0:
            raise TimeoutError("the scrape ran past its deadline")
        self.sock.settimeout(left)
        return self.sock


class _DeadlineIO(io.RawIOBase):
    """The scrape's socket as a file, each read and write within the deadline."""

    def __init__(self, deadline: _Deadline) -> None:
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        return self._deadline.arm().recv_into(buffer)

    def write(self, data: ReadableBuffer) -> int:
        self._deadline.arm().sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class _ScrapeHandler(WSGIRequestHandler):
    def setup(self) -> None:
        """StreamRequestHandler.setup's files, each read and write within the deadline."""
        server = cast(_PodServer, self.server)
        self.connection = self.request
        deadline = _Deadline(self.connection, server.deadline_s, server.clock)
        self.rfile = io.BufferedReader(_DeadlineIO(deadline))
        self.wfile = io.BufferedWriter(_DeadlineIO(deadline))

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged."""


class _PodServer(WSGIServer):
    """metrics_listen's HTTP server: a WSGIServer of the address's family (IPv4 or IPv6), each
    scrape within `deadline_s` of `clock`."""

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        deadline_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.address_family = family
        self.deadline_s, self.clock = deadline_s, clock
        super().__init__(address, _ScrapeHandler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A scrape that failed (too slow, the scraper gone) is one log line, no traceback."""
        log.warning("scrape from %s cut: %r", client_address, sys.exception())


class PodEndpoint:
    """metrics_listen, bound at once (a taken port fails before any worker starts), answered
    one request at a time from the supervisor's loop (`fileno`, `serve_one`)."""

    def __init__(
        self,
        listen: str,
        *,
        read: Callable[[Mapping[int, int], float], dict[int, str | None]] = read_expositions,
        clock: Callable[[], float] = time.monotonic,
        scraper_timeout_s: float = SCRAPER_TIMEOUT_S,
    ) -> None:
        self.pod = PodMetrics()
        self._ports: dict[int, int] = {}  # live worker index -> its exposition's port
        self._read, self._clock = read, clock
        self._next_read = clock() + READ_EVERY_S
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # collect() is all a collector needs
        self._server = _bind(listen, scraper_timeout_s, clock)
        self._server.set_app(make_wsgi_app(registry))

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def fileno(self) -> int:
        return self._server.fileno()

    def serve_one(self) -> None:
        """Answer the scrape waiting on the listening socket (collect() reads the workers)."""
        self._server.handle_request()

    def collect(self) -> Iterable[Metric]:
        self.read_workers()
        return self.pod.collect()

    def serving(self, worker: int, port: int) -> None:
        self._ports[worker] = port

    def died(self, worker: int) -> None:
        self._ports.pop(worker, None)
        self.pod.died(worker)

    def restarted(self) -> None:
        self.pod.restarts += 1

    def read_workers(self) -> None:
        self.pod.read_round(self._read(self._ports, READ_TIMEOUT_S))
        self._next_read = self._clock() + READ_EVERY_S

    def seconds_to_read(self) -> float:
        """Seconds until the workers are due to be read again (0 when due)."""
        return max(0.0, self._next_read - self._clock())

    def close(self) -> None:
        self._server.server_close()


def _bind(listen: str, deadline_s: float, clock: Callable[[], float]) -> _PodServer:
    host, _, port = listen.rpartition(":")
    family, _, _, _, address = socket.getaddrinfo(
        host or "0.0.0.0", int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server = _PodServer((str(address[0]), int(port)), family, deadline_s, clock)
    server.timeout = 0  # serve_one runs when the socket is readable: never wait in accept
    server.socket.setblocking(False)
    return server
