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
-- and the promises made to refused claims, and how fast the pool frees blocks:
--   KEYS[6]  promises:         hash, retry key -> "<blocks>:<retry at ms>:<expiry ms>:<holding>
--                              <pool>:<returned>:<tenant>", holding 1 when its blocks count
--                              against other claims, pool 1 when the pool's sums count them
--                              (refused for the pool; a quota's promise holds its tenant's
--                              quota alone), returned 1 once its client came back
--   KEYS[7]  promise order:    sorted set, retry key -> sequence number of its first promise
--   KEYS[8]  promise sequence: string, the last sequence number given (INCR)
--   KEYS[9]  promise expiries: sorted set, retry key -> expiry (retry at + grace) in ms
--   KEYS[10] promised:         string, blocks promised in the pool (absent when 0)
--   KEYS[11] promised tenants: hash, tenant -> blocks promised to that tenant (absent when 0)
--   KEYS[12] promise holds:    sorted set, retry key -> hold at in ms, of the promises not
--                              holding yet
--   KEYS[13] holding:          string, blocks of the holding promises (absent when 0)
--   KEYS[14] holding tenants:  hash, tenant -> blocks of its holding promises (absent when 0)
--   KEYS[15] unreturned:       hash, tenant -> expiry in ms of the promise whose client never
--                              came back and took its budget to 0
--   KEYS[16] budgets:          hash, tenant -> promises it may have open (PROMISE_BUDGET when
--                              absent)
--   KEYS[17] promise counts:   hash, tenant -> promises it has open (absent when 0)
--   KEYS[18] drain:            string, "<blocks>:<releases>:<at ms>", the blocks and releases
--                              freed in the pool, decayed over DRAIN_WINDOW_MS as of `at`
--   KEYS[19] tenant drains:    hash, tenant -> the same, for the leases of that tenant
--   KEYS[20] since:            string, ms when the ledger first saw the pool (what the drain
--                              was measured over)
-- Every script takes all of them.
-- Amounts are KV-cache blocks of the pool's block size; times are ms of Redis TIME (one clock).

-- Expired leases reclaimed per call at most (and as many expired promises, and as many that start
-- holding), so that one call stays short after a crash freed many; the rest stay as they were
-- until the next calls reclaim them (counted, for leases and expired promises: a conservative
-- error).
local RECLAIM_BATCH = 1000

-- The drain's decay time: kvguard.ledger.DRAIN_WINDOW_S.
local DRAIN_WINDOW_MS = 10000
-- Promises a tenant may have open until its clients have shown whether they come back, and the
-- most: kvguard.ledger.PROMISE_BUDGET and MAX_PROMISE_BUDGET.
local PROMISE_BUDGET = 4
local MAX_PROMISE_BUDGET = 1024

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

local function non_negative_int(value, name)
  local n = tonumber(value)
  if not n or n < 0 or n ~= math.floor(n) or n == math.huge then
    error('kvguard ledger: ' .. name .. ' must be a non-negative integer, got ' .. tostring(value))
  end
  return n
end

local function non_negative_number(value, name)
  local n = tonumber(value)
  if not n or not (n >= 0) or n == math.huge then -- not (n >= 0): NaN too
    error('kvguard ledger: ' .. name .. ' must be a non-negative number, got ' .. tostring(value))
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

-- The blocks and releases freed, decayed over DRAIN_WINDOW_MS as of `now`, from a stored drain
-- value (nil: none yet).
local function decayed(value, now)
  if not value then
    return 0, 0
  end
  local a = string.find(value, ':', 1, true)
  local b = string.find(value, ':', a + 1, true)
  local blocks = tonumber(string.sub(value, 1, a - 1))
  local releases = tonumber(string.sub(value, a + 1, b - 1))
  local at = tonumber(string.sub(value, b + 1))
  if now > at then
    local factor = math.exp((at - now) / DRAIN_WINDOW_MS)
    blocks, releases = blocks * factor, releases * factor
  end
  return blocks, releases
end

-- A stored drain value with `blocks` more freed, in one release, at `now`.
local function drained(value, blocks, now)
  local sum, releases = decayed(value, now)
  return string.format('%.17g:%.17g:%d', sum + blocks, releases + 1, now)
end

