-- release: give leases' blocks back. Idempotent: an unknown or already released lease is a
-- no-op. No reclaim here, so that a release stays O(leases).
-- KEYS: all the keys of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV: the lease ids (releases that queued up behind each other are sent together).
-- Returns the blocks released (0 when none of the leases was held), also published on the
-- pool's channel kvguard:{pool}:freed when there are any (lib.lua, publish_freed).
--#include lib.lua

local released = 0
for i = 1, #ARGV do
  released = released + drop(ARGV[i])
end
publish_freed(released)
return released
