"""The supervisor's side of the workers' expositions over real loopback sockets: an answer cut
short by a worker's death, and a scraper that trickles its request."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from kvguard.ops.pod_endpoint import PodEndpoint, read_expositions
from tests.ops.scrape import serve_the_scrape

BODY = b'# TYPE kvguard_admissions_total counter\nkvguard_admissions_total{pool="a"} 123456\n'
ANSWER = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
WHOLE = ANSWER + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY
CUT = WHOLE[:-4]  # a worker killed mid-answer: `... 123`, which still parses
ADMITTED = ("kvguard_admissions_total", (("pool", "a"),))


@contextmanager
def worker_answering(*answers: bytes) -> Iterator[int]:
    """A worker's exposition port (yielded) that answers its next GETs with `answers`, each
    sent as it is and then closed."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            for answer in answers:
                connection, _ = listener.accept()
                with connection:
                    request = b""
                    while b"\r\n\r\n" not in request and (chunk := connection.recv(1024)):
                        request += chunk
                    connection.sendall(answer)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        yield listener.getsockname()[1]
        server.join(5)


def test_an_answer_shorter_than_its_content_length_is_no_answer() -> None:
    with worker_answering(WHOLE, CUT) as port:
        assert read_expositions({0: port}, 2.0) == {0: BODY.decode()}
        assert read_expositions({0: port}, 2.0) == {0: None}


def test_a_cut_answer_leaves_the_last_good_reading_to_count_after_the_worker_dies() -> None:
    endpoint = PodEndpoint("127.0.0.1:0")
    try:
        with worker_answering(WHOLE, CUT) as port:
            endpoint.serving(0, port)
            endpoint.read_workers()
            endpoint.read_workers()
        endpoint.died(0)
        merged = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in endpoint.pod.collect()
            for s in family.samples
        }
        assert merged[ADMITTED] == 123456
    finally:
        endpoint.close()


def test_a_scraper_that_trickles_its_request_is_cut_at_the_scrapes_deadline() -> None:
    """However often its bytes come, a scrape holds the supervisor's loop until its deadline."""
    endpoint = PodEndpoint("127.0.0.1:0", scraper_timeout_s=0.2)
    request = b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 300
    sent, answer = [0], [b""]

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", endpoint.port)) as sock:
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # the supervisor hung up
                    break
                sent[0] += 1
                time.sleep(0.01)  # a slow scraper: one byte each 10 ms, for 3 s in all
            with suppress(OSError):  # reset: not answered either
                answer[0] = sock.recv(1024)

    scraper = threading.Thread(target=trickle, daemon=True)
    try:
        scraper.start()
        serve_the_scrape(endpoint)
        scraper.join(10)
        assert not scraper.is_alive()
        assert 0 < sent[0] < len(request)  # cut while it was still sending
        assert answer[0] == b""  # and not answered
    finally:
        endpoint.close()
