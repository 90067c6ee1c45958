"""Health as a small map of components, from which readiness is derived.

Readiness (Envoy's health check, readiness probes): policy and tokenizers loaded, at least one
pool with known capacity, the ledger reachable (unless on_unavailable lets requests through
without it), not draining. Liveness stays apart: it is true while the process serves at all.
"""

from __future__ import annotations

from collections.abc import Callable

COMPONENTS = ("policy", "tokenizers", "capacity", "ledger", "draining")


class Health:
    def __init__(self, *, ledger_required: bool = True) -> None:
        self._ledger_required = ledger_required
        self._state = {
            "policy": False,
            "tokenizers": False,
            "capacity": False,
            "ledger": False,
            "draining": False,
        }
        self._listeners: list[Callable[[bool], None]] = []

    def set(self, component: str, value: bool) -> None:
        if component not in self._state:
            raise KeyError(component)
        before = self.ready
        self._state[component] = value
        if self.ready != before:
            for listener in self._listeners:
                listener(self.ready)

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(ready)` now and on every change of readiness."""
        self._listeners.append(listener)
        listener(self.ready)

    @property
    def ready(self) -> bool:
        s = self._state
        ledger_ok = s["ledger"] or not self._ledger_required
        return s["policy"] and s["tokenizers"] and s["capacity"] and ledger_ok and not s["draining"]

    def snapshot(self) -> dict[str, bool]:
        return dict(self._state)
