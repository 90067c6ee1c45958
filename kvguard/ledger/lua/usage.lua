-- usage: what one pool holds, after reclaiming expired leases, read in one atomic step.
-- KEYS: leases, expiries, tenants, reserved of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV: none.
-- Returns {pool reserved (blocks), number of leases, {tenant1, blocks1, tenant2, blocks2, ...}}.
--#include lib.lua

reclaim(now_ms())
return {pool_reserved(), redis.call('HLEN', KEYS[1]), redis.call('HGETALL', KEYS[3])}
