-- renew.lua: extend the leases of a batch of live requests of one org, or
-- re-assert a request's whole admission after the org's Redis state was
-- lost. The leases of a scope the batch shares are pushed with one ZADD,
-- and the lease set's expiry with one PEXPIRE, whatever the batch size.
--
-- KEYS: 1 the org's epoch; 2 .. R+1 the requests' records; then 2 keys per
--   distinct scope s (R+2+2(s-1): state hash, R+3+2(s-1): leases), see
--   common.lua; then, when a request of the batch is in it, the org's lease
--   index (last).
-- ARGV:
--   1 lease TTL ms   2 record TTL ms   3 rate window ms   4 bucket ms
--   5 number of requests R
--   then per request: request id, estimated tokens, reserved cost
--     (micro-USD), indexed (0/1: the request is in the lease index; its
--     entry is pushed forward like its leases), its report (common.lua;
--     '' = keep the one the record holds: it replaces the record's
--     report, so a sweeper charges the latest usage), the scope that
--     accounts its prefill (1-based among its scopes; 0 = none) and its
--     contribution to set there (0 once it produced its first token;
--     common.lua, prefill_set: every renewal asserts it, so a lost update
--     is repaired by the next one), number of its scopes k, then 5 values
--     per scope: distinct scope index s (1-based), has tpm (0/1), has
--     parallel (0/1), budget unit ('-' = none), budget n.
-- Returns {epoch, then per request its state}: 0 = already settled (nothing
--   done), 1 = renewed (lease expiries and the record TTL pushed forward),
--   2 = re-asserted: the record was missing (Redis lost the org's state or
--       the record expired), so the leases, the token estimate and the cost
--       reservation were written again without checking limits: the request
--       is already running. A budget window that is missing is not started
--       here (only a seed from the ledger starts one): the reservation
--       waits in 'bp' and seed.lua adds it to the seed. The report is
--       written after the re-asserted line, as admit.lua does.
--   3 = swept: a sweeper settled the request after its lease expired
--       (nothing done; the caller should stop the request: its leases and
--       reservation are gone).
-- A request id repeated in the batch is renewed once (its later entries
-- answer 1).
--
-- Cost: one TIME and one MGET (epoch and records) per call; per distinct
-- scope with leases, one ZADD and one PEXPIRE per call; per request, one
-- PEXPIRE of its record (a SET when its report changed); the lease index,
-- one ZADD and one PEXPIRE per call.

local now = now_ms()
local lease_ttl = tonumber(ARGV[1])
local record_ttl = tonumber(ARGV[2])
local window_ms = tonumber(ARGV[3])
local bms = tonumber(ARGV[4])
local nreq = tonumber(ARGV[5])
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

local out = { epoch }
local leases = {} -- distinct scope -> ZADD pairs
local order = {}  -- distinct scopes with leases, in order of first use
local index = {}  -- ZADD pairs of the lease index
local seen = {}
local exp = now + lease_ttl
local a = 5
for r = 1, nreq do
  local rid, est, cost = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local indexed, note = ARGV[a + 4] == '1', ARGV[a + 5] or ''
  local pfi, pfv = tonumber(ARGV[a + 6]) or 0, tonumber(ARGV[a + 7]) or 0
  local k = tonumber(ARGV[a + 8])
  local sa = a + 8
  a = sa + 5 * k
  local rec = record_parse(heads[r + 1] or nil)
  local state
  if seen[rid] then
    state = 1
  elseif rec and rec.swept then
    state = 3
  elseif rec and rec.done then
    state = 0
  else
    seen[rid] = true
    if indexed then
      index[#index + 1] = exp
      index[#index + 1] = rid
    end
    if pfi > 0 then
      prefill_set(shkey(tonumber(ARGV[sa + 5 * (pfi - 1) + 1])), rid, pfv, lease_ttl)
    end
    local reassert = rec == nil
    local newrec = { est, cost, cur }
    for i = 1, k do
      local b = sa + 5 * (i - 1)
      local s = tonumber(ARGV[b + 1])
      if ARGV[b + 3] == '1' then
        local zl = leases[s]
        if not zl then
          zl = {}
          leases[s] = zl
          order[#order + 1] = s
        end
        zl[#zl + 1] = exp
        zl[#zl + 1] = rid
      end
      if reassert then
        local unit = ARGV[b + 4]
        local has_tpm = ARGV[b + 2] == '1' and est > 0
        if has_tpm or unit ~= '-' then
          local hk = shkey(s)
          local v = redis.call('HMGET', hk, 'kt', 'ko', 'k' .. cur, 'bw', 'bs', 'bp', 'bpw')
          local set, del, created = {}, {}, false
          if has_tpm then created = win_apply(set, del, 'k', cur, est, v[3], v[1], v[2]) end
          local we = 0
          if unit ~= '-' then
            local bn = tonumber(ARGV[b + 5])
            local idx, _, wend = budget_window(unit, bn, now_s)
            we = wend
            local id = bw_id(unit, bn, idx)
            local held = budget_held(v[4], unit, bn, idx)
            if held == 'current' then
              set[#set + 1] = 'bs'
              set[#set + 1] = (tonumber(v[5]) or 0) + cost
              newrec[#newrec + 1] = idx
            elseif held == 'older' then
              set[#set + 1] = 'bw'
              set[#set + 1] = id
              set[#set + 1] = 'bs'
              set[#set + 1] = cost
              created = true
              newrec[#newrec + 1] = idx
            else
              -- Missing: the running request is not in the ledger yet, so
              -- the seed will not count it; its reservation waits in 'bp'.
              local pend = 0
              if v[7] == id then pend = tonumber(v[6]) or 0 end
              set[#set + 1] = 'bp'
              set[#set + 1] = pend + cost
              set[#set + 1] = 'bpw'
              set[#set + 1] = id
              created = true
              newrec[#newrec + 1] = 'p' .. idx
            end
          else
            newrec[#newrec + 1] = '-'
          end
          if created and has_tpm then
            set[#set + 1] = '_'
            set[#set + 1] = HASHTABLE_PAD
          end
          if #set > 0 then redis.call('HSET', hk, unpack(set)) end
          if #del > 0 then redis.call('HDEL', hk, unpack(del)) end
          if created then state_expiry(hk, unit ~= '-', we, true, rate_ttl, lease_ttl) end
        else
          newrec[#newrec + 1] = '-'
        end
      end
    end
    if reassert then
      local head = table.concat(newrec, ' ')
      if note ~= '' then head = head .. '\n' .. note end
      redis.call('SET', KEYS[1 + r], head, 'PX', record_ttl)
      state = 2
    else
      if note ~= '' then
        redis.call('SET', KEYS[1 + r], rec.head .. '\n' .. note, 'PX', record_ttl)
      else
        redis.call('PEXPIRE', KEYS[1 + r], record_ttl)
      end
      state = 1
    end
  end
  out[#out + 1] = state
end

-- Each lease set once: three lease TTLs, as admit.lua (an expiry never
-- earlier than the one its 'lx' promises).
for _, s in ipairs(order) do
  local pk = szkey(s)
  redis.call('ZADD', pk, unpack(leases[s]))
  redis.call('PEXPIRE', pk, 3 * lease_ttl)
end
if #index > 0 then
  local ik = KEYS[#KEYS]
  redis.call('ZADD', ik, unpack(index))
  redis.call('PEXPIRE', ik, record_ttl)
end
return out
