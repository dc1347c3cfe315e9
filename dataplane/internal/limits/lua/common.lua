-- common.lua: helpers prepended to admit.lua, renew.lua, settle.lua and
-- seed.lua (see scripts.go). It defines only local functions; the scripts'
-- KEYS/ARGV contracts are at the top of each script.
--
-- Shared key layout (built by keys.go, all under one hash tag {o:<org>}):
--   KEYS[1]        epoch key (string: epoch start, ms since the Unix epoch)
--   KEYS[2]        request record (string; see record_parse)
--   KEYS[3+2(i-1)] scope i state (hash; fields below)
--   KEYS[4+2(i-1)] scope i leases (zset: request id scored by expiry ms)
--   KEYS[3+2n]     the org's lease index (zset: request id scored by its
--                  lease expiry ms), for requests that carry a report:
--                  what a sweeper scans for requests whose proxy was lost
--
-- A scope's state hash holds every limit of the scope, so one HMGET reads
-- and one HSET writes all of them:
--   rt, ro, r<b>   requests window: total, oldest bucket, bucket b
--   kt, ko, k<b>   tokens window: the same
--   bw, bs         budget window id (bw_id) and its spend (micro-USD)
--   bp, bpw        reservations re-asserted (renew.lua) while the budget
--                  window was missing, and the window id they are for;
--                  seed.lua adds them to the seed
--   ba<pct>, bsoft the budget window id in which that alert fired
--   bh, ql         budget and rate leases of quota slices (below)
--   lx             a time (ms) before which the lease set does not expire
--   _              HASHTABLE_PAD, in hashes of scopes with rate limits (below)
-- Expiry: a scope with a budget keeps its hash until an hour after the
-- budget window ends (set when the window starts); a scope without one
-- keeps it one rate window past its newest bucket (set when a bucket is
-- created), or three lease TTLs when it only limits concurrency. Losing
-- 'lx' is harmless (the lease set's expiry is just pushed again).

-- HASHTABLE_PAD is the value of field '_' of the state hash of a scope with
-- rate limits. Its 80 bytes exceed Redis's default hash-max-listpack-value
-- (64), so the hash is kept in the hashtable encoding: a window holds up to
-- 61 buckets per limit, and in the compact listpack encoding every HMGET and
-- HSET scans all of them (measured: 15-20 µs instead of 3-4 µs per
-- HMGET+HSET on a hash of 120 fields; docs/limits.md).
local HASHTABLE_PAD = string.rep('-', 80)

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function hkey(i) return KEYS[3 + 2 * (i - 1)] end
local function zkey(i) return KEYS[4 + 2 * (i - 1)] end

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

-- bw_id names a budget window: its duration (so a changed budget_duration
-- starts a new counter) and its index.
local function bw_id(unit, n, idx)
  return unit .. n .. '/' .. idx
end

-- budget_held classifies the budget window a scope's state holds (its
-- field 'bw', nil when absent) against the current window idx of duration
-- unit, n:
--   'current'  it is the current window: its spend is 'bs';
--   'older'    an earlier window of the same duration: the state is intact
--              and the current window is new, so it starts at zero;
--   'missing'  no window (first use, Redis lost the state, or the state
--              expired an hour after its window), or one of another
--              duration (budget_duration changed): only the ledger knows
--              the spend, so the window waits for a seed (seed.lua).
-- Why 'older' may start at zero: the first admission of a window writes
-- 'bw' (even when it rejects), so while 'bw' names an older window no
-- request of the current one was admitted through this state; the ledger
-- charges a request to the window its start time is in, so it holds
-- nothing for the current window either. A request admitted in the older
-- window and settled after the boundary is charged by settle.lua to the
-- older window while that one is still held (as the ledger does) and to
-- the current window once it moved (Redis then counts more than the
-- ledger, never less).
local function budget_held(held, unit, n, idx)
  if not held then return 'missing' end
  local prefix = unit .. n .. '/'
  if held == prefix .. idx then return 'current' end
  if string.sub(held, 1, #prefix) == prefix then
    local h = tonumber(string.sub(held, #prefix + 1))
    if h and h < idx then return 'older' end
  end
  return 'missing'
end

-- Sliding windows. Window p ('r' requests, 'k' tokens) of a state hash is
-- the buckets p<b> (each > 0) plus two bookkeeping fields: p..'t', the sum
-- of the window's buckets, and p..'o', a lower bound of its oldest bucket;
-- both are absent exactly when the window has no bucket. A check is O(1)
-- amortised: buckets that left the window are found from 'o' (each index
-- is visited once), never by reading the whole hash. The window counts
-- buckets cur-nb .. cur (nb+1 buckets), so it always covers the last
-- nb*bucket_ms milliseconds in full.

-- win_rebuild recomputes window p's bookkeeping from the whole hash,
-- deleting its buckets below lo (after a long idle gap, or when the
-- bookkeeping is inconsistent). Returns the total, the oldest bucket and
-- the amount in bucket cur.
local function win_rebuild(key, p, lo, cur)
  local raw = redis.call('HGETALL', key)
  local total, oldest, stale, curv = 0, nil, {}, 0
  for j = 1, #raw, 2 do
    local f = raw[j]
    if string.sub(f, 1, 1) == p then
      local b = tonumber(string.sub(f, 2))
      if b then
        local c = tonumber(raw[j + 1]) or 0
        if b < lo or c <= 0 then
          stale[#stale + 1] = f
        else
          total = total + c
          if oldest == nil or b < oldest then oldest = b end
          if b == cur then curv = c end
        end
      end
    end
  end
  if oldest == nil then
    stale[#stale + 1] = p .. 't'
    stale[#stale + 1] = p .. 'o'
    redis.call('HDEL', key, unpack(stale))
    return 0, nil, 0
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  redis.call('HSET', key, p .. 't', total, p .. 'o', oldest)
  return total, oldest, curv
end

-- win_state returns the total, the oldest live bucket (nil when the window
-- is empty) and the amount in bucket cur of window p, from the values t, o
-- and c (p..'t', p..'o', p..cur) the scope's HMGET read, first pruning the
-- buckets that left the window (at most once per bucket: a HMGET, a HDEL
-- and a HSET). Between prunings 'o' may name a bucket a refund removed, so
-- the oldest bucket returned is then slightly early.
local function win_state(key, p, t, o, c, cur, nb)
  local lo = cur - nb
  if not t and not o then return 0, nil, 0 end
  if not t or not o then return win_rebuild(key, p, lo, cur) end
  local total, oldest = tonumber(t), tonumber(o)
  if oldest < lo then
    if lo - oldest > nb + 1 then return win_rebuild(key, p, lo, cur) end
    local fields = {}
    for b = oldest, lo - 1 do fields[#fields + 1] = p .. b end
    local vals = redis.call('HMGET', key, unpack(fields))
    local del = {}
    for j = 1, #fields do
      if vals[j] then
        total = total - tonumber(vals[j])
        del[#del + 1] = fields[j]
      end
    end
    if #del > 0 then redis.call('HDEL', key, unpack(del)) end
    if total <= 0 then return win_rebuild(key, p, lo, cur) end
    oldest = lo
    while oldest < cur and redis.call('HEXISTS', key, p .. oldest) == 0 do oldest = oldest + 1 end
    redis.call('HSET', key, p .. 't', total, p .. 'o', oldest)
  end
  if total <= 0 then return win_rebuild(key, p, lo, cur) end
  return total, oldest, tonumber(c) or 0
end

-- win_wait returns the milliseconds until window p (total, oldest live
-- bucket oldest) can take cost more under limit: until enough of the
-- oldest buckets have left. -1 when cost alone exceeds limit (never
-- admissible). Only rejections call it (one HMGET of the live buckets).
local function win_wait(key, p, oldest, cur, total, cost, limit, nb, bms, now)
  if cost > limit then return -1 end
  local need = total + cost - limit
  if need <= 0 then return 0 end
  if oldest == nil then return (nb + 1) * bms end
  local fields = {}
  for b = oldest, cur do fields[#fields + 1] = p .. b end
  local vals = redis.call('HMGET', key, unpack(fields))
  for j = 1, #fields do
    if vals[j] then
      need = need - tonumber(vals[j])
      if need <= 0 then
        local w = (oldest + j - 1 + nb + 1) * bms - now
        if w < 1 then w = 1 end
        return w
      end
    end
  end
  return (nb + 1) * bms
end

-- win_apply adds amount (either sign) to bucket b of window p, whose
-- bucket, total and oldest fields were read as vb, vt, vo: the fields to
-- write are appended to set (field, value pairs) and a bucket reaching 0 or
-- less to del. Returns true when it creates a bucket (the hash must then
-- outlive it).
local function win_apply(set, del, p, b, amount, vb, vt, vo)
  if amount == 0 then return false end
  local old = tonumber(vb) or 0
  local nb_ = old + amount
  local applied = amount
  if nb_ <= 0 then
    applied = -old
    nb_ = nil
  end
  if applied == 0 then return false end
  if nb_ then
    set[#set + 1] = p .. b
    set[#set + 1] = nb_
  else
    del[#del + 1] = p .. b
  end
  set[#set + 1] = p .. 't'
  set[#set + 1] = (tonumber(vt) or 0) + applied
  if nb_ and (not vo or b < tonumber(vo)) then
    set[#set + 1] = p .. 'o'
    set[#set + 1] = b
  end
  return nb_ ~= nil and old == 0
end

-- state_expiry keeps a scope's state hash alive after a write that created
-- fields (a bucket, 'lx'): until an hour after the end (wend, Unix s) of
-- its budget window when the scope has a budget, else one rate window
-- (rate_ttl ms) when it has rate limits, else three lease TTLs.
local function state_expiry(key, has_budget, wend, has_rate, rate_ttl, lease_ttl)
  if has_budget then
    redis.call('EXPIREAT', key, wend + 3600)
  elseif has_rate then
    redis.call('PEXPIRE', key, rate_ttl)
  else
    redis.call('PEXPIRE', key, 3 * lease_ttl)
  end
end

-- record_parse reads the request record: "done" once settled, "swept"
-- once a sweeper settled it after its lease expired (its proxy was lost),
-- else "<est> <cost> <bucket> <w1> .. <wn>" (w_i the budget window index
-- the admission reserved in for scope i, '-' for none, 'p<index>' for a
-- reservation renew.lua re-asserted into 'bp' while the window was
-- missing), optionally followed by a newline and the request's report
-- (below). Returns nil when missing, {done = true} when settled ({done =
-- true, swept = true} when swept), else a table; rec.nl is the position of
-- the newline that starts the report (nil without one).
local function record_parse(raw)
  if not raw then return nil end
  if raw == 'done' then return { done = true } end
  if raw == 'swept' then return { done = true, swept = true } end
  local nl = string.find(raw, '\n', 1, true)
  local head = raw
  if nl then head = string.sub(raw, 1, nl - 1) end
  local t = {}
  for tok in string.gmatch(head, '%S+') do t[#t + 1] = tok end
  local rec = { est = tonumber(t[1]), cost = tonumber(t[2]), b = tonumber(t[3]), w = {}, nl = nl, head = head }
  for j = 4, #t do rec.w[j - 3] = t[j] end
  return rec
end

-- The report of a request (written by admit.lua and renew.lua after the
-- record's first line, built by Go: lease.go) is
--   "<tokens> <cost micro-USD>\n<scopes spec>\n<usage event>"
-- the usage the request reported so far (what a sweeper charges if its
-- proxy dies), the scopes to settle, and the usage event to publish. Only
-- the first line is read here.

-- record_usage returns the tokens and cost of rec's report (0, 0 without
-- one).
local function record_usage(raw, rec)
  if not rec.nl then return 0, 0 end
  local line = string.match(raw, '^([^\n]*)', rec.nl + 1)
  local tok, cost = string.match(line or '', '^(%d+) (%d+)')
  return tonumber(tok) or 0, tonumber(cost) or 0
end

-- Prefill accounting (issue 12; docs/traffic.md, "Prefill in flight"). One
-- scope of a call may account the request's prefill: the uncached prompt
-- tokens of admitted requests without a first token yet. Its state hash
-- holds
--   pt          the scope's prefill tokens in flight (the sum of the p: fields)
--   p:<rid>     request rid's contribution (absent once it is 0)
-- The scope limits concurrency only (Go checks), so its hash expires three
-- lease TTLs after the last write that added a contribution, like its lease
-- set: a contribution never outlives its lease for long. A request's
-- contribution leaves at its first token (renew.lua sets it to 0), when it
-- is settled (settle.lua), and when its lease expired unrenewed (its proxy
-- was lost): prefill_prune, run by every admission on the scope before it
-- reads the total.

-- PREFILL_PRUNE_MAX bounds the expired leases one call prunes; the rest
-- go with the next admissions.
local PREFILL_PRUNE_MAX = 256

-- prefill_prune removes the leases of the scope (hash hk, lease set pk)
-- that expired by now, with their contributions, and returns the scope's
-- total pt (as read before) less what it removed.
local function prefill_prune(hk, pk, now, pt)
  local gone = redis.call('ZRANGEBYSCORE', pk, '-inf', now, 'LIMIT', 0, PREFILL_PRUNE_MAX)
  if #gone == 0 then return pt end
  redis.call('ZREM', pk, unpack(gone))
  local f = {}
  for j, rid in ipairs(gone) do f[j] = 'p:' .. rid end
  local vals = redis.call('HMGET', hk, unpack(f))
  local sub, del = 0, {}
  for j = 1, #vals do
    if vals[j] then
      sub = sub + (tonumber(vals[j]) or 0)
      del[#del + 1] = f[j]
    end
  end
  if #del == 0 then return pt end
  redis.call('HDEL', hk, unpack(del))
  pt = math.max(pt - sub, 0)
  redis.call('HSET', hk, 'pt', pt)
  return pt
end

-- prefill_set sets request rid's contribution on the scope (hash hk) to v
-- (0: none) and returns the scope's new total. A contribution is only
-- written while the hash lives for it: a positive one pushes the hash's
-- expiry to three lease TTLs.
local function prefill_set(hk, rid, v, lease_ttl)
  local cur = redis.call('HMGET', hk, 'p:' .. rid, 'pt')
  local old = tonumber(cur[1]) or 0
  local pt = tonumber(cur[2]) or 0
  if v == old then
    if v > 0 then redis.call('PEXPIRE', hk, 3 * lease_ttl) end
    return pt
  end
  pt = math.max(pt - old + v, 0)
  if v > 0 then
    redis.call('HSET', hk, 'p:' .. rid, v, 'pt', pt)
    redis.call('PEXPIRE', hk, 3 * lease_ttl)
  else
    redis.call('HDEL', hk, 'p:' .. rid)
    redis.call('HSET', hk, 'pt', pt)
  end
  return pt
end

-- Budget leases of quota slices (carve.lua; docs/limits.md, "Budget
-- leases"): the field 'bh' of a scope's state hash holds, for the budget
-- window it names, one entry per data plane: "<instance> g b expiry", g what
-- its slices put in the spend and did not give back, b its watermark.
-- bh_parse reads the entries of window id from a 'bh' value.
local function bh_parse(s, id)
  local t = {}
  if not s then return t end
  local p = string.find(s, '|', 1, true)
  if not p or string.sub(s, 1, p - 1) ~= id then return t end
  for inst, g, b, e in string.gmatch(string.sub(s, p + 1), '([^ |]+) (%-?%d+) (%-?%d+) (%d+)') do
    t[inst] = { tonumber(g), tonumber(b), tonumber(e) }
  end
  return t
end

local function bh_format(id, t)
  local parts = { id }
  for inst, h in pairs(t) do
    parts[#parts + 1] = string.format('%s %d %d %d', inst, h[1], h[2], h[3])
  end
  return table.concat(parts, '|')
end

-- Rate leases of quota slices (carve.lua; docs/limits.md, "Rate leases"):
-- the field 'ql' of a scope's state hash holds one entry per data plane and
-- bucket its rate slices were carved in: "<instance> b gr gt wr wt", gr/gt
-- the requests and tokens its slices put in bucket b and did not give back,
-- wr/wt its watermarks (it never uses more than the watermark of what it
-- holds in b without a call raising it first). Its slices end before b
-- does, so an entry expires one bucket after b ends (rl_expiry): then
-- gr - wr and gt - wt go back to b (while b is in the window), and the
-- watermarks' worth stays counted. rl_parse returns a list of entries
-- {instance, b, gr, gt, wr, wt}.
local function rl_parse(s)
  local t = {}
  if not s then return t end
  for inst, b, gr, gt, wr, wt in string.gmatch(s, '([^ |]+) (%-?%d+) (%-?%d+) (%-?%d+) (%-?%d+) (%-?%d+)') do
    t[#t + 1] = { inst, tonumber(b), tonumber(gr), tonumber(gt), tonumber(wr), tonumber(wt) }
  end
  return t
end

local function rl_format(t)
  local parts = {}
  for _, e in ipairs(t) do
    parts[#parts + 1] = string.format('%s %d %d %d %d %d', e[1], e[2], e[3], e[4], e[5], e[6])
  end
  return table.concat(parts, '|')
end

local function rl_expiry(b, bms) return (b + 2) * bms end

-- rl_reclaim gives back what the expired entries of list es held above
-- their watermarks, to their buckets still in the window (cur, nb), and
-- removes them from es. Returns the requests and tokens given back and
-- whether es changed.
local function rl_reclaim(hk, es, now, bms, cur, nb)
  local br, bt, changed = 0, 0, false
  local j = 1
  while j <= #es do
    local e = es[j]
    if rl_expiry(e[2], bms) <= now then
      local r, t = math.max(e[3] - e[5], 0), math.max(e[4] - e[6], 0)
      if e[2] >= cur - nb and (r > 0 or t > 0) then
        local v = redis.call('HMGET', hk, 'r' .. e[2], 'rt', 'ro', 'k' .. e[2], 'kt', 'ko')
        local set, del = {}, {}
        if r > 0 then win_apply(set, del, 'r', e[2], -r, v[1], v[2], v[3]) end
        if t > 0 then win_apply(set, del, 'k', e[2], -t, v[4], v[5], v[6]) end
        if #set > 0 then redis.call('HSET', hk, unpack(set)) end
        if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
        br, bt = br + r, bt + t
      end
      table.remove(es, j)
      changed = true
    else
      j = j + 1
    end
  end
  return br, bt, changed
end

-- rl_first is when the first entry of es expires (nil: none).
local function rl_first(es, bms)
  local first = nil
  for _, e in ipairs(es) do
    local x = rl_expiry(e[2], bms)
    if first == nil or x < first then first = x end
  end
  return first
end

-- bh_first is when the first budget lease of hs expires (nil: none).
local function bh_first(hs)
  local first = nil
  for _, h in pairs(hs) do
    if first == nil or h[3] < first then first = h[3] end
  end
  return first
end

-- lease_index records in the org's lease index of slices (bhx: scope state
-- key -> the first expiry of its budget and rate leases) when the first of
-- scope hk's leases expires, or drops hk when it holds none: the sweeper
-- reclaims from it what no call of the scope does. bfirst and rfirst are
-- the first expiries of its budget and rate leases (nil: none).
local function lease_index(ix, hk, bfirst, rfirst, lease_ttl, now)
  local first = bfirst
  if rfirst and (first == nil or rfirst < first) then first = rfirst end
  if first then
    redis.call('ZADD', ix, first, hk)
    redis.call('PEXPIRE', ix, math.max(3 * lease_ttl, first - now + lease_ttl))
  else
    redis.call('ZREM', ix, hk)
  end
end

-- bh_reclaim reclaims the expired budget leases of a 'bh' value raw for
-- the window held, as of now: an expired entry's g - b goes back to the
-- window (b stays spent: the data plane may have spent that much without
-- Redis hearing of it). Returns the micro-USD to take off the spend, the
-- new 'bh' value (nil: unchanged) and the live entries.
local function bh_reclaim(raw, held, now)
  if not raw or not held then return 0, nil, nil end
  local hs = bh_parse(raw, held)
  local back, changed = 0, false
  for inst, h in pairs(hs) do
    if h[3] <= now then
      back = back + math.max(h[1] - h[2], 0)
      hs[inst] = nil
      changed = true
    end
  end
  if not changed then return 0, nil, hs end
  return back, bh_format(held, hs), hs
end
