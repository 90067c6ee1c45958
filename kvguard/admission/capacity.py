"""The KV-cache capacity of each pool: static from the configuration, or discovered from vLLM.

Capacity changes on its own clock (discovery refreshes it), so it lives here and not in the
immutable policy snapshot; a decision reads it once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass


def pool_limit(capacity: int, watermark: float) -> int:
    """The most blocks that may be reserved while free blocks stay >= watermark x capacity."""
    # The epsilon keeps 100 x (1 - 0.15) = 84.99999999999999 from losing a block.
    return math.floor(capacity * (1 - watermark) + 1e-9)


@dataclass(frozen=True, slots=True)
class PodCapacity:
    """One vLLM server of a pool, as discovery read it: where it is reached, and its own usable
    blocks (vLLM preempts per server, so each bounds what may be reserved on it)."""

    address: str  # host:port, as the endpoint picker names a pod (IPv6 in brackets)
    blocks: int
    waiting: int | None = None  # requests waiting in its vLLM queue at the reading; None: unknown


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    blocks: int  # usable blocks across the pool's endpoints
    block_size: int  # tokens per block
    # Each endpoint read, by address; () for a capacity given in the configuration.
    pods: tuple[PodCapacity, ...] = ()

    def limit(self, watermark: float) -> int:
        """Most blocks that may be reserved while `watermark` of them stay free."""
        return pool_limit(self.blocks, watermark)


class Capacities:
    """Pool name -> PoolCapacity; a pool without an entry has unknown capacity."""

    def __init__(self) -> None:
        self._by_pool: dict[str, PoolCapacity] = {}
        self._listeners: list[Callable[[], None]] = []

    def get(self, pool: str) -> PoolCapacity | None:
        return self._by_pool.get(pool)

    def set(self, pool: str, capacity: PoolCapacity | None) -> None:
        if capacity is None:
            self._by_pool.pop(pool, None)
        else:
            self._by_pool[pool] = capacity
        for listener in self._listeners:
            listener()

    def retain(self, pools: Collection[str]) -> None:
        """Forget pools that the policy no longer has."""
        for pool in [p for p in self._by_pool if p not in pools]:
            self.set(pool, None)

    def any_known(self) -> bool:
        return bool(self._by_pool)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)
