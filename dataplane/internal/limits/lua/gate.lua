-- gate.lua: a model group's prefill isolation gate (docs/traffic.md,
-- "Prefill isolation"). Fleet-wide and atomic: every proxy's prefill
-- entries of the group live in one sorted set on the group's own hash tag,
-- so the check across the group's deployments is one script call on one
-- Redis Cluster slot. (The deployments' lease keys carry one hash tag per
-- deployment, so the check cannot live in the lease script.)
--
-- KEYS[1]: the group's entries (zset): member '<kind>|<deployment>|<request>'
--          scored by its expiry (ms). kind 'a': agent or batch prefill,
--          'i': interactive prefill.
-- KEYS[2]: the group's busy periods (hash): deployment → start (ms) of
--          its current run of agent prefill.
-- ARGV[1]: op: 'enter' | 'place' | 'renew' | 'leave'
-- ARGV[2]: entry TTL (ms): an entry not renewed within it expires (a lost
--          proxy's entries stop counting one TTL after its last renewal).
-- ARGV[3]: member (renew, leave) or request id (enter, place).
-- enter (an agent or batch request's prefill on one deployment):
--   ARGV[4] deployment, ARGV[5] most deployments with agent prefill at once
--   (N − K), ARGV[6] join window (ms; 0: none): a deployment whose run of
--   agent prefill began longer ago takes no more agent prefill until the
--   run ends (the other deployments get their turn).
--   Returns {1} entered, or {0, reason}: 1 the deployment has interactive
--   prefill in flight, 2 N − K other deployments have agent prefill in
--   flight, 3 the deployment's run is older than the join window.
-- place (an interactive request): ARGV[4] n, ARGV[5..4+n] the candidate
--   deployments in order. Registers the request's interactive prefill on
--   the first candidate without agent prefill in flight (else the first)
--   and returns {index (1-based), 1 if it has none else 0}.
-- renew: returns {1} when the entry was live (its expiry moved), else {0}
--   (an expired entry is not revived: others may have relied on its end).
-- leave: returns {removed (0 or 1)}.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
local ttl = tonumber(ARGV[2])
local ek, sk = KEYS[1], KEYS[2]

if op == 'renew' then
  local exp = redis.call('ZSCORE', ek, ARGV[3])
  if exp and tonumber(exp) > now then
    redis.call('ZADD', ek, now + ttl, ARGV[3])
    redis.call('PEXPIRE', ek, ttl)
    redis.call('PEXPIRE', sk, ttl)
    return {1}
  end
  return {0}
end
if op == 'leave' then
  return {redis.call('ZREM', ek, ARGV[3])}
end

-- Live entries (expired ones pruned), by deployment and kind.
redis.call('ZREMRANGEBYSCORE', ek, '-inf', now)
local agent, inter, nagent = {}, {}, 0
for _, m in ipairs(redis.call('ZRANGE', ek, 0, -1)) do
  local p = string.find(m, '|', 3, true)
  if p then
    local kind, dep = string.sub(m, 1, 1), string.sub(m, 3, p - 1)
    if kind == 'a' then
      if not agent[dep] then nagent = nagent + 1 end
      agent[dep] = true
    else
      inter[dep] = true
    end
  end
end
-- A run of agent prefill ends when its deployment has none left.
local runs = redis.call('HGETALL', sk)
local since = {}
for i = 1, #runs, 2 do
  if agent[runs[i]] then
    since[runs[i]] = tonumber(runs[i + 1])
  else
    redis.call('HDEL', sk, runs[i])
  end
end

local function add(kind, dep)
  redis.call('ZADD', ek, now + ttl, kind .. '|' .. dep .. '|' .. ARGV[3])
  redis.call('PEXPIRE', ek, ttl)
end

if op == 'enter' then
  local dep, most, window = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  if inter[dep] then
    return {0, 1}
  end
  if agent[dep] then
    if not since[dep] then
      redis.call('HSET', sk, dep, now)
    elseif window > 0 and now - since[dep] >= window then
      return {0, 3}
    end
  elseif nagent >= most then
    return {0, 2}
  else
    redis.call('HSET', sk, dep, now)
  end
  add('a', dep)
  redis.call('PEXPIRE', sk, ttl)
  return {1}
end

if op == 'place' then
  local n = tonumber(ARGV[4])
  local pick, free = 1, 0
  for i = 1, n do
    if not agent[ARGV[4 + i]] then
      pick, free = i, 1
      break
    end
  end
  add('i', ARGV[4 + pick])
  return {pick, free}
end
return redis.error_reply('gate: unknown op ' .. tostring(op))
