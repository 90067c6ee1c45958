-- lib: functions shared by the ledger scripts; the loader puts this file where a script says
-- "--#include lib.lua". It uses the script's KEYS, always in this order, all of one pool and
-- hash-tagged {pool} so that they share a Redis Cluster slot:
--   KEYS[1] leases:   hash, lease id -> "<blocks>:<tenant>"
--   KEYS[2] expiries: sorted set, lease id -> expiry in ms of Redis TIME
--   KEYS[3] tenants:  hash, tenant -> blocks reserved by that tenant (absent when 0)
--   KEYS[4] reserved: string, blocks reserved in the pool (absent when 0)
--   KEYS[5] epoch:    string, set once when this pool's state is first written; a Redis that
--                     restarted empty (or was flushed) has none, so processes can tell that
--                     they must re-assert their open leases.
-- Amounts are KV-cache blocks of the pool's block size; times are ms of Redis TIME (one clock).

-- Expired leases reclaimed per call at most, so that one call stays short after a crash freed
-- many; the rest stay counted (a conservative error) until the next calls reclaim them.
local RECLAIM_BATCH = 1000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function positive_int(value, name)
  local n = tonumber(value)
  if not n or n < 1 or n ~= math.floor(n) then
    error('kvguard ledger: ' .. name .. ' must be a positive integer, got ' .. tostring(value))
  end
  return n
end

local function tenant_reserved(tenant)
  return tonumber(redis.call('HGET', KEYS[3], tenant) or '0')
end

local function pool_reserved()
  return tonumber(redis.call('GET', KEYS[4]) or '0')
end

-- A lease's stored value "<blocks>:<tenant>" as blocks, tenant (the tenant may hold ':').
local function parse(value)
  local sep = string.find(value, ':', 1, true)
  return tonumber(string.sub(value, 1, sep - 1)), string.sub(value, sep + 1)
end

-- Remove one lease and give its blocks back; returns the blocks (0 for an unknown lease).
local function drop(lease_id)
  local value = redis.call('HGET', KEYS[1], lease_id)
  if not value then
    return 0
  end
  local blocks, tenant = parse(value)
  redis.call('HDEL', KEYS[1], lease_id)
  redis.call('ZREM', KEYS[2], lease_id)
  if redis.call('HINCRBY', KEYS[3], tenant, -blocks) <= 0 then
    redis.call('HDEL', KEYS[3], tenant)
  end
  if redis.call('DECRBY', KEYS[4], blocks) <= 0 then
    redis.call('DEL', KEYS[4])
  end
  return blocks
end

-- Record a lease (no checks) with its expiry.
local function record(lease_id, tenant, blocks, expiry)
  redis.call('HSET', KEYS[1], lease_id, blocks .. ':' .. tenant)
  redis.call('ZADD', KEYS[2], expiry, lease_id)
  redis.call('HINCRBY', KEYS[3], tenant, blocks)
  redis.call('INCRBY', KEYS[4], blocks)
end

-- Count `growth` more blocks for a held lease of `tenant` (no checks), which then counts
-- `blocks` in all: drop() gives back the grown amount.
local function grow(lease_id, tenant, growth, blocks)
  redis.call('HSET', KEYS[1], lease_id, blocks .. ':' .. tenant)
  redis.call('HINCRBY', KEYS[3], tenant, growth)
  redis.call('INCRBY', KEYS[4], growth)
end

-- Reclaim leases whose expiry is at or before `now` (the memory ledger's rule too).
local function reclaim(now)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, RECLAIM_BATCH)
  for _, lease_id in ipairs(expired) do
    drop(lease_id)
    redis.call('ZREM', KEYS[2], lease_id) -- an expiry without a lease (never left, but be sure)
  end
end

-- This pool's epoch, created from Redis TIME (µs) and a random part when absent.
local function epoch()
  local value = redis.call('GET', KEYS[5])
  if not value then
    local t = redis.call('TIME')
    value = t[1] .. '.' .. t[2] .. '.' .. tostring(math.random(1, 1000000000))
    redis.call('SET', KEYS[5], value)
  end
  return value
end
