-- renew.lua: extend the leases of a live request, or re-assert its whole
-- admission after the org's Redis state was lost.
--
-- KEYS: layout of common.lua (epoch, record, then 2 keys per scope, then
--   the org's lease index).
-- ARGV:
--   1 request id   2 estimated tokens   3 reserved cost (micro-USD)
--   4 lease TTL ms 5 record TTL ms      6 rate window ms   7 bucket ms
--   8 number of scopes n
--   then 4 values per scope i (base 8 + 4(i-1)):
--     has tpm (0/1), has parallel (0/1), budget unit ('-' = none),
--     budget n
--   then (9 + 4n) indexed (0/1: the request is in the lease index; its
--     entry is pushed forward like its leases), (10 + 4n) the request's
--     report (common.lua; '' = keep the one the record holds): it replaces
--     the record's report, so a sweeper charges the latest usage.
--   then (11 + 4n) the scope that accounts the request's prefill (1-based;
--     0 = none) and (12 + 4n) the request's contribution to set there (0
--     once it produced its first token; common.lua, prefill_set): every
--     renewal asserts it, so a lost update is repaired by the next one.
-- Returns {state, epoch}: state 0 = already settled (nothing done),
--   1 = renewed (lease expiries and the record TTL pushed forward),
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

local now = now_ms()
local rid = ARGV[1]
local est = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local lease_ttl = tonumber(ARGV[4])
local record_ttl = tonumber(ARGV[5])
local window_ms = tonumber(ARGV[6])
local bms = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local cur = math.floor(now / bms)
local now_s = math.floor(now / 1000)
local rate_ttl = window_ms + 2 * bms

-- The epoch and the record in one read (ensure_epoch's GET folded in).
local heads = redis.call('MGET', KEYS[1], KEYS[2])
local epoch = tonumber(heads[1])
if not epoch then
  redis.call('SET', KEYS[1], now)
  epoch = now
end
local rec = record_parse(heads[2] or nil)
if rec and rec.swept then
  return { 3, epoch }
end
if rec and rec.done then
  return { 0, epoch }
end
local indexed = ARGV[9 + 4 * n] == '1'
local note = ARGV[10 + 4 * n] or ''
if indexed then
  local ik = KEYS[3 + 2 * n]
  redis.call('ZADD', ik, now + lease_ttl, rid)
  redis.call('PEXPIRE', ik, record_ttl)
end
local reassert = rec == nil
local pfi = tonumber(ARGV[11 + 4 * n]) or 0
if pfi > 0 then
  prefill_set(hkey(pfi), rid, tonumber(ARGV[12 + 4 * n]) or 0, lease_ttl)
end
local newrec = { est, cost, cur }
for i = 1, n do
  local a = 8 + 4 * (i - 1)
  if ARGV[a + 2] == '1' then
    -- Three lease TTLs, as admit.lua: an expiry never earlier than the
    -- one its 'lx' promises.
    local pk = zkey(i)
    redis.call('ZADD', pk, now + lease_ttl, rid)
    redis.call('PEXPIRE', pk, 3 * lease_ttl)
  end
  if reassert then
    local unit = ARGV[a + 3]
    local has_tpm = ARGV[a + 1] == '1' and est > 0
    if has_tpm or unit ~= '-' then
      local hk = hkey(i)
      local v = redis.call('HMGET', hk, 'kt', 'ko', 'k' .. cur, 'bw', 'bs', 'bp', 'bpw')
      local set, del, created = {}, {}, false
      if has_tpm then created = win_apply(set, del, 'k', cur, est, v[3], v[1], v[2]) end
      local we = 0
      if unit ~= '-' then
        local bn = tonumber(ARGV[a + 4])
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
  redis.call('SET', KEYS[2], head, 'PX', record_ttl)
  return { 2, epoch }
end
if note ~= '' then
  redis.call('SET', KEYS[2], rec.head .. '\n' .. note, 'PX', record_ttl)
else
  redis.call('PEXPIRE', KEYS[2], record_ttl)
end
return { 1, epoch }
