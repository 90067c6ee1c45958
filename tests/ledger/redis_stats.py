"""Counting the commands a redis-server (or each node of a cluster) ran: the round trips a
ledger call took."""

from __future__ import annotations

from typing import Any

from kvguard.testing.redis import RedisCluster


def commandstats(redis: Any) -> dict[str, int]:
    """The calls of each command since the last `reset_stats`, summed over the nodes."""
    out: dict[str, int] = {}
    nodes = redis.nodes if isinstance(redis, RedisCluster) else [redis]
    for node in nodes:
        for line in node.cli("info", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, stats = line.removeprefix("cmdstat_").split(":", 1)
                calls = int(stats.split(",")[0].removeprefix("calls="))
                out[name] = out.get(name, 0) + calls
    return out


def reset_stats(redis: Any) -> None:
    for node in redis.nodes if isinstance(redis, RedisCluster) else [redis]:
        node.cli("config", "resetstat")
