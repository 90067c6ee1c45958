-- reserve: admit one claim against the pool limit and the tenant's quota, in one atomic step:
-- refuse an impossible claim first, reclaim expired leases and promises, check both limits
-- (the blocks held for the tenant's own retries that came back count as reserved; another
-- tenant's never do), record the lease with its expected end; or tell a refused claim when the
-- leases expected to end first free what it needs, and promise it that slot.
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease id; ARGV[2] tenant; ARGV[3] blocks; ARGV[4] pool limit (most blocks the pool
--   may hold reserved: capacity minus the watermark); ARGV[5] tenant quota (blocks);
--   ARGV[6] lease time (ms); ARGV[7] retry key ('' or absent: none); ARGV[8] ms until the
--   lease is expected to end ('' or absent: at its expiry); the terms, absent or '' when the
--   claim has none: ARGV[9] max wait (ms), ARGV[10] jitter (ms), ARGV[11] grace (ms); then
--   the pods it may be reserved on, none or more, in order of preference: ARGV[12+2i] pod,
--   ARGV[13+2i] its limit (most blocks the pod may hold reserved). With pods, the claim also
--   fits only on a pod where its blocks stay within the pod's limit, and is held on the one
--   left with the most free blocks (the earliest on a tie).
-- Returns {outcome, pool reserved, tenant reserved, epoch, wait, retry after, promised,
--   changes in, waiting, held, pod}, built by name in `answer` below and read by name in
--   kvguard.ledger.scripts.ReserveAnswer: outcome 0 admitted, 1 tenant quota, 2 pool
--   watermark; reserved amounts in blocks after this step (promised blocks not included);
--   epoch '' when an impossible claim was refused without reading it; wait: ms until a refused
--   claim with terms is expected to fit, counting its tenant's promises before it (-1: the
--   leases' expected ends cannot free enough, or it never will; 0 without terms, when
--   admitted, or back at its promise's time); retry after: ms until the client should retry
--   (-1: not within max wait, or no terms); promised: 1 when the claim is promised that slot,
--   0 when the time is only told; changes in: for a refused claim, ms until a lease or a
--   promise expires by itself (-1: nothing is due, or admitted); waiting: for a claim back at
--   its promise's time and refused (its blocks now held for it), ms they stay held, else 0;
--   held: the blocks held for its tenant's retries that this claim counted (0 for a retried
--   call or an impossible claim); pod: the pod an admitted claim is held on ('' for a claim
--   without pods, and when refused). A lease id that is already held is admitted again
--   without being counted twice (a retried call).
--#include lib.lua

local NONE = -1

-- The answer, its slots in the order above, from their names; a slot left out is as for an
-- admitted claim: wait 0, retry after NONE, promised 0, changes in NONE, waiting 0, held 0,
-- pod ''.
local function answer(a)
  return {a.outcome, a.pool_reserved, a.tenant_reserved, a.epoch, a.wait or 0,
    a.retry_after or NONE, a.promised or 0, a.changes_in or NONE, a.waiting or 0, a.held or 0,
    a.pod or ''}
end

local lease_id, tenant = ARGV[1], ARGV[2]
local blocks = positive_int(ARGV[3], 'blocks')
local limit, quota = tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms = positive_int(ARGV[6], 'lease time (ms)')
local key = ARGV[7] or ''
local ends_in = nil
if ARGV[8] and ARGV[8] ~= '' then
  ends_in = non_negative_int(ARGV[8], 'expected end (ms)')
end
local terms = nil
if ARGV[9] and ARGV[9] ~= '' then
  terms = {
    max_wait = non_negative_int(ARGV[9], 'max wait (ms)'),
    jitter = non_negative_int(ARGV[10], 'jitter (ms)'),
    grace = non_negative_int(ARGV[11], 'grace (ms)'),
  }
