-- seed.lua: start the missing budget windows of scopes of one org from
-- their seeds (the ledger's spend, answered by the control plane), never
-- overwriting a window that exists.
--
-- KEYS: 1 .. n the scopes' state hashes (common.lua; one org, so one hash
--   tag).
-- ARGV: 1 number of seeds n, then 4 values per seed i (base 1 + 4(i-1)):
--   budget unit ('h', 'd', 'mo'), budget n, window start (Unix s) the
--   seed was summed for, spend micro-USD.
-- Returns one integer per seed: 1 written; 0 not needed (the scope holds
--   a window already: another data plane seeded it, or it is an older one
--   of an intact state, which admit.lua restarts at zero); -1 stale (the
--   seed's window is not the current one any more: ask again).
-- A written window's spend is the seed plus the reservations renew.lua
-- re-asserted while it was missing ('bp', 'bpw'): running requests are not
-- in the ledger yet.

local now_s = math.floor(now_ms() / 1000)
local n = tonumber(ARGV[1])
local out = {}
for i = 1, n do
  local a = 1 + 4 * (i - 1)
  local unit, bn = ARGV[a + 1], tonumber(ARGV[a + 2])
  local start, spend = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local idx, ws, we = budget_window(unit, bn, now_s)
  if ws ~= start then
    out[i] = -1
  else
    local hk = KEYS[i]
    local v = redis.call('HMGET', hk, 'bw', 'bp', 'bpw')
    if budget_held(v[1], unit, bn, idx) ~= 'missing' then
      out[i] = 0
    else
      local id = bw_id(unit, bn, idx)
      local pend = 0
      if v[3] == id then pend = tonumber(v[2]) or 0 end
      redis.call('HSET', hk, 'bw', id, 'bs', spend + pend)
      redis.call('HDEL', hk, 'bp', 'bpw')
      redis.call('EXPIREAT', hk, we + 3600)
      out[i] = 1
    end
  end
end
return out
