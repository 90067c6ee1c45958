-- leases: one pool's open leases, after reclaiming expired leases and promises, for operators.
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV: none.
-- Returns {now (ms of Redis TIME), {lease id, "<blocks>:<tenant>", expiry (ms), pod ('': none),
--   ...}}.
--#include lib.lua

local now = now_ms()
reclaim(now)
local out = {}
local all = redis.call('HGETALL', LEASES)
for i = 1, #all, 2 do
  local expiry = redis.call('ZSCORE', EXPIRIES, all[i])
  table.insert(out, all[i])
  table.insert(out, all[i + 1])
  table.insert(out, tonumber(expiry or now))
  table.insert(out, pod_of(all[i]))
end
return {now, out}
