-- reserve: admit one claim against the pool limit and the tenant's quota, in one atomic step:
-- refuse an impossible claim first, reclaim expired leases, check both limits, record the lease.
-- KEYS: leases, expiries, tenants, reserved, epoch of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease id; ARGV[2] tenant; ARGV[3] blocks; ARGV[4] pool limit (most blocks the pool
--   may hold reserved: capacity minus the watermark); ARGV[5] tenant quota (blocks);
--   ARGV[6] lease time (ms).
-- Returns {outcome, pool reserved, tenant reserved, epoch}: outcome 0 admitted, 1 tenant quota,
--   2 pool watermark; reserved amounts in blocks after this step; epoch '' when an impossible
--   claim was refused without reading it. A lease id that is already
--   held is admitted again without being counted twice (a retried call).
--#include lib.lua

local lease_id, tenant = ARGV[1], ARGV[2]
local blocks = positive_int(ARGV[3], 'blocks')
local limit, quota = tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms = positive_int(ARGV[6], 'lease time (ms)')

-- Impossible whatever else is reserved: answer before writing anything (epoch '' = not read).
if blocks > quota then
  return {1, pool_reserved(), tenant_reserved(tenant), ''}
end
if blocks > limit then
  return {2, pool_reserved(), tenant_reserved(tenant), ''}
end

local now = now_ms()
reclaim(now)
local current = epoch()
if redis.call('HEXISTS', KEYS[1], lease_id) == 1 then
  return {0, pool_reserved(), tenant_reserved(tenant), current}
end
local tenant_now = tenant_reserved(tenant)
local pool_now = pool_reserved()
if tenant_now + blocks > quota then
  return {1, pool_now, tenant_now, current}
end
if pool_now + blocks > limit then
  return {2, pool_now, tenant_now, current}
end
record(lease_id, tenant, blocks, now + lease_ms)
return {0, pool_now + blocks, tenant_now + blocks, current}
