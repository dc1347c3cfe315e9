-- admit.lua: check every scope of a request and, only if all pass, consume
-- or reserve in all of them. Nothing is written for a rejected request
-- except bookkeeping that is not consumption (the epoch key, pruning of
-- expired entries, starting a new budget window of an intact state at
-- zero). A budget scope whose state is missing (common.lua, budget_held)
-- needs a seed from the ledger first: the answer is then "needs seed" and
-- nothing is consumed anywhere.
--
-- KEYS: layout of common.lua (epoch, record, then 2 keys per scope, then
--   the org's lease index).
-- ARGV:
--   1 request id            2 estimated tokens       3 max cost (micro-USD)
--   4 lease TTL ms          5 quarantine ms          6 record TTL ms
--   7 parallel retry max ms 8 rate window ms         9 bucket ms
--   10 write record (0/1)   11 number of scopes n
--   then 6 values per scope i (base 11 + 6(i-1)):
--     rpm, tpm, max parallel (0 = none), budget cap micro-USD (0 = none),
--     budget unit ('h', 'd', 'mo'; '-' = no budget), budget n
--   then (12 + 6n) the request's report (common.lua; '' = none): with one,
--     the record carries it and the request joins the lease index, so a
--     sweeper settles it if its lease expires unsettled (lease.go).
--   then prefill (common.lua, "Prefill accounting"): (13 + 6n) the scope
--     that accounts the request's prefill (1-based; 0 = none), (14 + 6n)
--     its uncached prompt tokens, (15 + 6n) the scope's prefill cap (0 =
--     none): the request is rejected when the scope's prefill in flight is
--     above 0 and would exceed the cap with it (a request alone may always
--     prefill, as an engine schedules a prompt longer than its token
--     budget in chunks).
-- Returns an array of integers:
--   1 status: 1 admitted, 0 rejected, -1 duplicate request id, 2 needs
--     seed (no scope rejected, but budget scopes have no window: 3 is
--     their number k and 16 .. 15+2k are pairs of scope (1-based) and
--     current window start (Unix s); 4-15 are 0)
--   2 epoch (ms)
--   3 rejecting scope (1-based; 0 when admitted)
--   4 limit type: 1 rpm, 2 tpm, 3 parallel, 4 budget
--   5 retry after ms (-1: never within a window, the cost exceeds the limit)
--   6 budget spend micro-USD   7 budget cap micro-USD
--   8 quarantined (0/1)
--   9-11  tightest requests limit, remaining, reset ms (limit 0: no rpm scope)
--   12-14 tightest tokens limit, remaining, reset ms (limit 0: no tpm scope)
--   15 budget window end (Unix s) of the rejecting budget scope, else 0
--   16 the prefill scope's prefill tokens in flight after the call (with
--     this request's when admitted; 0 without a prefill scope)
-- Limit type 5 is prefill (the prefill cap; retry after is left to the
-- caller: prefill drains at first tokens, which no lease expiry tells).
--
-- Steady-state cost of a scope carrying every limit: one HMGET, one ZCOUNT,
-- one HSET and one ZADD.

local now = now_ms()
local rid = ARGV[1]
local est = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local lease_ttl = tonumber(ARGV[4])
local quarantine = tonumber(ARGV[5])
local record_ttl = tonumber(ARGV[6])
local par_retry_max = tonumber(ARGV[7])
local window_ms = tonumber(ARGV[8])
local bms = tonumber(ARGV[9])
local write_record = ARGV[10] == '1'
local n = tonumber(ARGV[11])
local pfi = tonumber(ARGV[13 + 6 * n]) or 0
local pf_tok = tonumber(ARGV[14 + 6 * n]) or 0
local pf_cap = tonumber(ARGV[15 + 6 * n]) or 0
local pt = 0
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)
local rate_ttl = window_ms + 2 * bms

