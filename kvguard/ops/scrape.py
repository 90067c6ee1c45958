"""One endpoint's /metrics over HTTP, parsed: its reading, or why there is none.

A pool whose /metrics sit behind a key (`capacity.api_key_file`) is asked with
`Authorization: Bearer <the file's key>`, the file read again at every refresh so that a rotated
Secret applies at once, and without following redirects (which would carry the key elsewhere).
An absent file sends no key: that is a Secret left out. vLLM's own `--api-key` guards its API
(/v1 and the like), not /metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvguard.ops.vllm_metrics import DiscoveryError, EndpointReading, parse_metrics


def metrics_url(endpoint: str) -> str:
    """The /metrics URL of an endpoint given as its base URL (or as its /metrics URL)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


@dataclass(frozen=True, slots=True)
class Credential:
    """What /metrics is asked with: the headers, a note for an answer that refuses them, or
    why the key cannot be used (then no endpoint is asked). Its repr shows no key."""

    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    note: str = ""
    error: str | None = None


def read_credential(api_key_file: str | None) -> Credential:
    """The Bearer key held in `api_key_file` (surrounding whitespace dropped): none without a
    file named or while it is absent; an error when it cannot be read, is empty, or holds more
    than one line. Messages name the file, never its content."""
    if api_key_file is None:
        return Credential()
    where = f"capacity.api_key_file {api_key_file}"
    try:
        key = Path(api_key_file).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return Credential(note=f"no key sent: {where} does not exist")
    except OSError as exc:
        return Credential(error=f"{where} cannot be read: {exc.strerror or type(exc).__name__}")
    except UnicodeDecodeError:
        return Credential(error=f"{where} is not UTF-8 text")
    if not key:
        return Credential(error=f"{where} is empty")
    if any(c in key for c in "\r\n"):
        return Credential(error=f"{where} holds more than one line")
    return Credential(headers={"Authorization": f"Bearer {key}"})


async def fetch(
    session: aiohttp.ClientSession, url: str, timeout: float, credential: Credential
) -> EndpointReading | str:
    """The endpoint's reading, or why there is none."""
    if credential.error is not None:
        return credential.error
    try:
        async with session.get(
            metrics_url(url),
            headers=credential.headers,
            allow_redirects=not credential.headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            if response.status != 200:
                refused = response.status in (401, 403) and credential.note
                return f"/metrics answered HTTP {response.status}" + (
                    f" ({credential.note})" if refused else ""
                )
            body = await response.read()
    except aiohttp.InvalidURL:
        return "not a URL the HTTP client can use"  # its message is the URL, credentials and all
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return why(exc)
    try:
        return parse_metrics(body.decode())  # Prometheus's text format is UTF-8
    except UnicodeDecodeError:
        return "/metrics answered a body that is not UTF-8"
    except DiscoveryError as exc:
        return str(exc)


def why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
