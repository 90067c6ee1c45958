"""The configuration's addresses, as the schema checks them: listen addresses (host:port),
DNS names, and the authority of a URL (its port, and no '@' after its host).
"""

from __future__ import annotations

import re
import urllib.parse

# host:port, the host a name, an IPv4 address or a bracketed IPv6 address.
HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[\w.-]*):([0-9]{1,5})", re.ASCII)
# A DNS name: dot-separated labels of letters, digits and inner hyphens.
DNS_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?",
    re.ASCII,
)


def listen_port(address: str, *, host_required: bool) -> int:
    """The port of a `host:port` listen address (0: the kernel picks one); ValueError if it is
    not one."""
    match = HOST_PORT.fullmatch(address)
    if not match or (host_required and not match.group(1)):
        form = "host:port" if host_required else "host:port or :port"
        raise ValueError(f"{address!r} is not {form}")
    port = int(match.group(2))
    if port > 65535:
        raise ValueError(f"{address!r}: the port must be from 0 to 65535")
    return port


def check_authority(url: str) -> None:
    """ValueError, quoting nothing, if `url`'s port is not one or an '@' follows its host: a
    password with '/', '?' or '#' (not percent-encoded) spills out of the userinfo."""
    parts = urllib.parse.urlsplit(url)
    if "@" in url.partition("://")[2][len(parts.netloc) :]:
        raise ValueError(
            "an '@' after the host: in a user name or password, '/', '?', '#' and '@' must be "
            "percent-encoded"
        )
    address = parts.netloc.rpartition("@")[2]
    if ":" in address.rpartition("]")[2]:  # a port, after any [IPv6] host
        port = address.rpartition(":")[2]
        if not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) <= 65535:
            raise ValueError(
                "the port must be a number from 1 to 65535 (in a password, "
                "'/', '?' and '#' must be percent-encoded)"
            )
