-- slicerec.lua: write or renew the record of a request admitted entirely
-- from quota slices (slices.go; docs/limits.md, "Quota slices") once it has
-- lived a renew interval, so that if its data plane dies a sweeper
-- publishes its usage event (settle.lua in sweep mode). The record names
-- no scope: what the request reserved is in its data plane's slices, which
-- stay charged in full when that data plane is lost, so a sweep charges
-- nothing; settling the request (settle.lua, no scope) leaves the usual
-- tombstone.
--
-- KEYS: 1 the org's epoch, 2 the request record, 3 the org's lease index
-- ARGV: 1 request id, 2 lease TTL ms, 3 record TTL ms, 4 bucket ms,
--   5 the request's report (common.lua)
-- Returns {state}: 1 written, 0 already settled, 3 already swept.

local now = now_ms()
local raw = redis.call('GET', KEYS[2])
if raw == 'done' then return { 0 } end
if raw == 'swept' then return { 3 } end
local b = math.floor(now / tonumber(ARGV[4]))
redis.call('SET', KEYS[2], '0 0 ' .. b .. '\n' .. ARGV[5], 'PX', tonumber(ARGV[3]))
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[3]))
return { 1 }