end
local pods, largest = {}, nil
for i = 12, #ARGV, 2 do
  local pod_limit = tonumber(ARGV[i + 1])
  pods[#pods + 1] = {address = ARGV[i], limit = pod_limit}
  largest = largest and math.max(largest, pod_limit) or pod_limit
end

-- Of `pods`, the one where `blocks` more fit that is left with the most free blocks (the
-- earliest on a tie), or nil.
local function pick()
  local addresses = {}
  for i, pod in ipairs(pods) do
    addresses[i] = pod.address
  end
  local best, most = nil, -1
  for i, reserved in ipairs(redis.call('HMGET', POD_RESERVED, unpack(addresses))) do
    local free = pods[i].limit - tonumber(reserved or '0') - blocks
    if free > most then
      best, most = pods[i], free
    end
  end
  return best
end

-- Impossible whatever else is reserved: answer before writing anything (epoch '' = not read).
local never = terms and NONE or 0
if blocks > quota or blocks > limit or (largest and blocks > largest) then
  local outcome = blocks > quota and 1 or 2
  local changes = next_change(now_ms())
  return answer({outcome = outcome, pool_reserved = pool_reserved(),
    tenant_reserved = tenant_reserved(tenant), epoch = '', wait = never, changes_in = changes})
end

local now = now_ms()
reclaim(now)
local current = epoch()
if redis.call('HEXISTS', LEASES, lease_id) == 1 then
  return answer({outcome = 0, pool_reserved = pool_reserved(),
    tenant_reserved = tenant_reserved(tenant), epoch = current, pod = pod_of(lease_id)})
end
local tenant_now = tenant_reserved(tenant)
local pool_now = pool_reserved()
-- A promise under this key is this claim's own only when it is its tenant's; another tenant's
-- is left alone, and the claim is treated as one without a key.
local own = key ~= '' and held_promise(key) or nil
if own and own.tenant ~= tenant then
  key, own = '', nil
end
local promised, held
if own then
  -- Back at its time or after: a client that retried. Before it, the same body may be
  -- another client's: it does not count as one coming back.
  if own.retry_at <= now then
    came_back(key, own)
  end
  promised, held = promised_before(key, own)
else
  promised, held = tenant_promised(tenant), tenant_holding(tenant)
end
-- Only this tenant's retries that came back count, in its quota and the pool alike.
local outcome, picked = 0, nil
if tenant_now + held + blocks > quota then
  outcome = 1
elseif pool_now + held + blocks > limit then
  outcome = 2
elseif #pods > 0 then
  picked = pick()
  if not picked then
    outcome = 2
  end
end
if outcome ~= 0 then
  -- A refusal's answer: wait, retry after, promised and waiting as above, with the pool as it
  -- is now.
  local function refused(wait, retry_after, promised_to, waiting)
    local changes = next_change(now)
    return answer({outcome = outcome, pool_reserved = pool_now, tenant_reserved = tenant_now,
      epoch = current, wait = wait, retry_after = retry_after, promised = promised_to,
      changes_in = changes, waiting = waiting, held = held})
  end
  if own and own.retry_at <= now then
    -- Back at its time, its blocks not free yet: they are held for it (against its tenant's
    -- later claims) until its grace ends, which the caller may wait for.
    hold_for(key, own)
    return refused(0, 0, 1, own.expiry - now)
  end
  if not terms then
    return refused(0, NONE, 0, 0)
  end
  -- The later of when its tenant's leases free its quota and the pool's free its limit.
  local by_quota = tenant_freed_by(tenant, tenant_now + promised + blocks - quota, now)
  local by_limit = pool_freed_by(pool_now + promised + blocks - limit, now)
  local wait = NONE
  if by_quota ~= NONE and by_limit ~= NONE then
    wait = math.max(by_quota, by_limit)
  end
  if wait ~= NONE and #pods > 0 then
    -- And the first of its pods to free enough.
    local by_pod = NONE
    for _, pod in ipairs(pods) do
      local reserved = pod_reserved(pod.address)
      local at = pod_freed_by(pod.address, reserved + blocks - pod.limit, now)
      if at ~= NONE and (by_pod == NONE or at < by_pod) then
        by_pod = at
      end
    end
    wait = by_pod ~= NONE and math.max(wait, by_pod) or NONE
  end
  if own then -- back before its time: it keeps it
    return refused(wait, own.retry_at - now, 1, 0)
  end
  if wait == NONE or wait > terms.max_wait then
    return refused(wait, NONE, 0, 0)
  end
  local retry_at = now + wait + terms.jitter
  if key == '' or not may_promise(tenant, now, terms.max_wait) then
    -- No key to know the retry by, or as many promises open as this tenant's clients have
    -- earned by coming back: tell the time, promise nothing.
    return refused(wait, retry_at - now, 0, 0)
  end
  promise(key, tenant, blocks, retry_at, retry_at + terms.grace)
  return refused(wait, retry_at - now, 1, 0)
end
if own then
  unpromise(key)
end
local expiry = now + lease_ms
local pod = picked and picked.address or ''
record(lease_id, tenant, blocks, pod, expiry, ends_in and now + ends_in or expiry)
return answer({outcome = 0, pool_reserved = pool_now + blocks,
  tenant_reserved = tenant_now + blocks, epoch = current, held = held, pod = pod})
