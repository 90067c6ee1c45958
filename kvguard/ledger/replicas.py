"""How many kvguard processes share the Redis ledger: what `on_unavailable: local` divides the
pool and each quota by while Redis cannot be reached.

Counted at runtime from two sources, whichever is known, the larger when both are:

- the processes alive in Redis: each process registers itself at every heartbeat with a TTL
  (RedisLedger.register), so a process that died drops out within the TTL. The count used is
  the largest a heartbeat saw within the last TTL: a Redis that restarted empty counts only
  those that registered again since, while the others are still alive;
- the gateway pods in DNS (`ledger.replica_service`), times `server.workers`.

A fixed `ledger.replicas: N` is a floor, known from the start; and once any count is known it
is at least this pod's own workers. While Redis cannot be reached the count known when it went
away holds, and DNS can only raise it: pods that turn unready during the outage do not enlarge
each one's share, pods that start during it shrink it. The held count stands one TTL past the
recovery too, while the others register again. A process that never knew a count has none
(`count` is None): the local fallback then refuses rather than admit the whole pool as if it
were alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# How long a registration outlives its last heartbeat (ResilientLedger beats every second):
# a process that dies is counted this much longer, which only makes the others' shares smaller.
REGISTRATION_TTL_S = 10.0


class ReplicaCount:
    def __init__(
        self,
        floor: int | None = None,
        *,
        own: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if floor is not None and floor < 1:
            raise ValueError("a fixed replica count must be at least 1")
        self._floor = floor
        self._own = own  # this pod's processes (server.workers)
        self._clock = clock
        self._beats: deque[tuple[float, int]] = deque()  # (when, alive in Redis), within a TTL
        self._resolved: int | None = None  # gateway pods x workers, at the last lookup
        self._held: int | None = None  # the count when Redis went away
        self._held_until: float | None = None  # None: held while down; else until then
        self._down = False

    def registered(self, processes: int) -> None:
        """The processes alive in Redis, this one included, as a heartbeat just counted."""
        if processes > 0:
            self._beats.append((self._clock(), processes))

    def resolved(self, processes: int) -> None:
        """The processes behind the gateway Service's addresses, as DNS just answered. An
        answer without any tells nothing (a misspelt name, or no pod ready yet)."""
        if processes > 0:
            self._resolved = processes

    def outage(self, down: bool) -> None:
        """Redis went away (the count known now holds) or came back (it holds one TTL more,
        while the other processes register again)."""
        if down and not self._down:
            self._held, self._held_until = self.count, None
        elif not down and self._down:
            self._held_until = self._clock() + REGISTRATION_TTL_S
        self._down = down

    @property
    def count(self) -> int | None:
        """The processes to divide the pool by; None if no source ever gave a count."""
        now = self._clock()
        while self._beats and self._beats[0][0] < now - REGISTRATION_TTL_S:
            self._beats.popleft()
        held = self._held
        if held is not None and self._held_until is not None and now >= self._held_until:
            self._held = held = None
        registered = max((n for _, n in self._beats), default=None)
        known = [c for c in (self._floor, registered, self._resolved, held) if c]
        return max(self._own, *known) if known else None
