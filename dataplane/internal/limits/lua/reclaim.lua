-- reclaim.lua: reclaim the expired budget leases of quota slices of some
-- scopes of one org (a sweeper's call, sweep.go; docs/limits.md, "Budget
-- leases"), as carve.lua and admit.lua do for the scopes they touch: an
-- expired entry's g - b goes back to the window it names while the scope
-- holds that window, b stays spent. Scopes nobody admits or carves for any
-- more (a dead data plane was their only user) get their budget back too.
--
-- KEYS: 1 the org's budget-lease index, then the scopes' state hashes
--   (found in the index by the sweeper).
-- ARGV: 1 lease TTL ms
-- Returns {micro-USD reclaimed, scopes changed}.

local now = now_ms()
local lease_ttl = tonumber(ARGV[1])
local total, changed = 0, 0
for i = 2, #KEYS do
  local hk = KEYS[i]
  local v = redis.call('HMGET', hk, 'bw', 'bs', 'bh')
  local back, bh, hs = bh_reclaim(v[3], v[1], now)
  if bh then
    local spend = math.max((tonumber(v[2]) or 0) - back, 0)
    redis.call('HSET', hk, 'bs', spend, 'bh', bh)
    total, changed = total + back, changed + 1
  end
  if hs then
    bh_index(KEYS[1], hk, hs, lease_ttl)
  else
    -- No lease of the window the scope holds (or no state at all).
    redis.call('ZREM', KEYS[1], hk)
  end
end
return { total, changed }
