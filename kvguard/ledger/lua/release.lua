-- release: give a lease's blocks back. Idempotent: an unknown or already released lease is a
-- no-op. No reclaim here, so that a release stays O(1).
-- KEYS: leases, expiries, tenants, reserved of one pool (see lib.lua), hash-tagged {pool}.
-- ARGV[1] lease id.
-- Returns the blocks released (0 when the lease was not held).
--#include lib.lua

return drop(ARGV[1])