local epoch = ensure_epoch(now)
if write_record and redis.call('EXISTS', KEYS[2]) == 1 then
  return { -1, epoch, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
end
local quarantine_left = epoch + quarantine - now

-- Phase 1: check every scope; remember what phase 2 needs.
local st = {}
local rej = nil
local unseeded = {} -- scope, window start pairs of budget scopes without a window
for i = 1, n do
  local a = 11 + 6 * (i - 1)
  local s = {
    rpm = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]), par = tonumber(ARGV[a + 3]),
    cap = tonumber(ARGV[a + 4]), unit = ARGV[a + 5], bn = tonumber(ARGV[a + 6]),
  }
  st[i] = s
  local hk = hkey(i)
  if i == pfi then
    -- A prefill scope limits concurrency only (Go checks): its expired
    -- leases leave with their contributions before anything is counted.
    s.v = redis.call('HMGET', hk, 'rt', 'ro', 'r' .. cur, 'kt', 'ko', 'k' .. cur, 'bw', 'bs', 'lx', 'pt')
    pt = prefill_prune(hk, zkey(i), now, tonumber(s.v[10]) or 0)
  elseif s.rpm > 0 or s.tpm > 0 or s.unit ~= '-' or s.par > 0 then
    s.v = redis.call('HMGET', hk, 'rt', 'ro', 'r' .. cur, 'kt', 'ko', 'k' .. cur, 'bw', 'bs', 'lx')
  end
  if s.rpm > 0 then
    s.rtotal, s.rold, s.rcur = win_state(hk, 'r', s.v[1], s.v[2], s.v[3], cur, nb)
    if not rej and s.rtotal + 1 > s.rpm then
      rej = { i, 1, win_wait(hk, 'r', s.rold, cur, s.rtotal, 1, s.rpm, nb, bms, now), 0, 0, 0, 0 }
    end
  end
  if s.tpm > 0 then
    s.ttotal, s.told, s.tcur = win_state(hk, 'k', s.v[4], s.v[5], s.v[6], cur, nb)
    if not rej and s.ttotal + est > s.tpm then
      rej = { i, 2, win_wait(hk, 'k', s.told, cur, s.ttotal, est, s.tpm, nb, bms, now), 0, 0, 0, 0 }
    end
  end
  if s.par > 0 and not rej then
    -- Live leases only (expired ones are pruned when the scope is full,
    -- and the whole set expires when idle).
    local pk = zkey(i)
    if quarantine_left > 0 then
      rej = { i, 3, quarantine_left, 0, 0, 1, 0 }
    else
      s.live = redis.call('ZCOUNT', pk, '(' .. now, '+inf')
      if s.live >= s.par then
        if i ~= pfi then redis.call('ZREMRANGEBYSCORE', pk, '-inf', now) end
        local first = redis.call('ZRANGE', pk, 0, 0, 'WITHSCORES')
        local w = par_retry_max
        if first[2] then w = math.min(tonumber(first[2]) - now, par_retry_max) end
        if w < 1 then w = 1 end
        rej = { i, 3, w, 0, 0, 0, 0 }
      end
    end
  end
  if i == pfi and not rej and pf_cap > 0 and pt > 0 and pt + pf_tok > pf_cap then
    rej = { i, 5, 0, 0, 0, 0, 0 }
  end
  if s.unit ~= '-' then
    local idx, ws, we = budget_window(s.unit, s.bn, now_s)
    s.widx, s.wend = idx, we
    local id = bw_id(s.unit, s.bn, idx)
    local held = budget_held(s.v[7], s.unit, s.bn, idx)
    if held == 'current' then
      s.spend = tonumber(s.v[8]) or 0
    elseif held == 'older' then
      -- A new window of an intact state starts at zero; alert markers of
      -- other windows no longer match.
      s.spend = 0
      redis.call('HSET', hk, 'bw', id, 'bs', 0)
      redis.call('EXPIREAT', hk, we + 3600)
    else
      -- Missing: never started from anything but the ledger (a seed).
      unseeded[#unseeded + 1] = i
      unseeded[#unseeded + 1] = ws
    end
    if not rej and s.spend and s.cap > 0 and s.spend >= s.cap then
      rej = { i, 4, we * 1000 - now, s.spend, s.cap, 0, we }
    end
  end
end

-- A rejection stands on its own; otherwise missing budget windows must be
-- seeded before anything is consumed.
if not rej and #unseeded > 0 then
  local out = { 2, epoch, #unseeded / 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  for _, x in ipairs(unseeded) do out[#out + 1] = x end
  return out
end

-- Phase 2: consume everywhere, only when nothing rejected.
if not rej then
  local rec = { est, cost, cur }
  for i = 1, n do
    local s = st[i]
    local hk = hkey(i)
    local set, del, created = {}, {}, false
    if s.rpm > 0 then
      created = win_apply(set, del, 'r', cur, 1, s.rcur, s.rtotal, s.rold) or created
      s.rtotal = s.rtotal + 1
      if s.rold == nil then s.rold = cur end
    end
    if s.tpm > 0 and est > 0 then
      created = win_apply(set, del, 'k', cur, est, s.tcur, s.ttotal, s.told) or created
      s.ttotal = s.ttotal + est
      if s.told == nil then s.told = cur end
    end
    if s.unit ~= '-' then
      set[#set + 1] = 'bs'
      set[#set + 1] = s.spend + cost
      rec[#rec + 1] = s.widx
    else
      rec[#rec + 1] = '-'
    end
    if s.par > 0 then
      local pk = zkey(i)
      redis.call('ZADD', pk, now + lease_ttl, rid)
      -- The lease set outlives its newest lease: its expiry is pushed to
      -- three lease TTLs whenever fewer than one is left (per 'lx'), or
      -- when the set may be new (no live lease before this one).
      local lx = tonumber(s.v[9])
      if s.live == 0 or not lx or lx - now < lease_ttl then
        redis.call('PEXPIRE', pk, 3 * lease_ttl)
        set[#set + 1] = 'lx'
        set[#set + 1] = now + 3 * lease_ttl
        -- Only a scope limiting concurrency alone may have created its
        -- state hash with this field (other scopes' hashes already expire).
        if s.rpm == 0 and s.tpm == 0 and s.unit == '-' then created = true end
      end
    end
    if i == pfi and pf_tok > 0 then
      pt = pt + pf_tok
      set[#set + 1] = 'p:' .. rid
      set[#set + 1] = pf_tok
      set[#set + 1] = 'pt'
      set[#set + 1] = pt
      created = true -- the hash lives three lease TTLs for the contribution
    end
    if created and (s.rpm > 0 or s.tpm > 0) then
      set[#set + 1] = '_'
      set[#set + 1] = HASHTABLE_PAD
    end
    if #set > 0 then redis.call('HSET', hk, unpack(set)) end
    if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
    if created then state_expiry(hk, s.unit ~= '-', s.wend, s.rpm > 0 or s.tpm > 0, rate_ttl, lease_ttl) end
  end
  if write_record then
    local note = ARGV[12 + 6 * n]
    if note and note ~= '' then
      redis.call('SET', KEYS[2], table.concat(rec, ' ') .. '\n' .. note, 'PX', record_ttl)
      local ik = KEYS[3 + 2 * n]
      redis.call('ZADD', ik, now + lease_ttl, rid)
      redis.call('PEXPIRE', ik, record_ttl)
    else
      redis.call('SET', KEYS[2], table.concat(rec, ' '), 'PX', record_ttl)
    end
  end
end

-- Headers: the tightest rpm and tpm scopes (least remaining); reset is the
-- time until the oldest counted bucket leaves the window (0: window empty).
local h = { 0, 0, 0, 0, 0, 0 }
for i = 1, n do
  local s = st[i]
  if s.rpm > 0 then
    local rem = math.max(s.rpm - s.rtotal, 0)
    if h[1] == 0 or rem < h[2] then
      h[1], h[2] = s.rpm, rem
      h[3] = 0
      if s.rold then h[3] = (s.rold + nb + 1) * bms - now end
    end
  end
  if s.tpm > 0 then
    local rem = math.max(s.tpm - s.ttotal, 0)
    if h[4] == 0 or rem < h[5] then
      h[4], h[5] = s.tpm, rem
      h[6] = 0
      if s.told then h[6] = (s.told + nb + 1) * bms - now end
    end
  end
end

if rej then
  return { 0, epoch, rej[1], rej[2], rej[3], rej[4], rej[5], rej[6], h[1], h[2], h[3], h[4], h[5], h[6], rej[7], pt }
end
return { 1, epoch, 0, 0, 0, 0, 0, 0, h[1], h[2], h[3], h[4], h[5], h[6], 0, pt }
