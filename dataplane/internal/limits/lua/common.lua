-- common.lua: helpers prepended to admit.lua, renew.lua and settle.lua (see
-- scripts.go). It defines only local functions; the scripts' KEYS/ARGV
-- contracts are at the top of each script.
--
-- Shared key layout (built by keys.go, all under one hash tag {o:<org>}):
--   KEYS[1]        epoch key (string: epoch start, ms since the Unix epoch)
--   KEYS[2]        request record (hash; see admit.lua)
--   KEYS[3+4(i-1)] scope i rpm window  (hash: bucket index -> requests)
--   KEYS[4+4(i-1)] scope i tpm window  (hash: bucket index -> tokens)
--   KEYS[5+4(i-1)] scope i leases      (zset: request id scored by expiry ms)
--   KEYS[6+4(i-1)] scope i budget      (hash: w = window index, s = spend
--                                       micro-USD, a<pct>/soft = alert fired)
-- Keys of limits a scope does not carry are passed but never touched.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function scope_key(i, slot)
  return KEYS[2 + 4 * (i - 1) + slot]
end

-- ensure_epoch returns the org's epoch (ms); a missing epoch key means the
-- org's Redis state is new or was lost, so a new epoch starts now.
local function ensure_epoch(now)
  local ep = redis.call('GET', KEYS[1])
  if ep then
    return tonumber(ep)
  end
  redis.call('SET', KEYS[1], now)
  return now
end

