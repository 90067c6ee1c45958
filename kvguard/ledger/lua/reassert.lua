-- reassert: make the ledger hold leases that a process knows are in use (its open streams),
-- idempotently: a lease already held is renewed, a missing one (Redis restarted empty, or it
-- expired while its stream was still open, or it was taken on the local fallback ledger during
-- an outage) is recorded again WITHOUT limit checks: its request is running whatever the limits
-- say, and the ledger must count it. A held lease sent with more blocks than it counts grows to
-- them (pool and tenant reserved rise by the difference), also without checks; one sent with
-- fewer keeps its count: counted blocks never shrink. A lease sent with an expected end is
-- expected to end then; one sent without keeps its own (recorded again: its expiry). A held
-- lease sent with another pod is moved there, its counted blocks with it ('': it keeps its own).
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease time (ms); then five per lease: ARGV[2+5i] lease id, ARGV[3+5i] tenant,
--   ARGV[4+5i] blocks, ARGV[5+5i] ms until it is expected to end ('': unchanged), ARGV[6+5i]
--   the pod it is held on ('': none, or unchanged).
-- Returns {leases recorded again, pool reserved (blocks) after this step, epoch}.
--#include lib.lua

local lease_ms = positive_int(ARGV[1], 'lease time (ms)')
local now = now_ms()
reclaim(now)
local current = epoch()
local added = 0
for i = 2, #ARGV, 5 do
  local lease_id, tenant, pod = ARGV[i], ARGV[i + 1], ARGV[i + 4]
  local blocks = positive_int(ARGV[i + 2], 'blocks')
  local ends_at = nil
  if ARGV[i + 3] ~= '' then
    ends_at = now + non_negative_int(ARGV[i + 3], 'expected end (ms)')
  end
  local value = redis.call('HGET', LEASES, lease_id)
  if value then
    redis.call('ZADD', EXPIRIES, 'XX', now + lease_ms, lease_id)
    local counted, held_by = parse(value)
    local held_on = pod_of(lease_id)
    if blocks > counted then
      grow(lease_id, held_by, held_on, blocks - counted, blocks)
      counted = blocks
    end
    if pod ~= '' and pod ~= held_on then
      move(lease_id, held_by, counted, held_on, pod)
      held_on = pod
    end
    if ends_at then
      expect_end(lease_id, held_by, held_on, ends_at)
    end
  else
    record(lease_id, tenant, blocks, pod, now + lease_ms, ends_at or now + lease_ms)
    added = added + 1
  end
end
return {added, pool_reserved(), current}
