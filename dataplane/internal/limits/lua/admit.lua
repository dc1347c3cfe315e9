-- admit.lua: admit a batch of requests of one org, in order: for each,
-- check every scope and, only if all pass, consume or reserve in all of
-- them, against the state the requests before it in the batch left. A
-- batch of one is the admission of one request. Nothing is written for a
-- rejected request except bookkeeping that is not consumption (the epoch
-- key, pruning of expired entries, starting a new budget window of an
-- intact state at zero). A budget scope whose state is missing
-- (common.lua, budget_held) needs a seed from the ledger first: the answer
-- is then "needs seed" and nothing is consumed for that request.
--
-- The requests run at one time (one TIME), so each scope shared by the
-- batch is read once (one HMGET, one ZCOUNT for its leases), checked and
-- updated in Lua for every request, and written once (one HSET, one ZADD
-- of every lease it took): a batch costs little more than one admission.
--
-- KEYS: 1 the org's epoch; 2 .. R+1 the requests' records; then 2 keys per
--   distinct scope s (R+2+2(s-1): state hash, R+3+2(s-1): leases), see
--   common.lua; then the org's lease index (last).
-- ARGV:
--   1 lease TTL ms          2 quarantine ms          3 record TTL ms
--   4 parallel retry max ms 5 rate window ms         6 bucket ms
--   7 number of requests R
--   then per request: request id, estimated tokens, max cost (micro-USD),
--     write record (0/1), number of its scopes n, then 7 values per scope:
--       distinct scope index s (1-based), rpm, tpm, max parallel (0 =
--       none), budget cap micro-USD (0 = none), budget unit ('h', 'd',
--       'mo'; '-' = no budget), budget n
--     then the request's report (common.lua; '' = none): with one, the
--       record carries it and the request joins the lease index, so a
--       sweeper settles it if its lease expires unsettled (lease.go);
--     then prefill (common.lua, "Prefill accounting"): the scope (among
--       the request's, 1-based; 0 = none) that accounts the request's
--       prefill, its uncached prompt tokens, the scope's prefill cap (0 =
--       none): the request is rejected when the scope's prefill in flight
--       is above 0 and would exceed the cap with it (a request alone may
--       always prefill, as an engine schedules a prompt longer than its
--       token budget in chunks).
-- Returns, per request, the number of its values L then L integers:
--   1 status: 1 admitted, 0 rejected, -1 duplicate request id, 2 needs
--     seed (no scope rejected, but budget scopes have no window: 3 is
--     their number k and 16 .. 15+2k are pairs of scope (1-based, among
--     the request's) and current window start (Unix s); 4-15 are 0)
--   2 epoch (ms)
--   3 rejecting scope (1-based; 0 when admitted)
--   4 limit type: 1 rpm, 2 tpm, 3 parallel, 4 budget
--   5 retry after ms (-1: never within a window, the cost exceeds the limit)
--   6 budget spend micro-USD   7 budget cap micro-USD
--   8 quarantined (0/1)
--   9-11  tightest requests limit, remaining, reset ms (limit 0: no rpm scope)
--   12-14 tightest tokens limit, remaining, reset ms (limit 0: no tpm scope)
--   15 budget window end (Unix s) of the rejecting budget scope, else 0
--   16 the prefill scope's prefill tokens in flight after the request
--     (with its own when admitted; 0 without a prefill scope)
-- Limit type 5 is prefill (the prefill cap; retry after is left to the
-- caller: prefill drains at first tokens, which no lease expiry tells).
--
-- Cost: one TIME and one MGET (epoch and records) per call; per distinct
-- scope carrying every limit, one HMGET, one ZCOUNT, one HSET and one ZADD
-- per call; per admitted request with a record, one SET.

local now = now_ms()
local lease_ttl = tonumber(ARGV[1])
local quarantine = tonumber(ARGV[2])
local record_ttl = tonumber(ARGV[3])
local par_retry_max = tonumber(ARGV[4])
local window_ms = tonumber(ARGV[5])
local bms = tonumber(ARGV[6])
local nreq = tonumber(ARGV[7])
local nb = math.floor(window_ms / bms)
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)
local rate_ttl = window_ms + 2 * bms

local function shkey(s) return KEYS[nreq + 2 + 2 * (s - 1)] end
local function szkey(s) return KEYS[nreq + 3 + 2 * (s - 1)] end

-- The epoch and the records in one read (ensure_epoch's GET folded in).
local heads = redis.call('MGET', unpack(KEYS, 1, nreq + 1))
local epoch = tonumber(heads[1])
if not epoch then
  redis.call('SET', KEYS[1], now)
  epoch = now
end
local quarantine_left = epoch + quarantine - now

-- The state of each distinct scope, read once, as the batch leaves it:
--   v          the HMGET of the fields below (as read)
--   rinit, rtotal, rold, rcur, radd   requests window (win_state) and what
--                                     the batch added to bucket cur
--   kinit, ...                        the same for tokens
--   live, live0                       live leases (now, and as read)
--   bw, bs, bdirty, bwend             budget window id, spend, whether to
--                                     write them, the window's end
--   pf, pt, pdirty                    prefill: pruned, total, to write
--   leases                            ZADD pairs of the leases taken
--   set                               further fields to write (p:<rid>)
--   created, has_budget, wend, has_rate   for state_expiry
local cache = {}
local function scope(s)
  local c = cache[s]
  if not c then
    local v = redis.call('HMGET', shkey(s), 'rt', 'ro', 'r' .. cur, 'kt', 'ko', 'k' .. cur, 'bw', 'bs', 'lx', 'pt', 'bh')
    c = { v = v, bw = v[7], bs = tonumber(v[8]), radd = 0, kadd = 0, leases = {}, set = {}, created = false }
    if v[11] and c.bs then
      -- Budget leases of quota slices that expired (a dead data plane's)
      -- are reclaimed here too, as carve.lua does: a scope admitted
      -- exactly gets its budget back without waiting for a carve.
      local back, bh = bh_reclaim(v[11], c.bw, now)
      if bh then c.bs, c.bh, c.bdirty = math.max(c.bs - back, 0), bh, true end
    end
    cache[s] = c
  end
  return c
end

-- cwin_wait is win_wait (common.lua) on the cached window: the bucket cur
-- read from Redis lacks what the batch added (add).
local function cwin_wait(hk, p, oldest, total, cost, limit, add)
  if cost > limit then return -1 end
  local need = total + cost - limit
  if need <= 0 then return 0 end
  if oldest == nil then return (nb + 1) * bms end
  local fields = {}
  for b = oldest, cur do fields[#fields + 1] = p .. b end
  local vals = redis.call('HMGET', hk, unpack(fields))
  for j = 1, #fields do
    local x = tonumber(vals[j]) or 0
    if j == #fields then x = x + add end
    if x > 0 then
      need = need - x
      if need <= 0 then
        local w = (oldest + j - 1 + nb + 1) * bms - now
        if w < 1 then w = 1 end
        return w
      end
    end
  end
  return (nb + 1) * bms
end

local out = {}
local seen = {} -- request ids with a record admitted by this call
local index = {} -- ZADD pairs of the lease index
local a = 7
for r = 1, nreq do
  local rid, est, cost = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local write_record = ARGV[a + 4] == '1'
  local n = tonumber(ARGV[a + 5])
  local sa = a + 5
  a = sa + 7 * n
  local note = ARGV[a + 1]
  local pfi, pf_tok, pf_cap = tonumber(ARGV[a + 2]) or 0, tonumber(ARGV[a + 3]) or 0, tonumber(ARGV[a + 4]) or 0
  a = a + 4
  local pt = 0
  local res
  if write_record and (heads[r + 1] or seen[rid]) then
    res = { -1, epoch, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  else
    -- Phase 1: check every scope; remember what phase 2 needs.
    local st = {}
    local rej = nil
    local unseeded = {} -- scope, window start pairs of budget scopes without a window
    for i = 1, n do
      local b = sa + 7 * (i - 1)
      local s = {
        d = tonumber(ARGV[b + 1]), rpm = tonumber(ARGV[b + 2]), tpm = tonumber(ARGV[b + 3]),
        par = tonumber(ARGV[b + 4]), cap = tonumber(ARGV[b + 5]), unit = ARGV[b + 6], bn = tonumber(ARGV[b + 7]),
      }
      st[i] = s
      local hk = shkey(s.d)
      if i == pfi or s.rpm > 0 or s.tpm > 0 or s.unit ~= '-' or s.par > 0 then
        local c = scope(s.d)
        s.c = c
        if i == pfi and not c.pf then
          -- A prefill scope limits concurrency only (Go checks): its
          -- expired leases leave with their contributions before anything
          -- is counted.
          c.pf = true
          c.pt = prefill_prune(hk, szkey(s.d), now, tonumber(c.v[10]) or 0)
        end
        if i == pfi then pt = c.pt end
        if s.rpm > 0 then
          if not c.rinit then
            c.rinit = true
            c.rtotal, c.rold, c.rcur = win_state(hk, 'r', c.v[1], c.v[2], c.v[3], cur, nb)
            c.rcur0 = c.rcur
          end
          if not rej and c.rtotal + 1 > s.rpm then
            rej = { i, 1, cwin_wait(hk, 'r', c.rold, c.rtotal, 1, s.rpm, c.radd), 0, 0, 0, 0 }
          end
        end
        if s.tpm > 0 then
          if not c.kinit then
            c.kinit = true
            c.ttotal, c.told, c.tcur = win_state(hk, 'k', c.v[4], c.v[5], c.v[6], cur, nb)
            c.tcur0 = c.tcur
          end
          if not rej and c.ttotal + est > s.tpm then
            rej = { i, 2, cwin_wait(hk, 'k', c.told, c.ttotal, est, s.tpm, c.kadd), 0, 0, 0, 0 }
          end
        end
        if s.par > 0 and not rej then
          -- Live leases only (expired ones are pruned when the scope is
          -- full, and the whole set expires when idle).
          local pk = szkey(s.d)
          if quarantine_left > 0 then
            rej = { i, 3, quarantine_left, 0, 0, 1, 0 }
          else
            if not c.live then
              c.live = redis.call('ZCOUNT', pk, '(' .. now, '+inf')
              c.live0 = c.live
            end
            if c.live >= s.par then
              if not c.pf then redis.call('ZREMRANGEBYSCORE', pk, '-inf', now) end
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
          local held = budget_held(c.bw, s.unit, s.bn, idx)
          if held == 'current' then
            s.spend = c.bs or 0
          elseif held == 'older' then
            -- A new window of an intact state starts at zero; alert
            -- markers of other windows no longer match.
            s.spend = 0
            c.bw, c.bs, c.bdirty, c.bwend = id, 0, true, we
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
    end

    if not rej and #unseeded > 0 then
      -- A rejection stands on its own; otherwise missing budget windows
      -- must be seeded before anything is consumed.
      res = { 2, epoch, #unseeded / 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
      for _, x in ipairs(unseeded) do res[#res + 1] = x end
    else
      -- Phase 2: consume everywhere, only when nothing rejected.
      if not rej then
        local rec = { est, cost, cur }
        for i = 1, n do
          local s = st[i]
          local c = s.c
          local created = false
          if s.rpm > 0 then
            c.radd = c.radd + 1
            c.rcur = c.rcur + 1
            c.rtotal = c.rtotal + 1
            if c.rold == nil then c.rold, c.rnewold = cur, true end
            if c.rcur0 == 0 and c.radd == 1 then created = true end
          end
          if s.tpm > 0 and est > 0 then
            c.kadd = c.kadd + est
            c.tcur = c.tcur + est
            c.ttotal = c.ttotal + est
            if c.told == nil then c.told, c.tnewold = cur, true end
            if c.tcur0 == 0 and c.kadd == est then created = true end
          end
          if s.unit ~= '-' then
            c.bs = s.spend + cost
            c.bdirty = true
            rec[#rec + 1] = s.widx
          else
            rec[#rec + 1] = '-'
          end
          if s.par > 0 then
            c.leases[#c.leases + 1] = now + lease_ttl
            c.leases[#c.leases + 1] = rid
            c.live = c.live + 1
            -- The lease set outlives its newest lease: its expiry is
            -- pushed to three lease TTLs whenever fewer than one is left
            -- (per 'lx'), or when the set may be new (no live lease
            -- before the batch's).
            if not c.lxdone then
              local lx = tonumber(c.v[9])
              if c.live0 == 0 or not lx or lx - now < lease_ttl then
                c.lxpush = true
                -- Only a scope limiting concurrency alone may have
                -- created its state hash with this field (other scopes'
                -- hashes already expire).
                if s.rpm == 0 and s.tpm == 0 and s.unit == '-' then created = true end
              end
              c.lxdone = true
            end
          end
          if i == pfi and pf_tok > 0 then
            c.pt = c.pt + pf_tok
            pt = c.pt
            c.pdirty = true
            c.set[#c.set + 1] = 'p:' .. rid
            c.set[#c.set + 1] = pf_tok
            created = true -- the hash lives three lease TTLs for the contribution
          end
          if created then
            c.created = true
            c.has_budget, c.wend, c.has_rate = s.unit ~= '-', s.wend, s.rpm > 0 or s.tpm > 0
          end
        end
        if write_record then
          seen[rid] = true
          if note and note ~= '' then
            redis.call('SET', KEYS[1 + r], table.concat(rec, ' ') .. '\n' .. note, 'PX', record_ttl)
            index[#index + 1] = now + lease_ttl
            index[#index + 1] = rid
          else
            redis.call('SET', KEYS[1 + r], table.concat(rec, ' '), 'PX', record_ttl)
          end
        end
      end

      -- Headers: the tightest rpm and tpm scopes (least remaining); reset
      -- is the time until the oldest counted bucket leaves the window (0:
      -- window empty).
      local h = { 0, 0, 0, 0, 0, 0 }
      for i = 1, n do
        local s = st[i]
        local c = s.c
        if s.rpm > 0 then
          local rem = math.max(s.rpm - c.rtotal, 0)
          if h[1] == 0 or rem < h[2] then
            h[1], h[2] = s.rpm, rem
            h[3] = 0
            if c.rold then h[3] = (c.rold + nb + 1) * bms - now end
          end
        end
        if s.tpm > 0 then
          local rem = math.max(s.tpm - c.ttotal, 0)
          if h[4] == 0 or rem < h[5] then
            h[4], h[5] = s.tpm, rem
            h[6] = 0
            if c.told then h[6] = (c.told + nb + 1) * bms - now end
          end
        end
      end
      if rej then
        res = { 0, epoch, rej[1], rej[2], rej[3], rej[4], rej[5], rej[6], h[1], h[2], h[3], h[4], h[5], h[6], rej[7], pt }
      else
        res = { 1, epoch, 0, 0, 0, 0, 0, 0, h[1], h[2], h[3], h[4], h[5], h[6], 0, pt }
      end
    end
  end
  out[#out + 1] = #res
  for _, x in ipairs(res) do out[#out + 1] = x end
end

-- Write back each scope once.
for s, c in pairs(cache) do
  local hk = shkey(s)
  local set = c.set
  if c.radd > 0 then
    set[#set + 1] = 'r' .. cur
    set[#set + 1] = c.rcur
    set[#set + 1] = 'rt'
    set[#set + 1] = c.rtotal
    if c.rnewold then
      set[#set + 1] = 'ro'
      set[#set + 1] = cur
    end
  end
  if c.kadd > 0 then
    set[#set + 1] = 'k' .. cur
    set[#set + 1] = c.tcur
    set[#set + 1] = 'kt'
    set[#set + 1] = c.ttotal
    if c.tnewold then
      set[#set + 1] = 'ko'
      set[#set + 1] = cur
    end
  end
  if c.bdirty then
    set[#set + 1] = 'bw'
    set[#set + 1] = c.bw
    set[#set + 1] = 'bs'
    set[#set + 1] = c.bs
  end
  if c.bh then
    set[#set + 1] = 'bh'
    set[#set + 1] = c.bh
  end
  if c.pdirty then
    set[#set + 1] = 'pt'
    set[#set + 1] = c.pt
  end
  if c.lxpush then
    set[#set + 1] = 'lx'
    set[#set + 1] = now + 3 * lease_ttl
  end
  if c.created and c.has_rate then
    set[#set + 1] = '_'
    set[#set + 1] = HASHTABLE_PAD
  end
  if #set > 0 then redis.call('HSET', hk, unpack(set)) end
  if c.bwend then
    -- A window started by the batch: the state lives until an hour after it.
    redis.call('EXPIREAT', hk, c.bwend + 3600)
  end
  if c.created then state_expiry(hk, c.has_budget, c.wend, c.has_rate, rate_ttl, lease_ttl) end
  if #c.leases > 0 then
    local pk = szkey(s)
    redis.call('ZADD', pk, unpack(c.leases))
    if c.lxpush then redis.call('PEXPIRE', pk, 3 * lease_ttl) end
  end
end
if #index > 0 then
  local ik = KEYS[#KEYS]
  redis.call('ZADD', ik, unpack(index))
  redis.call('PEXPIRE', ik, record_ttl)
end
return out
