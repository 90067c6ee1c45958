-- replicas: register one kvguard process as alive, and count those alive.
-- KEYS[1] the registry: sorted set, process id -> expiry in ms of Redis TIME (one clock).
-- ARGV[1] this process's id; ARGV[2] how long the registration lives (ms), 0 to leave.
-- Returns the number of processes registered and not expired, this one included unless it left.
local REGISTRY = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', REGISTRY, '-inf', now)
if ttl > 0 then
  redis.call('ZADD', REGISTRY, now + ttl, ARGV[1])
else
  redis.call('ZREM', REGISTRY, ARGV[1])
end
-- The registry goes when its last registration expires.
local last = redis.call('ZRANGE', REGISTRY, -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', REGISTRY, last[2])
end
return redis.call('ZCARD', REGISTRY)
