"""The KV-cache block pool, as vLLM v1 keeps it (vllm/v1/core/block_pool.py).

`usable` blocks (vLLM's num_gpu_blocks minus its null block). A free block is either
anonymous (never filled, or filled without prefix caching) or cached: full, with the key of its
contents, and still matchable by a later request until it is reused. New blocks come from the
front of the free queue: anonymous ones first (vLLM prepends them on free), then cached ones in
least-recently-freed order (vLLM appends them, a request's tail blocks first). A cached block
hit while free leaves the free queue; one hit while in use gains a reference.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class Block:
    __slots__ = ("key", "refs")

    def __init__(self) -> None:
        self.key: Hashable | None = None  # the contents' key once full and cached
        self.refs = 0


class BlockPool:
    def __init__(self, usable: int, *, caching: bool) -> None:
        if usable < 1:
            raise ValueError("the pool needs at least one usable block")
        self.usable = usable
        self.caching = caching
        self._anonymous: list[Block] = [Block() for _ in range(usable)]
        self._lru: OrderedDict[Hashable, Block] = OrderedDict()  # free cached blocks
        self._cached: dict[Hashable, Block] = {}  # every cached block, free or in use

    @property
    def free(self) -> int:
        """Blocks that an allocation may take (cached free blocks included)."""
        return len(self._anonymous) + len(self._lru)

    @property
    def used(self) -> int:
        return self.usable - self.free

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the used share of the usable blocks (0..1)."""
        return self.used / self.usable

    def lookup(self, keys: Sequence[Hashable]) -> list[Block]:
        """The cached blocks matching the longest prefix of `keys` (not yet referenced)."""
        if not self.caching:
            return []
        hits = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def evictable(self, blocks: Iterable[Block]) -> int:
        """How many of `blocks` sit in the free queue (referencing them uses up free blocks)."""
        return sum(1 for b in blocks if b.refs == 0)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Reference hit blocks: free ones leave the free queue."""
        for block in blocks:
            if block.refs == 0 and block.key is not None:
                del self._lru[block.key]
            block.refs += 1

    def allocate(self, count: int) -> list[Block]:
        """`count` fresh blocks; the caller has checked that they are free."""
        if count > self.free:
            raise RuntimeError(f"allocating {count} blocks with {self.free} free")
        blocks = []
        for _ in range(count):
            if self._anonymous:
                block = self._anonymous.pop()
            else:
                key, block = self._lru.popitem(last=False)  # evict the least recently freed
                del self._cached[key]
                block.key = None
            block.refs = 1
            blocks.append(block)
        return blocks

    def cache(self, block: Block, key: Hashable) -> None:
        """Record a block that just became full (a duplicate of cached contents stays
        anonymous, as vLLM keeps the first copy)."""
        if self.caching and block.key is None and key not in self._cached:
            block.key = key
            self._cached[key] = block

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block, the last one first (its tail is evicted first)."""
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs > 0:
                continue
            if block.key is None:
                self._anonymous.append(block)
            else:
                self._lru[block.key] = block
