-- reserve: admit one claim against the pool limit and the tenant's quota, in one atomic step:
-- refuse an impossible claim first, reclaim expired leases and promises, check both limits
-- (held promised blocks count as reserved), record the lease; or tell a refused claim when it
-- is expected to fit, and promise it that slot.
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease id; ARGV[2] tenant; ARGV[3] blocks; ARGV[4] pool limit (most blocks the pool
--   may hold reserved: capacity minus the watermark); ARGV[5] tenant quota (blocks);
--   ARGV[6] lease time (ms); ARGV[7] retry key ('' or absent: none); the terms, absent or ''
--   when the claim has none: ARGV[8] hold time (s, a number: until a release is measured, the
--   pool frees its reserved blocks / hold time a second), ARGV[9] max wait (ms), ARGV[10]
--   jitter (ms), ARGV[11] grace (ms).
-- Returns {outcome, pool reserved, tenant reserved, epoch, wait, retry after, promised,
--   changes in, waiting, pool held, tenant held}: outcome 0 admitted, 1 tenant quota, 2 pool watermark; reserved
--   amounts in blocks after this step (promised blocks not included); epoch '' when an
--   impossible claim was refused without reading it; wait: ms until a refused claim with terms
--   is expected to fit, counting every promise before it (-1: it never will; 0 without terms,
--   when admitted, or back at its promise's time); retry after: ms until the client should
--   retry (-1: not within max wait, or no terms); promised: 1 when the claim's blocks are held
--   for that retry, 0 when the time is only told; changes in: for a refused claim, ms until a
--   lease or a promise ends or a promise starts holding, by itself (-1: nothing is due, or
--   admitted); waiting: for a claim back at its promise's time and refused (its blocks held but
--   not all free yet), ms they stay held for it, else 0; pool held, tenant held: the promised
--   blocks held that this claim counted (0 for a retried call or an impossible claim). A lease
--   id that is already held is admitted again without being counted twice (a retried call).
--#include lib.lua

local NONE = -1
local lease_id, tenant = ARGV[1], ARGV[2]
local blocks = positive_int(ARGV[3], 'blocks')
local limit, quota = tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms = positive_int(ARGV[6], 'lease time (ms)')
local key = ARGV[7] or ''
local terms = nil
if ARGV[8] and ARGV[8] ~= '' then
  terms = {
    hold_s = non_negative_number(ARGV[8], 'hold time (s)'),
    max_wait = non_negative_int(ARGV[9], 'max wait (ms)'),
    jitter = non_negative_int(ARGV[10], 'jitter (ms)'),
    grace = non_negative_int(ARGV[11], 'grace (ms)'),
  }
end

-- Impossible whatever else is reserved: answer before writing anything (epoch '' = not read).
local never = terms and NONE or 0
if blocks > quota or blocks > limit then
  local outcome = blocks > quota and 1 or 2
  local changes = next_change(now_ms())
  return {outcome, pool_reserved(), tenant_reserved(tenant), '', never, NONE, 0, changes, 0, 0, 0}
end

-- How fast room is freed, as (blocks a second, blocks a release): the faster of the rate
-- measured by `drain` (a stored drain value) since the pool was first seen and `reserved` blocks
-- held the hold time each (the measure lags when the blocks held have just grown); releases of
-- the size measured, else of this claim's size (kvguard.ledger.Terms).
local function rate_of(drain, now, reserved)
  local held = terms.hold_s > 0 and reserved / terms.hold_s or math.huge
  local freed, releases = decayed(drain, now)
  if releases <= 0 then
    return {held, blocks}
  end
  -- The decayed sums of a window that began when the pool was first seen weigh less than a
  -- full one.
  local since = tonumber(redis.call('GET', KEYS[20]) or now)
  local span = math.max(now - since, DRAIN_WINDOW_MS / 10)
  local weight = DRAIN_WINDOW_MS / 1000 * (1 - math.exp(-span / DRAIN_WINDOW_MS))
  return {math.max(freed / weight, held), freed / releases}
end

-- Seconds until releases at `rate` (as rate_of gives it) have freed `over` blocks, on average:
-- 0 when nothing is over.
local function fit_s(over, rate)
  if over <= 0 then
    return 0
  end
  return math.ceil(over / rate[2]) * rate[2] / rate[1]