-- Tell every kvguard process subscribed to the pool that `blocks` were freed (none: nothing is
-- sent): a sharded pub/sub message, the blocks, on kvguard:{pool}:freed, the channel of the
-- pool's hash tag and so of its Redis Cluster slot (kvguard.ledger.redis_ledger.freed_channel).
local function publish_freed(blocks)
  if blocks > 0 then
    -- KEYS[1] is kvguard:{pool}:leases.
    redis.call('SPUBLISH', string.sub(KEYS[1], 1, -#':leases' - 1) .. ':freed', blocks)
  end
end

-- Remove one lease and give its blocks back, counting them as freed at `now`; returns the
-- blocks (0 for an unknown lease).
local function drop(lease_id, now)
  local value = redis.call('HGET', KEYS[1], lease_id)
  if not value then
    return 0
  end
  local blocks, tenant = parse(value)
  redis.call('SET', KEYS[18], drained(redis.call('GET', KEYS[18]), blocks, now))
  redis.call('HSET', KEYS[19], tenant, drained(redis.call('HGET', KEYS[19], tenant), blocks, now))
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

-- Promised-key lookups per HMGET in promised_before (unpack has a stack limit).
local WALK_BATCH = 1000

local function pool_promised()
  return tonumber(redis.call('GET', KEYS[10]) or '0')
end

local function tenant_promised(tenant)
  return tonumber(redis.call('HGET', KEYS[11], tenant) or '0')
end

local function pool_holding()
  return tonumber(redis.call('GET', KEYS[13]) or '0')
end

local function tenant_holding(tenant)
  return tonumber(redis.call('HGET', KEYS[14], tenant) or '0')
end

-- Move a pool counter (string `total`) and a tenant's counter (hash `by_tenant`) by `change`,
-- deleting what reaches 0.
local function add(total, by_tenant, tenant, change, pool_too)
  if redis.call('HINCRBY', by_tenant, tenant, change) <= 0 then
    redis.call('HDEL', by_tenant, tenant)
  end
  if pool_too ~= false and redis.call('INCRBY', total, change) <= 0 then
    redis.call('DEL', total)
  end
end

-- A promise's stored value as {blocks, retry_at, expiry, holding, returned, tenant} (the
-- tenant may hold ':', so it comes last).
local function parse_promise(value)
  local fields, start = {}, 1
  for _ = 1, 5 do
    local sep = string.find(value, ':', start, true)
    fields[#fields + 1] = string.sub(value, start, sep - 1)
    start = sep + 1
  end
  -- The fourth field: holding, then whether the pool's sums count it (absent: they do).
  return {
    blocks = tonumber(fields[1]),
    retry_at = tonumber(fields[2]),
    expiry = tonumber(fields[3]),
    holding = string.sub(fields[4], 1, 1) == '1',
    pool_bound = string.sub(fields[4], 2, 2) ~= '0',
    returned = fields[5] == '1',
    tenant = string.sub(value, start),
  }
end

local function store_promise(key, p)
  local value = p.blocks .. ':' .. p.retry_at .. ':' .. p.expiry .. ':'
    .. (p.holding and '1' or '0') .. (p.pool_bound and '1' or '0') .. ':'
    .. (p.returned and '1' or '0') .. ':' .. p.tenant
  redis.call('HSET', KEYS[6], key, value)
end

-- The promise held under `key`, or nil.
local function held_promise(key)
  local value = redis.call('HGET', KEYS[6], key)
  return value and parse_promise(value) or nil
end

-- Take `p`'s blocks out of the promised counters (and the holding ones, if it holds).
local function uncount(p)
  add(KEYS[10], KEYS[11], p.tenant, -p.blocks, p.pool_bound)
  if redis.call('HINCRBY', KEYS[17], p.tenant, -1) <= 0 then
    redis.call('HDEL', KEYS[17], p.tenant)
  end
  if p.holding then
    add(KEYS[13], KEYS[14], p.tenant, -p.blocks, p.pool_bound)
  end
end

-- Record a promise under a key that holds none (no checks), not holding until `hold_at`;
-- `pool_bound`: refused for the pool, so the pool's sums count it (a quota's holds the quota).
local function promise(key, tenant, blocks, hold_at, retry_at, expiry, pool_bound)
  redis.call('ZADD', KEYS[7], redis.call('INCR', KEYS[8]), key)
  store_promise(key, {
    blocks = blocks,
    retry_at = retry_at,
    expiry = expiry,
    holding = false,
    pool_bound = pool_bound,
    returned = false,
    tenant = tenant,
  })
  redis.call('ZADD', KEYS[12], hold_at, key)
  redis.call('ZADD', KEYS[9], expiry, key)
  add(KEYS[10], KEYS[11], tenant, blocks, pool_bound)
  redis.call('HINCRBY', KEYS[17], tenant, 1)
end

local function budget_of(tenant)
  return tonumber(redis.call('HGET', KEYS[16], tenant) or PROMISE_BUDGET)
end

-- The client of `p` (under `key`) came back: the first time, its tenant may have twice as many
-- promises open (up to the most).
local function came_back(key, p)
  if not p.returned then
    p.returned = true
    store_promise(key, p)
    local budget = math.min(2 * math.max(budget_of(p.tenant), 1), MAX_PROMISE_BUDGET)
    redis.call('HSET', KEYS[16], p.tenant, budget)
  end
end

-- Whether `tenant` may have one more promise open: fewer open than its budget, and at a budget
-- of 0 one more try from `max_wait` ms after the promise that took it there ended.
local function may_promise(tenant, now, max_wait)
  local budget = budget_of(tenant)
  if budget == 0 then
    local unreturned = tonumber(redis.call('HGET', KEYS[15], tenant) or now)
    if now < unreturned + max_wait then
      return false
    end
    budget = 1
    redis.call('HSET', KEYS[16], tenant, budget)
  end
  return tonumber(redis.call('HGET', KEYS[17], tenant) or '0') < budget
end

-- Remove the promise under `key` and give its blocks back (no-op for an unknown key).
local function unpromise(key)
  local held = held_promise(key)
  if not held then
    return
  end
  redis.call('HDEL', KEYS[6], key)
  redis.call('ZREM', KEYS[7], key)
  redis.call('ZREM', KEYS[9], key)
  redis.call('ZREM', KEYS[12], key)
  uncount(held)
end

-- Blocks promised before `key`'s promise: in the pool, in the pool and holding, to `tenant`, to
-- `tenant` and holding. A retry comes back near its time, when the promises before it are
-- mostly taken: a short walk.
local function promised_before(key, tenant)
  local before = '(' .. redis.call('ZSCORE', KEYS[7], key)
  local pool, pool_holding, own, own_holding, offset = 0, 0, 0, 0, 0
  repeat
    local keys = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', before, 'LIMIT', offset, WALK_BATCH)
    if #keys > 0 then
      for _, value in ipairs(redis.call('HMGET', KEYS[6], unpack(keys))) do
        if value then
          local p = parse_promise(value)
          local held = p.holding and p.blocks or 0
          if p.pool_bound then
            pool, pool_holding = pool + p.blocks, pool_holding + held
          end
          if p.tenant == tenant then
            own, own_holding = own + p.blocks, own_holding + held
          end
        end
      end
    end
    offset = offset + #keys
  until #keys < WALK_BATCH
  return pool, pool_holding, own, own_holding
end

-- Start holding the promises whose hold time is at or before `now`, and end those whose grace
-- has ended; a tenant whose ended promise never saw its client back has its budget halved, and
-- at 0 is marked unreturned at that promise's expiry. Returns the blocks of the ended promises.
local function reclaim_promises(now)
  local freed_blocks = 0
  local due = redis.call('ZRANGEBYSCORE', KEYS[12], '-inf', now, 'LIMIT', 0, RECLAIM_BATCH)
  for _, key in ipairs(due) do
    local p = held_promise(key)
    if p and not p.holding then
      p.holding = true
      store_promise(key, p)
      add(KEYS[13], KEYS[14], p.tenant, p.blocks, p.pool_bound)
    end
    redis.call('ZREM', KEYS[12], key)
  end
  local ended = redis.call('ZRANGEBYSCORE', KEYS[9], '-inf', now, 'LIMIT', 0, RECLAIM_BATCH)
  for _, key in ipairs(ended) do
    local p = held_promise(key)
    if p and not p.returned then
      local budget = math.floor(budget_of(p.tenant) / 2)
      redis.call('HSET', KEYS[16], p.tenant, budget)
      if budget == 0 then
        redis.call('HSET', KEYS[15], p.tenant, p.expiry)
      end
    end
    unpromise(key)
    redis.call('ZREM', KEYS[9], key) -- as for leases
    if p then
      freed_blocks = freed_blocks + p.blocks
    end
  end
  return freed_blocks
end

-- Note when the ledger first saw the pool.
local function saw_pool(now)
  redis.call('SET', KEYS[20], now, 'NX')
end

-- Reclaim leases whose expiry is at or before `now` (the memory ledger's rule too), and
-- promises (reclaim_promises); the blocks they free are published (publish_freed).
local function reclaim(now)
  saw_pool(now)
  local freed_blocks = 0
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, RECLAIM_BATCH)
  for _, lease_id in ipairs(expired) do
    freed_blocks = freed_blocks + drop(lease_id, now)
    redis.call('ZREM', KEYS[2], lease_id) -- an expiry without a lease (never left, but be sure)
  end
  publish_freed(freed_blocks + reclaim_promises(now))
end

-- Ms from `now` until a lease or a promise ends, or a promise starts holding, by itself: when
-- room may appear without a release (0 when one is due already, -1 when none is).
local function next_change(now)
  local due = nil
  for _, key in ipairs({KEYS[2], KEYS[12], KEYS[9]}) do
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if first[2] then
      local at = tonumber(first[2])
      due = due and math.min(due, at) or at
    end
  end
  return due and math.max(0, due - now) or -1
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
