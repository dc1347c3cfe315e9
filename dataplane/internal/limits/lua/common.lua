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

-- win_load reads a sliding-window hash (bucket index -> amount), deletes the
-- buckets that left the window, and returns the total and the live buckets
-- sorted oldest first. The window counts buckets cur-nb .. cur (nb+1
-- buckets), so it always covers the last nb*bucket_ms milliseconds in full.
local function win_load(key, cur, nb)
  local raw = redis.call('HGETALL', key)
  local total, list, stale = 0, {}, {}
  for j = 1, #raw, 2 do
    local b, c = tonumber(raw[j]), tonumber(raw[j + 1])
    if b < cur - nb then
      stale[#stale + 1] = raw[j]
    else
      total = total + c
      list[#list + 1] = { b, c }
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(list, function(a, b) return a[1] < b[1] end)
  return total, list
end

-- win_wait returns the milliseconds until a window holding list (total)
-- can take cost more under limit: until enough of the oldest buckets have
-- left. -1 when cost alone exceeds limit (never admissible).
local function win_wait(list, total, cost, limit, nb, bms, now)
  if cost > limit then return -1 end
  local need = total + cost - limit
  if need <= 0 then return 0 end
  for _, e in ipairs(list) do
    need = need - e[2]
    if need <= 0 then
      local w = (e[1] + nb + 1) * bms - now
      if w < 1 then w = 1 end
      return w
    end
  end
  return (nb + 1) * bms
end

-- win_add adds amount to bucket b (clamping at 0) and keeps the hash alive
-- for one window past its newest bucket.
local function win_add(key, b, amount, ttl_ms)
  if amount == 0 then return end
  local v = redis.call('HINCRBY', key, b, amount)
  if v <= 0 then redis.call('HDEL', key, b) end
  redis.call('PEXPIRE', key, ttl_ms)
end

-- record_get reads the request record hash into a table (empty when missing).
local function record_get()
  local raw = redis.call('HGETALL', KEYS[2])
  local rec = {}
  for j = 1, #raw, 2 do rec[raw[j]] = raw[j + 1] end
  return rec
end
