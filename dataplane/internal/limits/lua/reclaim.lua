-- reclaim.lua: reclaim the expired budget and rate leases of quota slices
-- of some scopes of one org (a sweeper's call, sweep.go; docs/limits.md,
-- "Budget leases", "Rate leases"), as carve.lua (and, for budgets,
-- admit.lua) does for the scopes it touches: an expired budget entry's
-- g - b goes back to the window it names while the scope holds that
-- window, b stays spent; an expired rate entry's gr - wr and gt - wt go
-- back to its bucket while that is in the window. Scopes nobody admits or
-- carves for any more (a dead data plane was their only user) get their
-- budget and their window back too.
--
-- KEYS: 1 the org's lease index of slices, then the scopes' state hashes
--   (found in the index by the sweeper).
-- ARGV: 1 lease TTL ms, 2 rate bucket ms, 3 rate window ms
-- Returns {micro-USD reclaimed, scopes changed, requests reclaimed, tokens
--   reclaimed}.

local now = now_ms()
local lease_ttl = tonumber(ARGV[1])
local bms = tonumber(ARGV[2])
local nb = math.floor(tonumber(ARGV[3]) / bms)
local cur = math.floor(now / bms)
local total, changed, treq, ttok = 0, 0, 0, 0
for i = 2, #KEYS do
  local hk = KEYS[i]
  local v = redis.call('HMGET', hk, 'bw', 'bs', 'bh', 'ql')
  local back, bh, hs = bh_reclaim(v[3], v[1], now)
  local ch = false
  if bh then
    local spend = math.max((tonumber(v[2]) or 0) - back, 0)
    redis.call('HSET', hk, 'bs', spend, 'bh', bh)
    total, ch = total + back, true
  end
  local rl = rl_parse(v[4])
  local br, bt, rch = rl_reclaim(hk, rl, now, bms, cur, nb)
  if rch then
    if #rl > 0 then redis.call('HSET', hk, 'ql', rl_format(rl)) else redis.call('HDEL', hk, 'ql') end
    treq, ttok, ch = treq + br, ttok + bt, true
  end
  if ch then changed = changed + 1 end
  local bfirst = nil
  if hs then bfirst = bh_first(hs) end
  -- No lease left (or no state at all): the index drops the scope.
  lease_index(KEYS[1], hk, bfirst, rl_first(rl, bms), lease_ttl, now)
end
return { total, changed, treq, ttok }
