-- lib: functions shared by the ledger scripts; the loader puts this file where a script says
-- "--#include lib.lua". It uses the script's KEYS, always in this order (the order of
-- kvguard.ledger.scripts.all_keys), all of one pool and hash-tagged {pool} so that they share a
-- Redis Cluster slot. Every script takes all of them; each is bound to a name here, and used by
-- that name:
-- hash, lease id -> "<blocks>:<tenant>"
local LEASES = KEYS[1]
-- sorted set, lease id -> expiry in ms of Redis TIME
local EXPIRIES = KEYS[2]
-- hash, tenant -> blocks reserved by that tenant (absent when 0)
local TENANTS = KEYS[3]
-- string, blocks reserved in the pool (absent when 0)
local RESERVED = KEYS[4]
-- string, set once when this pool's state is first written; a Redis that restarted empty (or
-- was flushed) has none, so processes can tell that they must re-assert their open leases.
local EPOCH = KEYS[5]
-- The promises made to refused claims:
-- hash, retry key -> "<blocks>:<retry at ms>:<expiry ms>:<holding><returned>:<seq>:<tenant>",
-- holding 1 once its client came back at its time (its blocks then count against its tenant's
-- claims), returned 1 once its client came back at all, seq its place
local PROMISES = KEYS[6]
-- sorted set, all scores 0, members "<line>:<seq, 15 digits>:<key>": each tenant's promises in
-- the order they were made (ZRANGEBYLEX), <line> being "<#tenant>:<tenant>"
local PROMISE_LINES = KEYS[7]
-- string, the last sequence number given (INCR)
local PROMISE_SEQ = KEYS[8]
-- sorted set, retry key -> expiry (retry at + grace) in ms
local PROMISE_EXPIRIES = KEYS[9]
-- string, blocks promised in the pool (absent when 0)
local PROMISED = KEYS[10]
-- hash, tenant -> blocks promised to that tenant (absent when 0)
local PROMISED_TENANTS = KEYS[11]
-- string, blocks of the holding promises (absent when 0)
local HOLDING = KEYS[12]
-- hash, tenant -> blocks of its holding promises (absent when 0)
local HOLDING_TENANTS = KEYS[13]
-- hash, tenant -> expiry in ms of the promise whose client never came back and took its budget
-- to 0
local UNRETURNED = KEYS[14]
-- hash, tenant -> promises it may have open (PROMISE_BUDGET when absent)
local BUDGETS = KEYS[15]
-- And when leases are expected to end:
-- sorted set, lease id -> when it is expected to end, in ms
local ENDS = KEYS[16]
-- sorted set, all scores 0, members "<line>:<end ms, 15 digits>:<lease id>": each tenant's
-- leases in order of their expected ends (ZRANGEBYLEX)
local TENANT_ENDS = KEYS[17]
-- And the pods leases are held on (a lease of a claim that named no pods is on none):
-- hash, pod -> blocks reserved on that pod (absent when 0)
local POD_RESERVED = KEYS[18]
-- sorted set, all scores 0, members "<line>:<end ms, 15 digits>:<lease id>": each pod's leases
-- in order of their expected ends, as TENANT_ENDS
local POD_ENDS = KEYS[19]
-- hash, lease id -> the pod it is held on (absent: none)
local LEASE_PODS = KEYS[20]

-- Amounts are KV-cache blocks of the pool's block size; times are ms of Redis TIME (one clock).

-- Expired leases reclaimed per call at most (and as many expired promises), so that one call
-- stays short after a crash freed many; the rest stay as they were until the next calls reclaim
-- them (counted: a conservative error).
local RECLAIM_BATCH = 1000

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
  return tonumber(redis.call('HGET', TENANTS, tenant) or '0')
end

local function pool_reserved()
  return tonumber(redis.call('GET', RESERVED) or '0')
end

-- A lease's stored value "<blocks>:<tenant>" as blocks, tenant (the tenant may hold ':').
local function parse(value)
  local sep = string.find(value, ':', 1, true)
  return tonumber(string.sub(value, 1, sep - 1)), string.sub(value, sep + 1)
end

