-- usage: what one pool holds, after reclaiming expired leases and promises, read in one atomic
-- step.
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV: none.
-- Returns {pool reserved (blocks), number of leases, {tenant1, blocks1, tenant2, blocks2, ...},
--   blocks promised (not in reserved), number of promises, of the promised blocks those held for
--   retries that came back, {pod1, blocks1, pod2, blocks2, ...}}.
--#include lib.lua

reclaim(now_ms())
return {
  pool_reserved(),
  redis.call('HLEN', LEASES),
  redis.call('HGETALL', TENANTS),
  pool_promised(),
  redis.call('HLEN', PROMISES),
  pool_holding(),
  redis.call('HGETALL', POD_RESERVED),
}
