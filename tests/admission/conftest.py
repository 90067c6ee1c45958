"""The lease keeper's tests run on every ledger: memory, redis-server and Redis Cluster."""

from tests.ledger.conftest import backend, clock, ledger, redis_cluster, redis_server

__all__ = ["backend", "clock", "ledger", "redis_cluster", "redis_server"]
