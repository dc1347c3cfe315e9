-- peek.lua: read-only headroom of scopes (explain, docs/explain.md). It
-- writes nothing: no epoch, no pruning, no window starts.
-- KEYS: for scope i, KEYS[2i-1] its state hash and KEYS[2i] its leases.
-- ARGV: window_ms, bucket_ms, n, then per scope: budget unit ('-' for
-- none) and n of its budget_duration.
-- Returns 5 integers per scope: requests in the rpm window, tokens in the
-- tpm window, live leases, budget state (0 no budget, 1 current window,
-- 2 a new window of intact state: zero, 3 no window in Redis: the ledger
-- seeds it), budget spend (micro-USD; 0 unless state 1), then prefill
-- tokens in flight (field 'pt', lua/common.lua "Prefill accounting").

local now = now_ms()
local window_ms = tonumber(ARGV[1])
local bms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local lo = cur - nb
local now_s = math.floor(now / 1000)
local out = {}
for i = 1, n do
  local raw = redis.call('HGETALL', KEYS[2 * i - 1])
  local r, k, bw, bs, pt = 0, 0, nil, 0, 0
  for j = 1, #raw, 2 do
    local f, v = raw[j], raw[j + 1]
    local p = string.sub(f, 1, 1)
    local b = tonumber(string.sub(f, 2))
    if (p == 'r' or p == 'k') and b and b >= lo and b <= cur then
      if p == 'r' then r = r + (tonumber(v) or 0) else k = k + (tonumber(v) or 0) end
    elseif f == 'bw' then
      bw = v
    elseif f == 'bs' then
      bs = tonumber(v) or 0
    elseif f == 'pt' then
      pt = tonumber(v) or 0
    end
  end
  local live = redis.call('ZCOUNT', KEYS[2 * i], '(' .. now, '+inf')
  local unit, bn = ARGV[4 + 2 * (i - 1)], tonumber(ARGV[5 + 2 * (i - 1)])
  local state, spend = 0, 0
  if unit ~= '-' then
    local idx = budget_window(unit, bn, now_s)
    local held = budget_held(bw, unit, bn, idx)
    if held == 'current' then
      state, spend = 1, bs
    elseif held == 'older' then
      state = 2
    else
      state = 3
    end
  end
  out[#out + 1] = r
  out[#out + 1] = k
  out[#out + 1] = live
  out[#out + 1] = state
  out[#out + 1] = spend
  out[#out + 1] = pt
end
return out
