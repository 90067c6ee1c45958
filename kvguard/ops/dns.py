"""DNS: a name's addresses (a headless Service's ready pods), for capacity discovery's vLLM
Services and for the replica count."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> addresses


async def resolve(host: str, port: int) -> list[str]:
    """The addresses DNS gives `host` (A and AAAA records: a headless Service's ready pods),
    sorted; [] when it has none (no such name, or no records). Raises OSError when DNS cannot
    answer."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_RECORDS:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


# getaddrinfo's answers for a name without addresses (rather than a DNS it cannot reach).
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def service_urls(addresses: Iterable[str], port: int) -> list[str]:
    """The base URLs of a Service's pods at `addresses` (IPv6 in brackets)."""
    urls = []
    for address in addresses:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        urls.append(f"http://{host}:{port}")
    return urls
