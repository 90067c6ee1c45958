-- renew: extend live leases of one pool, after reclaiming expired leases and promises (an
-- expired lease is gone, as in the memory ledger). One call renews any number of leases.
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease time (ms); ARGV[2..n] lease ids.
-- Returns one integer per lease id, in order: 1 renewed (expiry = now + lease time), 0 gone.
--#include lib.lua

local lease_ms = positive_int(ARGV[1], 'lease time (ms)')
local now = now_ms()
reclaim(now)
local renewed = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', LEASES, ARGV[i]) == 1 then
    redis.call('ZADD', EXPIRIES, 'XX', now + lease_ms, ARGV[i])
    renewed[#renewed + 1] = 1
  else
    renewed[#renewed + 1] = 0
  end
end
return renewed
