-- carve.lua: return and carve quota slices of rpm/tpm windows for many
-- scopes of one org in one call (slices.go; docs/limits.md, "Quota
-- slices").
--
-- A slice is consumption carved in advance: its requests and tokens are
-- added to one bucket of the scope's window, exactly as if that many
-- requests (tokens) had been admitted in that bucket, and the data plane
-- that carved it admits locally against it until that bucket ends. What it
-- did not use is returned to the same bucket afterwards (a refund, as
-- settle.lua refunds a cancelled admission); token estimates exceeded by
-- real usage are charged (a debt) the same way settle.lua does. A slice is
-- carved only from the room left below limit x (1 - reserve), a share of
-- it at a time, so near the limit slices shrink and stop, and the scope
-- falls back to exact per-request admission (admit.lua).
--
-- KEYS: 1 the org's epoch; 1+i the state hash of item i (common.lua).
-- ARGV:
--   1 rate window ms   2 bucket ms   3 number of items n
--   4 reserve (per mille of the limit never carved)
--   5 share (a carve takes at most 1/share of the room)
--   then per item: rpm limit, tpm limit (0 = none), wanted requests,
--     wanted tokens (0 0: return only), number of returns k, then k
--     triples: bucket, requests, tokens (tokens < 0: a debt to charge)
-- Returns {epoch, then per item 8 values}: granted requests, granted
--   tokens, the bucket they were carved in, ms until that bucket ends
--   (the slice's life), requests remaining in the window after the carve,
--   ms until the oldest requests bucket leaves, tokens remaining, ms until
--   the oldest tokens bucket leaves. A scope with both limits gets both or
--   neither.

local now = now_ms()
local window_ms = tonumber(ARGV[1])
local bms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local reserve = tonumber(ARGV[4])
local share = tonumber(ARGV[5])
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local rate_ttl = window_ms + 3 * bms

local epoch = ensure_epoch(now)
local out = { epoch }
local a = 5
for i = 1, n do
  local hk = KEYS[1 + i]
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local want_r, want_t = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local k = tonumber(ARGV[a + 5])
  a = a + 5
  local created = false
  -- Returns first: what the data plane did not use goes back to the bucket
  -- it was carved in, while that bucket is in the window (after, it has
  -- left anyway); a debt goes to that bucket, or the current one.
  for _ = 1, k do
    local b, r, t = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 3
    local live = b >= cur - nb
    local tb = b
    if not live then tb = cur end
    local v = redis.call('HMGET', hk, 'r' .. b, 'rt', 'ro', 'k' .. tb, 'kt', 'ko')
    local set, del = {}, {}
    if live and r > 0 then win_apply(set, del, 'r', b, -r, v[1], v[2], v[3]) end
    if t ~= 0 and (live or t < 0) then
      created = win_apply(set, del, 'k', tb, -t, v[4], v[5], v[6]) or created
    end
    if #set > 0 then redis.call('HSET', hk, unpack(set)) end
    if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
  end
  -- The carve: into the current bucket while at least half of it is left,
  -- else into the next one (counted from now on, so it is conservative
  -- for every check until then), so a slice lives 0.5 to 1.5 buckets.
  local left = (cur + 1) * bms - now
  local tb, life = cur, left
  if left < bms / 2 then tb, life = cur + 1, left + bms end
  local v = redis.call('HMGET', hk, 'rt', 'ro', 'r' .. cur, 'r' .. tb, 'kt', 'ko', 'k' .. cur, 'k' .. tb)
  local rtotal, rold, ttotal, told = 0, nil, 0, nil
  if rpm > 0 then rtotal, rold = win_state(hk, 'r', v[1], v[2], v[3], cur, nb) end
  if tpm > 0 then ttotal, told = win_state(hk, 'k', v[5], v[6], v[7], cur, nb) end
  local gr, gt = 0, 0
  if rpm > 0 and want_r > 0 then
    local room = math.floor(rpm * (1000 - reserve) / 1000) - rtotal
    if room > 0 then gr = math.min(want_r, math.floor(room / share)) end
  end
  if tpm > 0 and want_t > 0 then
    local room = math.floor(tpm * (1000 - reserve) / 1000) - ttotal
    if room > 0 then gt = math.min(want_t, math.floor(room / share)) end
  end
  if (rpm > 0 and gr <= 0) or (tpm > 0 and gt <= 0) then gr, gt = 0, 0 end
  if gr > 0 or gt > 0 then
    -- win_state may have rewritten the bookkeeping: read it again.
    local w = redis.call('HMGET', hk, 'rt', 'ro', 'r' .. tb, 'kt', 'ko', 'k' .. tb)
    local set, del = {}, {}
    if gr > 0 then
      created = win_apply(set, del, 'r', tb, gr, w[3], w[1], w[2]) or created
      rtotal = rtotal + gr
      if rold == nil or tb < rold then rold = tb end
    end
    if gt > 0 then
      created = win_apply(set, del, 'k', tb, gt, w[6], w[4], w[5]) or created
      ttotal = ttotal + gt
      if told == nil or tb < told then told = tb end
    end
    if created then
      set[#set + 1] = '_'
      set[#set + 1] = HASHTABLE_PAD
    end
    redis.call('HSET', hk, unpack(set))
  end
  if created then
    -- Like admit.lua for a scope without a budget: the hash outlives its
    -- newest bucket (one bucket later than admit.lua's, for a carve into
    -- the next bucket). A scope that also has a budget is never sliced.
    if redis.call('PTTL', hk) < rate_ttl then redis.call('PEXPIRE', hk, rate_ttl) end
  end
  local rr, rs, tr, ts = 0, 0, 0, 0
  if rpm > 0 then
    rr = math.max(rpm - rtotal, 0)
    if rold then rs = (rold + nb + 1) * bms - now end
  end
  if tpm > 0 then
    tr = math.max(tpm - ttotal, 0)
    if told then ts = (told + nb + 1) * bms - now end
  end
  out[#out + 1] = gr
  out[#out + 1] = gt
  out[#out + 1] = tb
  out[#out + 1] = life
  out[#out + 1] = rr
  out[#out + 1] = rs
  out[#out + 1] = tr
  out[#out + 1] = ts
end
return out
