-- settle.lua: release a request's leases and reconcile its token estimate
-- and cost reservation with the real usage, exactly once per request id.
--
-- KEYS: layout of common.lua (epoch, record, then 4 keys per scope).
-- ARGV:
--   1 request id   2 actual tokens   3 actual cost (micro-USD)
--   4 rate window ms   5 bucket ms   6 tombstone TTL ms
--   7 number of scopes n   8 number of alert thresholds m
--   9 .. 8+m alert thresholds (percent of the cap)
--   then 9 values per scope i (base 8 + m + 9(i-1)):
--     has tpm (0/1), has parallel (0/1), budget unit ('-' = none),
--     budget n, cap micro-USD (0 = none), soft budget micro-USD (0 = none),
--     seed micro-USD, seed window start (Unix s; 0 = current),
--     refund rpm (0/1: the request was cancelled, its admission answered
--     as failed; give its request back to the rpm window)
-- Returns {state, epoch, alerts...}: state 0 = already settled (no-op),
--   1 = settled against the admission record,
--   2 = settled without a record (state lost or record expired): leases
--       removed and the actual usage charged in full to the current windows.
--   Then one triple per alert that fired now (each fires once per scope,
--   threshold and budget window): scope (1-based), threshold percent (0 =
--   soft budget), spend micro-USD.

local now = now_ms()
local rid = ARGV[1]
local tokens = tonumber(ARGV[2])
local actual = tonumber(ARGV[3])
local window_ms = tonumber(ARGV[4])
local bms = tonumber(ARGV[5])
local tomb_ttl = tonumber(ARGV[6])
local n = tonumber(ARGV[7])
local m = tonumber(ARGV[8])
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)

local epoch = ensure_epoch(now)
local rec = record_get()
if rec['done'] then
  return { 0, epoch }
end
local has_rec = rec['est'] ~= nil
local state = 2
if has_rec then state = 1 end
local est = tonumber(rec['est'] or 0)
local reserved = tonumber(rec['cost'] or 0)
local b = tonumber(rec['b'] or cur)
local out = { state, epoch }
-- The alert markers of a budget hash: 'a<pct>' per threshold, then 'soft'.
local markers = {}
for j = 1, m do markers[j] = 'a' .. ARGV[8 + j] end
markers[m + 1] = 'soft'

for i = 1, n do
  local a = 8 + m + 9 * (i - 1)
  if ARGV[a + 9] == '1' and has_rec and b >= cur - nb then
    win_add(scope_key(i, 1), b, -1, window_ms + 2 * bms)
  end
  if ARGV[a + 1] == '1' then
    local delta = tokens - est
    if b >= cur - nb then
      win_add(scope_key(i, 2), b, delta, window_ms + 2 * bms)
    elseif delta > 0 then
      win_add(scope_key(i, 2), cur, delta, window_ms + 2 * bms)
    end
  end
  if ARGV[a + 2] == '1' then
    redis.call('ZREM', scope_key(i, 3), rid)
  end
  local unit = ARGV[a + 3]
  if unit ~= '-' then
    local bk = scope_key(i, 4)
    local idx, ws, we = budget_window(unit, tonumber(ARGV[a + 4]), now_s)
    local cap, soft = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    -- One read for the window, the spend and every alert marker.
    local v = redis.call('HMGET', bk, 'w', unpack(markers))
    local held, spend = v[1], 0
    if has_rec and held and held == rec['w' .. i] then
      -- The reservation's window is still held: replace it by the real cost.
      spend = redis.call('HINCRBY', bk, 's', actual - reserved)
      if spend < 0 then
        redis.call('HSET', bk, 's', 0)
        spend = 0
      end
    else
      -- The reservation went with its window (or never existed): charge the
      -- real cost to the current window (markers of an old window go).
      budget_load(bk, idx, ws, we, tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8]))
      spend = redis.call('HINCRBY', bk, 's', actual)
      v = redis.call('HMGET', bk, 'w', unpack(markers))
      held = v[1]
    end
    if held and tonumber(held) == idx then
      if cap > 0 then
        for j = 1, m do
          local pct = tonumber(ARGV[8 + j])
          if not v[1 + j] and spend * 100 >= cap * pct and redis.call('HSETNX', bk, 'a' .. pct, 1) == 1 then
            out[#out + 1] = i
            out[#out + 1] = pct
            out[#out + 1] = spend
          end
        end
      end
      if soft > 0 and not v[2 + m] and spend >= soft and redis.call('HSETNX', bk, 'soft', 1) == 1 then
        out[#out + 1] = i
        out[#out + 1] = 0
        out[#out + 1] = spend
      end
    end
  end
end

-- The tombstone: the record's fields stay (a few bytes) until it expires.
redis.call('HSET', KEYS[2], 'done', 1)
redis.call('PEXPIRE', KEYS[2], tomb_ttl)
return out
