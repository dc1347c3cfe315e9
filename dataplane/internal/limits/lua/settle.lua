-- settle.lua: settle a batch of requests of one org: release each
-- request's leases and reconcile its token estimate and cost reservation
-- with the real usage, exactly once per request id. Scopes shared by
-- requests of the batch are read once and written once, so a batch costs
-- little more than one settlement.
--
-- KEYS: 1 the org's epoch; 2 .. R+1 the requests' records; then 2 keys per
--   distinct scope s (R+2+2(s-1): state hash, R+3+2(s-1): leases), see
--   common.lua; then, when ARGV[7] is 1, the org's lease index (last).
-- ARGV:
--   1 rate window ms   2 bucket ms   3 tombstone TTL ms
--   4 number of requests R   5 number of alert thresholds m
--   6 mode: 0 settle (the caller's usage), 1 sweep: settle only the
--     requests whose entry in the lease index has expired and whose record
--     is not settled, each with the usage its record's report holds (the
--     caller's tokens and cost are ignored), leaving the tombstone 'swept'
--   7 lease index (0/1: the last key is the org's lease index; settled
--     requests leave it)
--   8 .. 7+m alert thresholds (percent of the cap)
--   then per request: request id, actual tokens, actual cost (micro-USD),
--     number of its scopes k, then 8 values per scope:
--       distinct scope index s (1-based), has tpm (0/1), has parallel
--       (0/1; 2: and it accounts the request's prefill, whose contribution
--       leaves with the lease: common.lua), refund rpm (0/1: the request was cancelled, its admission
--       answered as failed; give its request back to the rpm window),
--       budget unit ('-' = none), budget n, cap micro-USD (0 = none), soft
--       budget micro-USD (0 = none)
-- Returns {epoch, then per request: state, number of alerts a, then a
--   triples}. state 0 = already settled (no-op; in sweep mode also: not
--   expired, or no record to settle from); 1 = settled against the
--   admission record (swept, in sweep mode); 2 = settled without a record
--   (state lost or record expired): leases removed and the actual usage
--   charged in full to the current windows; 3 = already swept (no-op: a
--   sweeper settled it with its last report). A budget window that is
--   missing is never started here, in either mode: the request's cost is
--   in its usage event (a sweeper publishes the swept request's), so the
--   seed of the next admission counts it from the ledger (a reservation
--   waiting in 'bp' for the seed is removed from it). An alert triple is:
--   the scope's position among the
--   request's scopes (1-based), threshold percent (0 = soft budget), spend
--   micro-USD; each fires once per scope, threshold and budget window.

local now = now_ms()
local window_ms = tonumber(ARGV[1])
local bms = tonumber(ARGV[2])
local tomb_ttl = tonumber(ARGV[3])
local nreq = tonumber(ARGV[4])
local m = tonumber(ARGV[5])
local sweep = ARGV[6] == '1'
local idx = nil
if ARGV[7] == '1' then idx = KEYS[#KEYS] end
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)
local rate_ttl = window_ms + 2 * bms
local thresholds = {}
for j = 1, m do thresholds[j] = tonumber(ARGV[7 + j]) end

local function shkey(s) return KEYS[nreq + 2 + 2 * (s - 1)] end
local function szkey(s) return KEYS[nreq + 3 + 2 * (s - 1)] end

-- The epoch and the records in one read (ensure_epoch's GET folded in).
local raw = redis.call('MGET', unpack(KEYS, 1, nreq + 1))
local epoch = tonumber(table.remove(raw, 1))
if not epoch then
  redis.call('SET', KEYS[1], now)
  epoch = now
end

-- The state of each distinct scope touched: fields read (false = absent),
-- fields to write, and leases to remove.
local cache = {}
local function scope(s)
  local c = cache[s]
  if not c then
    c = { v = {}, dirty = {}, zrem = {}, created = false, rate = false, we = nil }
    cache[s] = c
  end
  return c
end
local function load(s, c, fields)
  local miss = {}
  for _, f in ipairs(fields) do
    if c.v[f] == nil then miss[#miss + 1] = f end
  end
  if #miss == 0 then return end
  local vals = redis.call('HMGET', shkey(s), unpack(miss))
  for j, f in ipairs(miss) do c.v[f] = vals[j] or false end
end
local function get(c, f)
  local x = c.v[f]
  if x == false then return nil end
  return x
end
local function put(c, f, x)
  if x == nil then x = false end
  c.v[f] = x
  c.dirty[f] = true
end
-- cwin_apply adds amount (either sign) to bucket b of window p of the
-- cached state, through win_apply (common.lua).
local function cwin_apply(c, p, b, amount)
  local set, del = {}, {}
  if win_apply(set, del, p, b, amount, get(c, p .. b), get(c, p .. 't'), get(c, p .. 'o')) then
    c.created = true
    c.rate = true
  end
  for j = 1, #set, 2 do put(c, set[j], set[j + 1]) end
  for _, f in ipairs(del) do put(c, f, nil) end
end

local out = { epoch }
local a = 7 + m
local seen = {} -- request ids settled by this call (a batch may repeat one)
local unindex = {} -- request ids leaving the lease index
for r = 1, nreq do
  local rid, tokens, actual, k = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  a = a + 4
  local rec = record_parse(raw[r])
  local skip = nil -- the state of a request left alone
  if seen[rid] then
    skip = 0
  elseif rec and rec.swept then
    skip = 3
  elseif rec and rec.done then
    skip = 0
  elseif sweep then
    local exp = nil
    if idx then exp = redis.call('ZSCORE', idx, rid) end
    if rec and exp and tonumber(exp) <= now then
      tokens, actual = record_usage(raw[r], rec)
    else
      skip = 0
    end
    -- A request without a record cannot be swept (nothing says what to
    -- settle): its stale index entry goes.
    if not rec and idx then unindex[#unindex + 1] = rid end
  end
  if sweep and skip and rec and rec.done and idx then
    unindex[#unindex + 1] = rid
  end
  if skip then
    out[#out + 1] = skip
    out[#out + 1] = 0
    a = a + 8 * k
  else
    local has_rec = rec ~= nil
    local state = 2
    if has_rec then state = 1 end
    local est, reserved, b = 0, 0, cur
    if has_rec then est, reserved, b = rec.est, rec.cost, rec.b end
    local alerts = {}
    for i = 1, k do
      local s = tonumber(ARGV[a + 1])
      local unit = ARGV[a + 5]
      local refund = ARGV[a + 4] == '1' and has_rec and b >= cur - nb
      -- The token estimate is replaced by the real count in the
      -- admission's bucket while it is in the window, else an excess goes
      -- to the current bucket.
      local delta, tb = tokens - est, nil
      if ARGV[a + 2] == '1' and delta ~= 0 then
        if b >= cur - nb then
          tb = b
        elseif delta > 0 then
          tb = cur
        end
      end
      local c = scope(s)
      if refund or tb or unit ~= '-' then
        local fields = { 'rt', 'ro', 'r' .. b, 'kt', 'ko', 'k' .. (tb or cur) }
        if unit ~= '-' then
          fields[#fields + 1] = 'bw'
          fields[#fields + 1] = 'bs'
          fields[#fields + 1] = 'bp'
          fields[#fields + 1] = 'bpw'
          for j = 1, m do fields[#fields + 1] = 'ba' .. thresholds[j] end
          fields[#fields + 1] = 'bsoft'
        end
        load(s, c, fields)
      end
      if refund then cwin_apply(c, 'r', b, -1) end
      if tb then cwin_apply(c, 'k', tb, delta) end
      if unit ~= '-' then
        local bn = tonumber(ARGV[a + 6])
        local cap, soft = tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8])
        local idx, _, we = budget_window(unit, bn, now_s)
        local id = bw_id(unit, bn, idx)
        local held, spend = get(c, 'bw'), 0
        local rw = has_rec and rec.w[i]
        local pending = false
        if rw and string.sub(rw, 1, 1) == 'p' then pending, rw = true, string.sub(rw, 2) end
        local counted = true
        if rw and rw ~= '-' and held == bw_id(unit, bn, rw) then
          -- The reservation's window is still held (a reservation that
          -- waited in 'bp' is in it since its seed): replace it by the
          -- real cost.
          spend = math.max((tonumber(get(c, 'bs')) or 0) + actual - reserved, 0)
        elseif held == id then
          -- The reservation went with its window (or never existed):
          -- charge the real cost to the current window.
          spend = (tonumber(get(c, 'bs')) or 0) + actual
        elseif budget_held(held, unit, bn, idx) == 'older' then
          -- The current window of an intact state starts now, at zero.
          spend = actual
          held = id
          put(c, 'bw', id)
          c.created = true
        else
          -- Missing: left to the seed, which reads this request's cost
          -- from the ledger; its reservation no longer waits for it.
          counted = false
          if pending and get(c, 'bpw') == bw_id(unit, bn, rw) then
            local left = (tonumber(get(c, 'bp')) or 0) - reserved
            if left > 0 then
              put(c, 'bp', left)
            else
              put(c, 'bp', nil)
              put(c, 'bpw', nil)
            end
          end
        end
        if counted then
          put(c, 'bs', spend)
          c.we = we
        end
        if counted and held == id then
          if cap > 0 then
            for j = 1, m do
              local pct = thresholds[j]
              if get(c, 'ba' .. pct) ~= id and spend * 100 >= cap * pct then
                put(c, 'ba' .. pct, id)
                alerts[#alerts + 1] = { i, pct, spend }
              end
            end
          end
          if soft > 0 and get(c, 'bsoft') ~= id and spend >= soft then
            put(c, 'bsoft', id)
            alerts[#alerts + 1] = { i, 0, spend }
          end
        end
      end
      if ARGV[a + 3] ~= '0' then c.zrem[#c.zrem + 1] = rid end
      if ARGV[a + 3] == '2' then
        local pf = 'p:' .. rid
        load(s, c, { pf, 'pt' })
        local old = tonumber(get(c, pf))
        if old then
          put(c, pf, nil)
          put(c, 'pt', math.max((tonumber(get(c, 'pt')) or 0) - old, 0))
        end
      end
      a = a + 8
    end
    -- The tombstone: a settled request id is remembered until it expires.
    redis.call('SET', KEYS[1 + r], sweep and 'swept' or 'done', 'PX', tomb_ttl)
    seen[rid] = true
    if idx then unindex[#unindex + 1] = rid end
    out[#out + 1] = state
    out[#out + 1] = #alerts
    for _, x in ipairs(alerts) do
      out[#out + 1] = x[1]
      out[#out + 1] = x[2]
      out[#out + 1] = x[3]
    end
  end
end

-- Write back each scope once.
for s, c in pairs(cache) do
  local hk = shkey(s)
  local set, del = {}, {}
  for f in pairs(c.dirty) do
    local x = c.v[f]
    if x == false then
      del[#del + 1] = f
    else
      set[#set + 1] = f
      set[#set + 1] = x
    end
  end
  if c.created and c.rate then
    set[#set + 1] = '_'
    set[#set + 1] = HASHTABLE_PAD
  end
  if #set > 0 then redis.call('HSET', hk, unpack(set)) end
  if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
  if c.created then state_expiry(hk, c.we ~= nil, c.we or 0, true, rate_ttl, 0) end
  if #c.zrem > 0 then redis.call('ZREM', szkey(s), unpack(c.zrem)) end
end
if #unindex > 0 then redis.call('ZREM', idx, unpack(unindex)) end
return out
