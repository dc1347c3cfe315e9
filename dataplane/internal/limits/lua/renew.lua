-- renew.lua: extend the leases of a live request, or re-assert its whole
-- admission after the org's Redis state was lost.
--
-- KEYS: layout of common.lua (epoch, record, then 4 keys per scope).
-- ARGV:
--   1 request id   2 estimated tokens   3 reserved cost (micro-USD)
--   4 lease TTL ms 5 record TTL ms      6 rate window ms   7 bucket ms
--   8 number of scopes n
--   then 6 values per scope i (base 8 + 6(i-1)):
--     has tpm (0/1), has parallel (0/1), budget unit ('-' = none),
--     budget n, seed micro-USD, seed window start (Unix s; 0 = current)
-- Returns {state, epoch}: state 0 = already settled (nothing done),
--   1 = renewed (lease expiries and the record TTL pushed forward),
--   2 = re-asserted: the record was missing (Redis lost the org's state or
--       the record expired), so the leases, the token estimate and the cost
--       reservation were written again without checking limits: the request
--       is already running.

local now = now_ms()
local rid = ARGV[1]
local est = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local lease_ttl = tonumber(ARGV[4])
local record_ttl = tonumber(ARGV[5])
local window_ms = tonumber(ARGV[6])
local bms = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local cur = math.floor(now / bms)

local epoch = ensure_epoch(now)
local rec = record_get()
if rec['done'] then
  return { 0, epoch }
end
local state = 1
local newrec = nil
if not rec['est'] then
  state = 2
  newrec = { 'est', est, 'cost', cost, 'b', cur }
end
for i = 1, n do
  local a = 8 + 6 * (i - 1)
  if ARGV[a + 2] == '1' then
    local pk = scope_key(i, 3)
    redis.call('ZADD', pk, now + lease_ttl, rid)
    redis.call('PEXPIRE', pk, 2 * lease_ttl)
  end
  if state == 2 then
    if ARGV[a + 1] == '1' then
      win_add(scope_key(i, 2), cur, est, window_ms + 2 * bms)
    end
    local unit = ARGV[a + 3]
    if unit ~= '-' then
      local idx, ws, we = budget_window(unit, tonumber(ARGV[a + 4]), math.floor(now / 1000))
      budget_load(scope_key(i, 4), idx, ws, we, tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]))
      redis.call('HINCRBY', scope_key(i, 4), 's', cost)
      newrec[#newrec + 1] = 'w' .. i
      newrec[#newrec + 1] = idx
    end
  end
end
if newrec then
  redis.call('HSET', KEYS[2], unpack(newrec))
end
redis.call('PEXPIRE', KEYS[2], record_ttl)
return { state, epoch }
