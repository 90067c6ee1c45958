"""The response side: which exchanges have their response read, and the release record that
joins what a response produced to the lease that reserved for it.

Envoy copies the response body of the sampled exchanges to kvguard on a second ext_proc
stream, in observability mode (docs/design.md, "The response path"): Envoy never waits for
kvguard there and ignores its failures, so reading a response can neither delay nor cut it.
The lease's own stream and the observing stream end independently; a release is recorded once
both are in, or `JOIN_WAIT_S` after the lease's stream ended without what its response produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvguard.admission.outputs import Sampler
from kvguard.admission.record import Completion
from kvguard.config.schema import ServerSettings
from kvguard.extproc.usage import Produced

__all__ = ["DEFAULT_SAMPLE", "JOIN_WAIT_S", "Completions", "Sampler"]

# The share of guarded exchanges whose response kvguard reads: server.response_sample's default.
DEFAULT_SAMPLE: float = ServerSettings.model_fields["response_sample"].default
# How long a released lease waits for its observed response's last chunk before it is recorded
# without it (the two ext_proc streams end at about the same time).
JOIN_WAIT_S = 2.0


@dataclass
class _Pending:
    completion: Completion
    observed: bool  # its response is read: wait for what it produced
    released: bool = False
    timer: asyncio.TimerHandle | None = None


class Completions:
    """Admitted leases until their release is recorded (through `record`, exactly once)."""

    def __init__(self, record: Callable[[Completion], None], join_wait_s: float = JOIN_WAIT_S):
        self._record = record
        self._join_wait_s = join_wait_s
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def admitted(self, completion: Completion, *, observed: bool) -> None:
        self._pending[completion.lease] = _Pending(completion, observed)

    def produced(self, lease: str, produced: Produced) -> None:
        """What the response of `lease` produced; recorded now if its lease is released."""
        pending = self._pending.get(lease)
        if pending is None:
            return  # recorded already (it waited too long), or not a lease of this process
        completion = pending.completion
        completion.completion_tokens = produced.completion_tokens
        completion.finish_reason = produced.finish_reason
        completion.source = produced.source
        pending.observed = False
        if pending.released:
            self._finish(lease)

    def released(self, lease: str) -> None:
        pending = self._pending.get(lease)
        if pending is None:
            return
        pending.released = True
        if not pending.observed:
            self._finish(lease)
            return
        loop = asyncio.get_running_loop()
        pending.timer = loop.call_later(self._join_wait_s, self._finish, lease)

    def _finish(self, lease: str) -> None:
        pending = self._pending.pop(lease, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        self._record(pending.completion)
