"""Pick a ledger backend from its URL scheme, with a plain mapping."""

from __future__ import annotations

from collections.abc import Callable

from kvguard.ledger import Ledger
from kvguard.ledger.memory import MemoryLedger


def from_url(url: str, clock: Callable[[], float] | None = None) -> Ledger:
    """The ledger for `url`; the scheme picks the backend."""
    backends: dict[str, Callable[[], Ledger]] = {
        "memory": lambda: MemoryLedger(clock=clock),
    }
    scheme = url.split("://", 1)[0]
    if scheme not in backends:
        raise ValueError(f"ledger url {url!r}: no backend for scheme {scheme!r} yet")
    return backends[scheme]()
