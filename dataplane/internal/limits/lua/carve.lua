-- carve.lua: return, renew and carve quota slices of many scopes of one
-- org in one call (slices.go; docs/limits.md, "Quota slices").
--
-- rpm/tpm: a slice is consumption carved in advance: its requests and
-- tokens are added to one bucket of the scope's window, exactly as if that
-- many requests (tokens) had been admitted in that bucket, and the data
-- plane that carved it admits locally against it until that bucket ends.
-- What it did not use is returned to the same bucket afterwards (a refund,
-- as settle.lua refunds a cancelled admission); token estimates exceeded by
-- real usage are charged (a debt) the same way settle.lua does.
--
-- budget: a slice is a reservation added to the spend 'bs' of the current
-- budget window, as an admission reserves a request's maximum cost; the
-- data plane admits requests against it and gives back what they did not
-- spend (returns into the window it was carved in, only while Redis holds
-- that window of the same epoch), or charges what they spent above their
-- reservation (a debt). Alerts are checked when the spend grows, as
-- settle.lua does (so a carve may fire an alert early, never late).
-- Budget slices are held under a lease: the field 'bh' of the state hash
-- holds, for the window it names, one entry per data plane ("<prefix> g b
-- expiry"): g what its slices put in the spend and did not give back, b
-- its watermark (it never uses more than b of g without a call raising b
-- first, so b bounds what it may have spent). Every call of the data plane
-- for the scope renews its entry (expiry = now + lease TTL); an entry that
-- expired (a dead data plane) is reclaimed by the next call for the scope:
-- g - b goes back to the window, b stays spent. Positive returns count only
-- while the data plane's entry is live (after it expired they may have
-- been reclaimed already).
--
-- Rate slices are held under rate leases: the field 'ql' of the state
-- hash holds one entry per data plane and bucket ("<prefix> b gr gt wr
-- wt", common.lua): gr/gt what its slices put in bucket b and did not give
-- back, wr/wt its watermarks (it never uses more than them of what it holds
-- in b without a call raising them first). Its slices end before b does,
-- so one bucket after b ends an entry is expired (a dead data plane's, or
-- one whose last return was lost): the next call for the scope, from any
-- data plane, or a sweeper (reclaim.lua) gives gr - wr and gt - wt back to
-- b, the watermarks' worth stays counted. What a data plane gives back of
-- a slice it did not use (a free return) counts only while its entry is
-- there (after it expired it may have been reclaimed already), and is
-- taken off its gr/gt; refunds of units it used and debts count always.
--
-- concurrency: a slice is lease members "<instance>:<n>" of the data plane
-- in the scope's lease set, scored by their expiry like any request's
-- lease; the data plane renews every member it holds once per renew
-- interval (a ZADD, which also re-asserts them after a state loss) and
-- removes the ones it gives back. A dead data plane's members expire with
-- the lease TTL.
--
-- A slice of any kind is carved only from the room left below limit x (1 -
-- reserve), a share of it at a time, so near the limit slices shrink and
-- stop, and the scope falls back to exact per-request admission
-- (admit.lua).
--
-- KEYS: 1 the org's epoch; then per item i: 2i the scope's state hash,
--   2i+1 its lease set (common.lua); last (2n+2) the org's budget-lease
--   index (scope state hash -> earliest expiry of its budget leases, so a
--   sweeper finds expired ones: reclaim.lua).
-- ARGV:
--   1 rate window ms   2 bucket ms   3 number of items n
--   4 reserve (per mille of the limit never carved)
--   5 share (a carve takes at most 1/share of the room)
--   6 lease TTL ms     7 quarantine ms
--   8 member name prefix ("~<instance>:")
--   9 number of alert thresholds m, then m thresholds (percent of the cap)
--   then per item:
--     rate: rpm limit, tpm limit (0 = none), wanted requests, wanted
--       tokens (0 0: none), the watermarks of a new lease (requests,
--       tokens), number of returns k, then k triples: bucket, requests,
--       tokens (tokens < 0: a debt to charge), number of free returns kf,
--       then kf triples: bucket, requests, tokens, number of watermark
--       raises q, then q triples: bucket, requests, tokens
--     budget: unit ('-': none), n, cap, soft, wanted micro-USD, the
--       watermark b, number of returns kb, then kb triples: window index,
--       epoch, micro-USD (> 0 unused, back to that window; < 0 a debt)
--     concurrency: limit (0: none), wanted members, number of the first
--       new member, number of members to renew r, then r names, number of
--       members to remove g, then g names
-- Returns {epoch, then per item 17 values and 2a more}: granted requests,
--   granted tokens, the bucket they were carved in, ms until that bucket
--   ends (the slice's life), requests remaining in the window after the
--   carve, ms until the oldest requests bucket leaves, tokens remaining,
--   ms until the oldest tokens bucket leaves; granted micro-USD, the
--   budget window index, ms until that window ends, micro-USD remaining
--   below the cap (-1: the window is not seeded); granted members (named from the first new number on),
--   live members after the call; the number of alerts a, then a pairs:
--   threshold percent (0 = the soft budget), spend micro-USD; then the
--   number e of this data plane's rate leases of the scope, then e
--   quintuples: bucket, gr, gt, wr, wt. A scope with rpm and tpm gets both
--   or neither.

local now = now_ms()
local window_ms = tonumber(ARGV[1])
local bms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local reserve = tonumber(ARGV[4])
local share = tonumber(ARGV[5])
local lease_ttl = tonumber(ARGV[6])
local quarantine = tonumber(ARGV[7])
local mprefix = ARGV[8]
local m = tonumber(ARGV[9])
local thresholds = {}
for j = 1, m do thresholds[j] = tonumber(ARGV[9 + j]) end
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)
local rate_ttl = window_ms + 3 * bms

local bhx = KEYS[2 * n + 2]
local epoch = ensure_epoch(now)
local quarantined = epoch + quarantine > now
local out = { epoch }
local a = 9 + m
for i = 1, n do
  local hk, pk = KEYS[2 * i], KEYS[2 * i + 1]
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local want_r, want_t = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local ahead_r, ahead_t = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local k = tonumber(ARGV[a + 7])
  a = a + 7
  local created = false
  local kf = tonumber(ARGV[a + 3 * k + 1])
  local q = tonumber(ARGV[a + 3 * k + 3 * kf + 2])
  -- Rate leases: the expired ones (of any data plane) are reclaimed.
  local rl, rlchanged, mine_r = nil, false, {}
  if rpm > 0 or tpm > 0 or k > 0 or kf > 0 or q > 0 then
    rl = rl_parse(redis.call('HGET', hk, 'ql'))
    local _, _, ch = rl_reclaim(hk, rl, now, bms, cur, nb)
    rlchanged = ch
    for _, e in ipairs(rl) do
      if e[1] == mprefix then mine_r[e[2]] = e end
    end
  end
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
  -- Free returns: what slices did not use goes back while this data
  -- plane's lease of the bucket is there, and comes off it.
  a = a + 1
  for _ = 1, kf do
    local b, r, t = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 3
    local e = mine_r[b]
    if e then
      r, t = math.min(math.max(r, 0), math.max(e[3], 0)), math.min(math.max(t, 0), math.max(e[4], 0))
      e[3], e[4] = e[3] - r, e[4] - t
      rlchanged = true
      if b >= cur - nb and (r > 0 or t > 0) then
        local v = redis.call('HMGET', hk, 'r' .. b, 'rt', 'ro', 'k' .. b, 'kt', 'ko')
        local set, del = {}, {}
        if r > 0 then win_apply(set, del, 'r', b, -r, v[1], v[2], v[3]) end
        if t > 0 then win_apply(set, del, 'k', b, -t, v[4], v[5], v[6]) end
        if #set > 0 then redis.call('HSET', hk, unpack(set)) end
        if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
      end
    end
  end
  -- Watermark raises of the leases held.
  a = a + 1
  for _ = 1, q do
    local b, wr, wt = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 3
    local e = mine_r[b]
    if e and (wr > e[5] or wt > e[6]) then
      e[5], e[6] = math.max(e[5], wr), math.max(e[6], wt)
      rlchanged = true
    end
  end
  local gr, gt, tb, life = 0, 0, cur, 0
  local rr, rs, tr, ts = 0, 0, 0, 0
  if rpm > 0 or tpm > 0 then
    -- The carve: into the current bucket while at least half of it is
    -- left, else into the next one (counted from now on, so it is
    -- conservative for every check until then), so a slice lives 0.5 to
    -- 1.5 buckets.
    local left = (cur + 1) * bms - now
    life = left
    if left < bms / 2 then tb, life = cur + 1, left + bms end
    local v = redis.call('HMGET', hk, 'rt', 'ro', 'r' .. cur, 'r' .. tb, 'kt', 'ko', 'k' .. cur, 'k' .. tb)
    local rtotal, rold, ttotal, told = 0, nil, 0, nil
    if rpm > 0 then rtotal, rold = win_state(hk, 'r', v[1], v[2], v[3], cur, nb) end
    if tpm > 0 then ttotal, told = win_state(hk, 'k', v[5], v[6], v[7], cur, nb) end
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
      -- This data plane's lease of the bucket carved in.
      local e = mine_r[tb]
      if e then
        e[3], e[4] = e[3] + gr, e[4] + gt
      else
        e = { mprefix, tb, gr, gt, ahead_r, ahead_t }
        rl[#rl + 1] = e
        mine_r[tb] = e
      end
      rlchanged = true
    end
    if rpm > 0 then
      rr = math.max(rpm - rtotal, 0)
      if rold then rs = (rold + nb + 1) * bms - now end
    end
    if tpm > 0 then
      tr = math.max(tpm - ttotal, 0)
      if told then ts = (told + nb + 1) * bms - now end
    end
  end
  if rlchanged then
    local kept = {}
    for _, e in ipairs(rl) do
      if e[3] > 0 or e[4] > 0 then kept[#kept + 1] = e else mine_r[e[2]] = nil end
    end
    rl = kept
    if #rl > 0 then redis.call('HSET', hk, 'ql', rl_format(rl)) else redis.call('HDEL', hk, 'ql') end
  end
  if created then
    -- Like admit.lua for a scope without a budget: the hash outlives its
    -- newest bucket (one bucket later than admit.lua's, for a carve into
    -- the next bucket); a budget's longer expiry is kept.
    if redis.call('PTTL', hk) < rate_ttl then redis.call('PEXPIRE', hk, rate_ttl) end
  end

  -- Budget.
  local unit, bn, cap, soft = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local want_b, wm, kb = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  a = a + 7
  local gb, widx, wleft, brem = 0, 0, 0, 0
  local bwm, breset = 0, 0
  local alerts = {}
  local bfirst, bindexed = nil, false
  if unit ~= '-' then
    local idx, _, we = budget_window(unit, bn, now_s)
    local id = bw_id(unit, bn, idx)
    widx, wleft = idx, we * 1000 - now
    local fields = { 'bw', 'bs', 'bsoft', 'bh' }
    for j = 1, m do fields[#fields + 1] = 'ba' .. thresholds[j] end
    local v = redis.call('HMGET', hk, unpack(fields))
    local held = v[1]
    local spend = tonumber(v[2]) or 0
    local grew = false
    local changed = false
    -- Budget leases: reclaim the expired ones (g - b back to the window).
    local hs = bh_parse(v[4], held)
    local hchanged = false
    for inst, h in pairs(hs) do
      if h[3] <= now then
        spend = math.max(spend - math.max(h[1] - h[2], 0), 0)
        hs[inst] = nil
        changed, hchanged = true, true
      end
    end
    local mine = hs[mprefix]
    for _ = 1, kb do
      local w, ep, x = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      a = a + 3
      if x > 0 and mine == nil then
        -- The lease these slices were held under is gone (reclaimed, or
        -- another window): what they did not use may be back already.
      elseif ep == epoch then
        if mine and x > 0 and held == bw_id(unit, bn, w) then mine[1] = math.max(mine[1] - x, 0) end
        if held == bw_id(unit, bn, w) then
          -- Back to (or charged in) the window it was carved in.
          spend = math.max(spend - x, 0)
          changed = true
          if x < 0 then grew = true end
        elseif x < 0 and held == id then
          -- A debt whose window has ended goes to the current one.
          spend = spend - x
          changed, grew = true, true
        end
      end
    end
    local state = budget_held(held, unit, bn, idx)
    if want_b > 0 and state == 'older' then
      -- A new window of an intact state starts at zero (as in admit.lua).
      held, spend, state, changed = id, 0, 'current', true
      hs, mine, hchanged = {}, nil, true
      redis.call('HSET', hk, 'bw', id)
      redis.call('EXPIREAT', hk, we + 3600)
    end
    if want_b > 0 and state == 'current' and cap > 0 then
      local room = math.floor(cap * (1000 - reserve) / 1000) - spend
      if room > 0 then gb = math.min(want_b, math.floor(room / share)) end
      if gb > 0 then
        spend = spend + gb
        changed, grew = true, true
      end
    end
    -- This data plane's lease: renewed, or made when it carves.
    if mine == nil then
      breset = 1
      if gb > 0 then
        mine = { 0, 0, 0 }
        hs[mprefix] = mine
      end
    end
    if mine then
      mine[1] = mine[1] + gb
      mine[2] = math.max(mine[2], wm)
      mine[3] = now + lease_ttl
      bwm = mine[2]
      hchanged = true
    end
    if held == id then
      brem = math.max(cap - spend, 0)
    elseif want_b > 0 then
      -- The window is not seeded (no state, or another budget's): -1 tells
      -- the data plane to carve again as soon as an admission has seeded
      -- it, rather than back off as from a window without room.
      brem = -1
    end
    if changed or hchanged then
      local set = { 'bs', spend }
      if hchanged and held then
        set[#set + 1] = 'bh'
        set[#set + 1] = bh_format(held, hs)
        bfirst, bindexed = bh_first(hs), true
      end
      if grew and held == id then
        if cap > 0 then
          for j = 1, m do
            local pct = thresholds[j]
            if v[4 + j] ~= id and spend * 100 >= cap * pct then
              set[#set + 1] = 'ba' .. pct
              set[#set + 1] = id
              alerts[#alerts + 1] = { pct, spend }
            end
          end
        end
        if soft > 0 and v[3] ~= id and spend >= soft then
          set[#set + 1] = 'bsoft'
          set[#set + 1] = id
          alerts[#alerts + 1] = { 0, spend }
        end
      end
      redis.call('HSET', hk, unpack(set))
    end
  end

  -- The lease index of slices: when the first budget or rate lease of
  -- the scope expires.
  if rlchanged or bindexed then
    if not bindexed then
      local v = redis.call('HMGET', hk, 'bw', 'bh')
      if v[1] and v[2] then bfirst = bh_first(bh_parse(v[2], v[1])) end
    end
    local rfirst = nil
    if rl then rfirst = rl_first(rl, bms) end
    lease_index(bhx, hk, bfirst, rfirst, lease_ttl, now)
  end

  -- Concurrency.
  local par, want_p, seq = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local nr = tonumber(ARGV[a + 4])
  a = a + 4
  local ren = {}
  for j = 1, nr do
    ren[#ren + 1] = now + lease_ttl
    ren[#ren + 1] = ARGV[a + j]
  end
  a = a + nr
  local ng = tonumber(ARGV[a + 1])
  a = a + 1
  if ng > 0 then redis.call('ZREM', pk, unpack(ARGV, a + 1, a + ng)) end
  a = a + ng
  local gp, live = 0, 0
  if par > 0 then
    if #ren > 0 then redis.call('ZADD', pk, unpack(ren)) end
    if want_p > 0 and not quarantined then
      live = redis.call('ZCOUNT', pk, '(' .. now, '+inf')
      local keep = math.max(math.floor(par * reserve / 1000), 1)
      local room = par - keep - live
      if room > 0 then gp = math.min(want_p, math.floor(room / share)) end
      if gp > 0 then
        local add = {}
        for q = 0, gp - 1 do
          add[#add + 1] = now + lease_ttl
          add[#add + 1] = mprefix .. (seq + q)
        end
        redis.call('ZADD', pk, unpack(add))
        live = live + gp
      end
    end
    if #ren > 0 or gp > 0 then
      -- The lease set outlives its newest lease (as in admit.lua).
      redis.call('PEXPIRE', pk, 3 * lease_ttl)
    end
  end

  out[#out + 1] = gr
  out[#out + 1] = gt
  out[#out + 1] = tb
  out[#out + 1] = life
  out[#out + 1] = rr
  out[#out + 1] = rs
  out[#out + 1] = tr
  out[#out + 1] = ts
  out[#out + 1] = gb
  out[#out + 1] = widx
  out[#out + 1] = wleft
  out[#out + 1] = brem
  out[#out + 1] = gp
  out[#out + 1] = live
  out[#out + 1] = bwm
  out[#out + 1] = breset
  out[#out + 1] = #alerts
  for _, x in ipairs(alerts) do
    out[#out + 1] = x[1]
    out[#out + 1] = x[2]
  end
  local ne = 0
  for _ in pairs(mine_r) do ne = ne + 1 end
  out[#out + 1] = ne
  for b, e in pairs(mine_r) do
    out[#out + 1] = b
    out[#out + 1] = e[3]
    out[#out + 1] = e[4]
    out[#out + 1] = e[5]
    out[#out + 1] = e[6]
  end
end
return out