end

local function ms(seconds)
  return math.floor(seconds * 1000 + 0.5)
end

local now = now_ms()
reclaim(now)
local current = epoch()
if redis.call('HEXISTS', KEYS[1], lease_id) == 1 then
  return {0, pool_reserved(), tenant_reserved(tenant), current, 0, NONE, 0, NONE, 0, 0, 0}
end
local tenant_now = tenant_reserved(tenant)
local pool_now = pool_reserved()
-- A promise under this key is this claim's own only when it is its tenant's; another tenant's
-- is left alone, and the claim is treated as one without a key.
local own = key ~= '' and held_promise(key) or nil
if own and own.tenant ~= tenant then
  key, own = '', nil
end
local pool_all, pool_held, tenant_all, tenant_held
if own then
  -- Back at its time or after: a client that retried. Before it, the same body may be
  -- another client's: it does not count as one coming back.
  if own.retry_at <= now then
    came_back(key, own)
  end
  pool_all, pool_held, tenant_all, tenant_held = promised_before(key, tenant)
else
  pool_all, pool_held = pool_promised(), pool_holding()
  tenant_all, tenant_held = tenant_promised(tenant), tenant_holding(tenant)
end
-- Held blocks count now; all promised ones count for when this claim would fit.
local outcome = 0
if tenant_now + tenant_held + blocks > quota then
  outcome = 1
elseif pool_now + pool_held + blocks > limit then
  outcome = 2
end
if outcome ~= 0 then
  -- A refusal's answer: wait, retry after, promised and waiting as above, with the pool as it
  -- is now.
  local function refused(wait, retry_after, promised, waiting)
    local changes = next_change(now)
    return {outcome, pool_now, tenant_now, current, wait, retry_after, promised, changes, waiting,
      pool_held, tenant_held}
  end
  if own and own.retry_at <= now then
    -- Back at its time, its blocks held but not all free yet: they stay held for it until its
    -- grace ends, which the caller may wait for.
    return refused(0, 0, 1, own.expiry - now)
  end
  if not terms then
    return refused(0, NONE, 0, 0)
  end
  local over_quota = tenant_now + tenant_all + blocks - quota
  local over_limit = pool_now + pool_all + blocks - limit
  local tenant_drain = redis.call('HGET', KEYS[19], tenant)
  local by_quota = rate_of(tenant_drain, now, tenant_now > 0 and tenant_now or quota)
  local by_limit = rate_of(redis.call('GET', KEYS[18]), now, pool_now > 0 and pool_now or limit)
  local wait_s = math.max(fit_s(over_quota, by_quota), fit_s(over_limit, by_limit))
  -- 2^53 ms: past any max wait, and still an integer reply.
  local wait = math.min(ms(wait_s), 9007199254740992)
  if own then -- back before its time: it keeps it
    return refused(wait, own.retry_at - now, 1, 0)
  end
  if wait_s * 1000 > terms.max_wait then
    return refused(wait, NONE, 0, 0)
  end
  local retry_at = now + wait + terms.jitter
  if key == '' or not may_promise(tenant, now, terms.max_wait) then
    -- No key to know the retry by, or as many promises open as this tenant's clients have
    -- earned by coming back: tell the time, hold nothing.
    return refused(wait, retry_at - now, 0, 0)
  end
  -- Held from as long before its time as its own blocks take to free: blocks freed earlier
  -- serve other claims meanwhile.
  local own_s = math.max(
    fit_s(math.min(over_quota, blocks), by_quota),
    fit_s(math.min(over_limit, blocks), by_limit)
  )
  local hold_at = now + math.max(0, wait - ms(own_s))
  promise(key, tenant, blocks, hold_at, retry_at, retry_at + terms.grace,
    over_quota <= 0 and over_limit > 0)
  return refused(wait, retry_at - now, 1, 0)
end
if own then
  unpromise(key)
end
record(lease_id, tenant, blocks, now + lease_ms)
return {0, pool_now + blocks, tenant_now + blocks, current, 0, NONE, 0, NONE, 0, pool_held,
  tenant_held}