-- days_from_civil and civil_from_days: proleptic Gregorian calendar, UTC
-- (H. Hinnant's algorithms), used for calendar-month budget windows.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y, m
end

-- budget_window returns the window index, start and end (Unix seconds) of
-- the budget window containing now_s. unit 'h'/'d': fixed windows of n hours
-- or days aligned to the Unix epoch; unit 'mo': n calendar months (UTC)
-- counted from January 1970.
local function budget_window(unit, n, now_s)
  if unit == 'h' or unit == 'd' then
    local len = n * 3600
    if unit == 'd' then len = n * 86400 end
    local idx = math.floor(now_s / len)
    return idx, idx * len, (idx + 1) * len
  end
  local y, m = civil_from_days(math.floor(now_s / 86400))
  local idx = math.floor(((y - 1970) * 12 + (m - 1)) / n)
  local sm, em = idx * n, (idx + 1) * n
  local start = days_from_civil(1970 + math.floor(sm / 12), sm % 12 + 1, 1) * 86400
  local stop = days_from_civil(1970 + math.floor(em / 12), em % 12 + 1, 1) * 86400
  return idx, start, stop
end

-- budget_load returns the spend (micro-USD) of the budget hash for window
-- idx, starting a new window when the hash is missing or holds another
-- window: the new window starts at the durable seed when the seed belongs to
-- it (seed_start 0 or equal to the window start), else at 0. Alert markers
-- of the old window go with it. The hash expires an hour after the window.
local function budget_load(key, idx, start_s, end_s, seed, seed_start)
  local v = redis.call('HMGET', key, 'w', 's')
  if v[1] and tonumber(v[1]) == idx then
    return tonumber(v[2]) or 0
  end
  local s = 0
  if seed_start == 0 or seed_start == start_s then s = seed end
  redis.call('DEL', key)
  redis.call('HSET', key, 'w', idx, 's', s)
  redis.call('EXPIREAT', key, end_s + 3600)
  return s
end

-- Sliding windows. A window hash maps bucket index -> amount (every
-- bucket > 0) and keeps two bookkeeping fields: 't', the sum of every
-- bucket in the hash, and 'o', a lower bound of the oldest bucket. A check
-- is O(1) amortised: buckets that left the window are found from 'o' (each
-- index is visited once), never by reading the whole hash. The window
-- counts buckets cur-nb .. cur (nb+1 buckets), so it always covers the last
-- nb*bucket_ms milliseconds in full.

-- win_rebuild recomputes 't' and 'o' from the whole hash, deleting the
-- buckets below lo (after a long idle gap, or for a hash written before the
-- bookkeeping fields existed). Returns the total and the oldest bucket.
local function win_rebuild(key, lo, cur)
  local raw = redis.call('HGETALL', key)
  local total, oldest, stale, curv = 0, nil, {}, 0
  for j = 1, #raw, 2 do
    local f = raw[j]
    if f ~= 't' and f ~= 'o' then
      local b, c = tonumber(f), tonumber(raw[j + 1])
      if b < lo or c <= 0 then
        stale[#stale + 1] = f
      else
        total = total + c
        if oldest == nil or b < oldest then oldest = b end
        if b == cur then curv = c end
      end
    end
  end
  if oldest == nil then
    redis.call('DEL', key)
    return 0, nil, 0
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  redis.call('HSET', key, 't', total, 'o', oldest)
  return total, oldest, curv
end

-- win_load prunes the buckets that left the window and returns the total,
-- the oldest live bucket (nil when the window is empty) and the amount in
-- bucket cur; the hash's 't' then equals the total returned. One HMGET in
-- the steady state; pruning (at most once per bucket) also moves 'o' to the
-- oldest remaining bucket. Between prunings 'o' may name a bucket a
-- refund removed, so the oldest bucket returned is then slightly early.
local function win_load(key, cur, nb)
  local lo = cur - nb
  local v = redis.call('HMGET', key, 't', 'o', cur)
  if not v[1] or not v[2] then
    if redis.call('EXISTS', key) == 1 then return win_rebuild(key, lo, cur) end
    return 0, nil, 0
  end
  local total, o = tonumber(v[1]), tonumber(v[2])
  local curv = tonumber(v[3]) or 0
  if o < lo then
    if lo - o > nb + 1 then return win_rebuild(key, lo, cur) end
    local fields = {}
    for b = o, lo - 1 do fields[#fields + 1] = b end
    local vals = redis.call('HMGET', key, unpack(fields))
    local del = {}
    for j = 1, #fields do
      if vals[j] then
        total = total - tonumber(vals[j])
        del[#del + 1] = fields[j]
      end
    end
    if #del > 0 then redis.call('HDEL', key, unpack(del)) end
    if total <= 0 then
      redis.call('DEL', key)
      return 0, nil, 0
    end
    o = lo
    while o < cur and redis.call('HEXISTS', key, o) == 0 do o = o + 1 end
    redis.call('HSET', key, 't', total, 'o', o)
  end
  if total <= 0 then
    redis.call('DEL', key)
    return 0, nil, 0
  end
  return total, o, curv
end

-- win_add_loaded adds amount (> 0) to bucket cur of a window just read by
-- win_load (total, oldest, curv as it returned them): one HSET.
local function win_add_loaded(key, cur, amount, ttl_ms, total, oldest, curv)
  if amount <= 0 then return end
  if oldest == nil or cur < oldest then
    redis.call('HSET', key, cur, curv + amount, 't', total + amount, 'o', cur)
  else
    redis.call('HSET', key, cur, curv + amount, 't', total + amount)
  end
  if curv == 0 then redis.call('PEXPIRE', key, ttl_ms) end
end

-- win_wait returns the milliseconds until a window holding total (oldest
-- live bucket oldest) can take cost more under limit: until enough of the
-- oldest buckets have left. -1 when cost alone exceeds limit (never
-- admissible). Only rejections call it (one HMGET of the live buckets).
local function win_wait(key, oldest, cur, total, cost, limit, nb, bms, now)
  if cost > limit then return -1 end
  local need = total + cost - limit
  if need <= 0 then return 0 end
  if oldest == nil then return (nb + 1) * bms end
  local fields = {}
  for b = oldest, cur do fields[#fields + 1] = b end
  local vals = redis.call('HMGET', key, unpack(fields))
  for j = 1, #fields do
    if vals[j] then
      need = need - tonumber(vals[j])
      if need <= 0 then
        local w = (fields[j] + nb + 1) * bms - now
        if w < 1 then w = 1 end
        return w
      end
    end
  end
  return (nb + 1) * bms
end

-- win_add adds amount to bucket b (a bucket reaching 0 or less is removed),
-- keeps 't' true and 'o' a lower bound, and keeps the hash alive for one
-- window past its newest bucket.
local function win_add(key, b, amount, ttl_ms)
  if amount == 0 then return end
  local v = redis.call('HINCRBY', key, b, amount)
  local applied = amount
  if v <= 0 then
    redis.call('HDEL', key, b)
    applied = amount - v
  end
  if applied ~= 0 then redis.call('HINCRBY', key, 't', applied) end
  if v > 0 and v == amount then
    -- A new bucket: it may be the oldest, and the hash must outlive it.
    -- (An existing bucket is covered by the expiry set when the newest
    -- bucket was created.)
    local o = redis.call('HGET', key, 'o')
    if not o or b < tonumber(o) then redis.call('HSET', key, 'o', b) end
    redis.call('PEXPIRE', key, ttl_ms)
  end
end

-- record_get reads the request record hash into a table (empty when missing).
local function record_get()
  local raw = redis.call('HGETALL', KEYS[2])
  local rec = {}
  for j = 1, #raw, 2 do rec[raw[j]] = raw[j + 1] end
  return rec
end