-- Tell every kvguard process subscribed to the pool that `blocks` were freed (none: nothing is
-- sent): a sharded pub/sub message, the blocks, on kvguard:{pool}:freed, the channel of the
-- pool's hash tag and so of its Redis Cluster slot (kvguard.ledger.freed.freed_channel).
local function publish_freed(blocks)
  if blocks > 0 then
    -- LEASES is kvguard:{pool}:leases.
    redis.call('SPUBLISH', string.sub(LEASES, 1, -#':leases' - 1) .. ':freed', blocks)
  end
end

-- A tenant's line: what its members of PROMISE_LINES and TENANT_ENDS start with (the length
-- first, so that no tenant's line is the start of another's).
local function line_of(tenant)
  return #tenant .. ':' .. tenant .. ':'
end

-- The member of TENANT_ENDS (`owner` a tenant) or POD_ENDS (a pod) for a lease ending at `at`.
local function end_member(owner, at, lease_id)
  return line_of(owner) .. string.format('%015d', at) .. ':' .. lease_id
end

local function pod_of(lease_id)
  return redis.call('HGET', LEASE_PODS, lease_id) or ''
end

local function pod_reserved(pod)
  return tonumber(redis.call('HGET', POD_RESERVED, pod) or '0')
end

-- Count `change` more blocks on `pod` ('': none, nothing counted), deleting what reaches 0.
local function count_on_pod(pod, change)
  if pod ~= '' and redis.call('HINCRBY', POD_RESERVED, pod, change) <= 0 then
    redis.call('HDEL', POD_RESERVED, pod)
  end
end

-- The lease's expected end `at` (ms), indexed for the pool, its tenant and its pod.
local function expect_end(lease_id, tenant, pod, at)
  local before = redis.call('ZSCORE', ENDS, lease_id)
  if before then
    before = tonumber(before)
    if before == at then
      return
    end
    redis.call('ZREM', TENANT_ENDS, end_member(tenant, before, lease_id))
    if pod ~= '' then
      redis.call('ZREM', POD_ENDS, end_member(pod, before, lease_id))
    end
  end
  redis.call('ZADD', ENDS, at, lease_id)
  redis.call('ZADD', TENANT_ENDS, 0, end_member(tenant, at, lease_id))
  if pod ~= '' then
    redis.call('ZADD', POD_ENDS, 0, end_member(pod, at, lease_id))
  end
end

-- Remove one lease and give its blocks back; returns the blocks (0 for an unknown lease).
local function drop(lease_id)
  local value = redis.call('HGET', LEASES, lease_id)
  if not value then
    return 0
  end
  local blocks, tenant = parse(value)
  local pod = pod_of(lease_id)
  local at = redis.call('ZSCORE', ENDS, lease_id)
  if at then
    redis.call('ZREM', TENANT_ENDS, end_member(tenant, tonumber(at), lease_id))
    if pod ~= '' then
      redis.call('ZREM', POD_ENDS, end_member(pod, tonumber(at), lease_id))
    end
    redis.call('ZREM', ENDS, lease_id)
  end
  if pod ~= '' then
    redis.call('HDEL', LEASE_PODS, lease_id)
    count_on_pod(pod, -blocks)
  end
  redis.call('HDEL', LEASES, lease_id)
  redis.call('ZREM', EXPIRIES, lease_id)
  if redis.call('HINCRBY', TENANTS, tenant, -blocks) <= 0 then
    redis.call('HDEL', TENANTS, tenant)
  end
  if redis.call('DECRBY', RESERVED, blocks) <= 0 then
    redis.call('DEL', RESERVED)
  end
  return blocks
end

-- Record a lease (no checks) on `pod` ('': none) with its expiry and its expected end.
local function record(lease_id, tenant, blocks, pod, expiry, ends_at)
  redis.call('HSET', LEASES, lease_id, blocks .. ':' .. tenant)
  redis.call('ZADD', EXPIRIES, expiry, lease_id)
  redis.call('HINCRBY', TENANTS, tenant, blocks)
  redis.call('INCRBY', RESERVED, blocks)
  if pod ~= '' then
    redis.call('HSET', LEASE_PODS, lease_id, pod)
    count_on_pod(pod, blocks)
  end
  expect_end(lease_id, tenant, pod, ends_at)
end

-- Count `growth` more blocks for a held lease of `tenant` on `pod` (no checks), which then
-- counts `blocks` in all: drop() gives back the grown amount.
local function grow(lease_id, tenant, pod, growth, blocks)
  redis.call('HSET', LEASES, lease_id, blocks .. ':' .. tenant)
  redis.call('HINCRBY', TENANTS, tenant, growth)
  redis.call('INCRBY', RESERVED, growth)
  count_on_pod(pod, growth)
end

-- Hold a lease of `tenant` counting `blocks` on pod `to` instead of `from` (no checks).
local function move(lease_id, tenant, blocks, from, to)
  local at = redis.call('ZSCORE', ENDS, lease_id)
  if at and from ~= '' then
    redis.call('ZREM', POD_ENDS, end_member(from, tonumber(at), lease_id))
  end
  count_on_pod(from, -blocks)
  count_on_pod(to, blocks)
  redis.call('HSET', LEASE_PODS, lease_id, to)
  if at then
    redis.call('ZADD', POD_ENDS, 0, end_member(to, tonumber(at), lease_id))
  end
end

-- Lookups per HMGET in the walks below (unpack has a stack limit).
local WALK_BATCH = 1000

local function pool_promised()
  return tonumber(redis.call('GET', PROMISED) or '0')
end

local function tenant_promised(tenant)
  return tonumber(redis.call('HGET', PROMISED_TENANTS, tenant) or '0')
end

local function pool_holding()
  return tonumber(redis.call('GET', HOLDING) or '0')
end

local function tenant_holding(tenant)
  return tonumber(redis.call('HGET', HOLDING_TENANTS, tenant) or '0')
end

-- Move a pool counter (string `total`) and a tenant's counter (hash `by_tenant`) by `change`,
-- deleting what reaches 0.
local function add(total, by_tenant, tenant, change)
  if redis.call('HINCRBY', by_tenant, tenant, change) <= 0 then
    redis.call('HDEL', by_tenant, tenant)
  end
  if redis.call('INCRBY', total, change) <= 0 then
    redis.call('DEL', total)
  end
end

-- A promise's stored value as {blocks, retry_at, expiry, holding, returned, seq, tenant} (the
-- tenant may hold ':', so it comes last).
local function parse_promise(value)
  local fields, start = {}, 1
  for _ = 1, 5 do
    local sep = string.find(value, ':', start, true)
    fields[#fields + 1] = string.sub(value, start, sep - 1)
    start = sep + 1
  end
  return {
    blocks = tonumber(fields[1]),
    retry_at = tonumber(fields[2]),
    expiry = tonumber(fields[3]),
    holding = string.sub(fields[4], 1, 1) == '1',
    returned = string.sub(fields[4], 2, 2) == '1',
    seq = tonumber(fields[5]),
    tenant = string.sub(value, start),
  }
end

local function store_promise(key, p)
  local value = p.blocks .. ':' .. p.retry_at .. ':' .. p.expiry .. ':'
    .. (p.holding and '1' or '0') .. (p.returned and '1' or '0') .. ':' .. p.seq .. ':'
    .. p.tenant
  redis.call('HSET', PROMISES, key, value)
end

-- The promise's member of PROMISE_LINES, its place in its tenant's line.
local function line_member(key, p)
  return line_of(p.tenant) .. string.format('%015d', p.seq) .. ':' .. key
end

-- The promise held under `key`, or nil.
local function held_promise(key)
  local value = redis.call('HGET', PROMISES, key)
  return value and parse_promise(value) or nil
end

-- Record a promise under a key that holds none (no checks), last in its tenant's line.
local function promise(key, tenant, blocks, retry_at, expiry)
  local p = {
    blocks = blocks,
    retry_at = retry_at,
    expiry = expiry,
    holding = false,
    returned = false,
    seq = redis.call('INCR', PROMISE_SEQ),
    tenant = tenant,
  }
  store_promise(key, p)
  redis.call('ZADD', PROMISE_LINES, 0, line_member(key, p))
  redis.call('ZADD', PROMISE_EXPIRIES, expiry, key)
  add(PROMISED, PROMISED_TENANTS, tenant, blocks)
end

-- Its client is back at its time (`p` under `key`): its blocks count against its tenant's claims.
local function hold_for(key, p)
  if not p.holding then
    p.holding = true
    store_promise(key, p)
    add(HOLDING, HOLDING_TENANTS, p.tenant, p.blocks)
  end
end

local function budget_of(tenant)
  return tonumber(redis.call('HGET', BUDGETS, tenant) or PROMISE_BUDGET)
end

-- The client of `p` (under `key`) came back: the first time, its tenant may have twice as many
-- promises open (up to the most).
local function came_back(key, p)
  if not p.returned then
    p.returned = true
    store_promise(key, p)
    local budget = math.min(2 * math.max(budget_of(p.tenant), 1), MAX_PROMISE_BUDGET)
    redis.call('HSET', BUDGETS, p.tenant, budget)
  end
end

-- Whether `tenant` may have one more promise open: fewer open than its budget, and at a budget
-- of 0 one more try from `max_wait` ms after the promise that took it there ended.
local function may_promise(tenant, now, max_wait)
  local budget = budget_of(tenant)
  if budget == 0 then
    local unreturned = tonumber(redis.call('HGET', UNRETURNED, tenant) or now)
    if now < unreturned + max_wait then
      return false
    end
    budget = 1
    redis.call('HSET', BUDGETS, tenant, budget)
  end
  local line = line_of(tenant)
  return redis.call('ZLEXCOUNT', PROMISE_LINES, '[' .. line, '[' .. line .. '\255') < budget
end

-- Remove the promise under `key` and give its blocks back (no-op for an unknown key); returns
-- the blocks it held (0 when it did not hold).
local function unpromise(key)
  local p = held_promise(key)
  if not p then
    return 0
  end
  redis.call('HDEL', PROMISES, key)
  redis.call('ZREM', PROMISE_LINES, line_member(key, p))
  redis.call('ZREM', PROMISE_EXPIRIES, key)
  add(PROMISED, PROMISED_TENANTS, p.tenant, -p.blocks)
  if p.holding then
    add(HOLDING, HOLDING_TENANTS, p.tenant, -p.blocks)
    return p.blocks
  end
  return 0
end

-- Blocks promised to `p`'s tenant before `p` (under `key`): all of them, and those held. A
-- tenant has at most its budget of promises open: a short walk.
local function promised_before(key, p)
  local line = line_of(p.tenant)
  local last = '(' .. line_member(key, p)
  local promised, holding, offset = 0, 0, 0
  local skip = #line + 15 + 2 -- the line, the sequence number and ':'
  repeat
    local members = redis.call('ZRANGEBYLEX', PROMISE_LINES, '[' .. line, last, 'LIMIT', offset,
      WALK_BATCH)
    if #members > 0 then
      local keys = {}
      for i, member in ipairs(members) do
        keys[i] = string.sub(member, skip)
      end
      for _, value in ipairs(redis.call('HMGET', PROMISES, unpack(keys))) do
        if value then
          local other = parse_promise(value)
          promised = promised + other.blocks
          holding = holding + (other.holding and other.blocks or 0)
        end
      end
    end
    offset = offset + #members
  until #members < WALK_BATCH
  return promised, holding
end

-- Ms from `now` until the leases of `ids` (in the order given, with their expected ends
-- `ends`), continuing from `freed` blocks, have freed `over` blocks: the answer, or nil and
-- the blocks freed so far. A lease past its expected end is taken to end now.
local function freed_among(ids, ends, over, freed, now)
  if #ids == 0 then
    return nil, freed
  end
  for i, value in ipairs(redis.call('HMGET', LEASES, unpack(ids))) do
    if value then
      freed = freed + parse(value)
      if freed >= over then
        return math.max(0, ends[i] - now), freed
      end
    end
  end
  return nil, freed
end

-- Ms from `now` until the leases that `page(offset)` gives (their ids and expected ends,
-- WALK_BATCH at a time, in the order they are expected to end; `held` blocks in all) have
-- freed `over` blocks: 0 when nothing is over, -1 when they cannot (without walking them when
-- `over` is more than they hold).
local function freed_by(over, held, page, now)
  if over <= 0 then
    return 0
  end
  if over > held then
    return -1
  end
  local freed, offset = 0, 0
  repeat
    local ids, ends = page(offset)
    local at
    at, freed = freed_among(ids, ends, over, freed, now)
    if at then
      return at
    end
    offset = offset + #ids
  until #ids < WALK_BATCH
  return -1
end

-- `freed_by` over the pool's leases.
local function pool_freed_by(over, now)
  local function page(offset)
    local flat = redis.call('ZRANGEBYSCORE', ENDS, '-inf', '+inf', 'WITHSCORES', 'LIMIT',
      offset, WALK_BATCH)
    local ids, ends = {}, {}
    for i = 1, #flat, 2 do
      ids[#ids + 1], ends[#ends + 1] = flat[i], tonumber(flat[i + 1])
    end
    return ids, ends
  end
  return freed_by(over, pool_reserved(), page, now)
end

-- `freed_by` over the leases of one line of `by_line` (TENANT_ENDS or POD_ENDS): `owner`'s,
-- `held` blocks in all.
local function line_freed_by(by_line, owner, held, over, now)
  local line = line_of(owner)
  local skip = #line + 15 + 2
  local function page(offset)
    local members = redis.call('ZRANGEBYLEX', by_line, '[' .. line, '[' .. line .. '\255',
      'LIMIT', offset, WALK_BATCH)
    local ids, ends = {}, {}
    for i, member in ipairs(members) do
      ids[i] = string.sub(member, skip)
      ends[i] = tonumber(string.sub(member, #line + 1, #line + 15))
    end
    return ids, ends
  end
  return freed_by(over, held, page, now)
end

-- `freed_by` over `tenant`'s leases alone.
local function tenant_freed_by(tenant, over, now)
  return line_freed_by(TENANT_ENDS, tenant, tenant_reserved(tenant), over, now)
end

-- `freed_by` over the leases held on `pod` alone.
local function pod_freed_by(pod, over, now)
  return line_freed_by(POD_ENDS, pod, pod_reserved(pod), over, now)
end

-- End the promises whose grace has ended; a tenant whose ended promise never saw its client
-- back has its budget halved, and at 0 is marked unreturned at that promise's expiry. Returns
-- the blocks that the ended ones held.
local function reclaim_promises(now)
  local freed_blocks = 0
  local ended = redis.call('ZRANGEBYSCORE', PROMISE_EXPIRIES, '-inf', now, 'LIMIT', 0,
    RECLAIM_BATCH)
  for _, key in ipairs(ended) do
    local p = held_promise(key)
    if p and not p.returned then
      local budget = math.floor(budget_of(p.tenant) / 2)
      redis.call('HSET', BUDGETS, p.tenant, budget)
      if budget == 0 then
        redis.call('HSET', UNRETURNED, p.tenant, p.expiry)
      end
    end
    freed_blocks = freed_blocks + unpromise(key)
    redis.call('ZREM', PROMISE_EXPIRIES, key) -- as for leases
  end
  return freed_blocks
end

-- Reclaim leases whose expiry is at or before `now` (the memory ledger's rule too), and
-- promises (reclaim_promises); the blocks they free are published (publish_freed).
local function reclaim(now)
  local freed_blocks = 0
  local expired = redis.call('ZRANGEBYSCORE', EXPIRIES, '-inf', now, 'LIMIT', 0, RECLAIM_BATCH)
  for _, lease_id in ipairs(expired) do
    freed_blocks = freed_blocks + drop(lease_id)
    redis.call('ZREM', EXPIRIES, lease_id) -- an expiry without a lease (never left, but be sure)
  end
  publish_freed(freed_blocks + reclaim_promises(now))
end

-- Ms from `now` until a lease or a promise expires by itself: when room may appear without a
-- release (0 when one is due already, -1 when none is).
local function next_change(now)
  local due = nil
  for _, key in ipairs({EXPIRIES, PROMISE_EXPIRIES}) do
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
  local value = redis.call('GET', EPOCH)
  if not value then
    local t = redis.call('TIME')
    value = t[1] .. '.' .. t[2] .. '.' .. tostring(math.random(1, 1000000000))
    redis.call('SET', EPOCH, value)
  end
  return value
end
