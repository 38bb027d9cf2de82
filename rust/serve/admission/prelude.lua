-- Shared by every admission script (rust/serve/admission/*.lua). KEYS[1] is
-- the quota's key prefix. The constants of rust/admission.rs (equation 1's
-- alphas, the EWMA decays, the shortest Retry-After), the service-class
-- table and the bounds on what the scripts keep (window entries per
-- entitlement, void markers) come from Rust through the configure script's
-- JSON into the quota hash.
local P = KEYS[1]
local function f(x) return string.format('%.17g', x) end
local function quota_get()
  local v = redis.call('HMGET', P..':quota', 'tokens_per_s', 'kv_bytes', 'concurrency',
    'kv_per_token', 'mean_slo', 'window_s', 'lease_s', 'in_flight', 'kv_in_flight', 'clock',
    'alpha_slo', 'alpha_burst', 'alpha_debt', 'gamma_debt', 'gamma_burst', 'gamma_latency',
    'min_retry', 'window_entries', 'void_markers')
  if not v[17] then return nil end -- written by the configure script only, last
  return {tps = tonumber(v[1]), kv = tonumber(v[2]), conc = tonumber(v[3]),
    kvpt = tonumber(v[4]), mean = tonumber(v[5]), window = tonumber(v[6]),
    lease = tonumber(v[7]), in_flight = tonumber(v[8]), kv_in_flight = tonumber(v[9]),
    clock = tonumber(v[10]), alpha_slo = tonumber(v[11]), alpha_burst = tonumber(v[12]),
    alpha_debt = tonumber(v[13]), gamma_debt = tonumber(v[14]), gamma_burst = tonumber(v[15]),
    gamma_latency = tonumber(v[16]), min_retry = tonumber(v[17]),
    window_entries = tonumber(v[18]) or math.huge, void_markers = tonumber(v[19]) or math.huge}
end
local function tick(quota, now)
  if quota.clock and quota.clock >= now then return quota.clock end
  redis.call('HSET', P..':quota', 'clock', f(now))
  return now
end
local function weight(quota, e, mean)
  return tonumber(e.weight) / (1 + quota.alpha_slo * tonumber(e.slo) / mean)
    / (1 + quota.alpha_burst * tonumber(e.burst)) * (1 + quota.alpha_debt * tonumber(e.debt))
end
-- Releases ticket `seq`: its entitlement and estimate, nil if not held.
local function release(seq)
  local info = redis.call('HGET', P..':tickets', seq)
  if not info then return nil end
  local kv, tokens, ent = string.match(info, '^(%d+)|(%d+)|(.*)$')
  local ek = P..':e:'..ent
  redis.call('HDEL', P..':tickets', seq)
  local rid = redis.call('HGET', P..':rid', seq)
  if rid then redis.call('HDEL', P..':rid', seq, rid) end
  redis.call('ZREM', P..':leases', seq)
  redis.call('ZREM', ek..':fl', seq)
  redis.call('HINCRBY', P..':quota', 'in_flight', -1)
  redis.call('HINCRBY', ek, 'tokens_in_flight', '-'..tokens)
  if kv ~= '0' then
    redis.call('HINCRBY', ek, 'kv_in_flight', '-'..kv)
    redis.call('HINCRBY', P..':quota', 'kv_in_flight', '-'..kv)
  end
  return ent, tokens
end
local function purge(now)
  redis.call('ZREMRANGEBYSCORE', P..':void', '-inf', f(now))
  local dead = redis.call('ZRANGEBYSCORE', P..':leases', '-inf', f(now))
  for _, seq in ipairs(dead) do release(seq) end
  return #dead
end
-- Drops the window charges of entitlement `ek` older than the window; `wt`:
-- its window_tokens. Returns the tokens left in the window.
local function expire(ek, wt, now, quota)
  local old = redis.call('ZRANGEBYSCORE', ek..':win', '-inf', f(now - quota.window))
  for _, s in ipairs(old) do
    wt = wt - tonumber(redis.call('HGET', ek..':wtok', s))
    redis.call('HDEL', ek..':wtok', s)
    redis.call('ZREM', ek..':win', s)
  end
  if #old > 0 then redis.call('HSET', ek, 'window_tokens', wt) end
  return wt
end
-- Charges `tokens` to entitlement `ek`'s window at `now` under ticket `seq`.
-- Its entries stay within quota.window_entries (n): from n/2 of them on, a
-- charge made less than window / (n - n/2) after the newest entry joins it
-- (and leaves the window that much early at most), so the entries past the
-- first n/2 are that far apart and at most n - n/2 fit in one window.
local function charge(ek, seq, tokens, now, quota)
  local n = quota.window_entries
  local half = math.floor(n / 2)
  if redis.call('ZCARD', ek..':win') >= half then
    local newest = redis.call('ZRANGE', ek..':win', -1, -1, 'WITHSCORES')
    if newest[1] and now - tonumber(newest[2]) < quota.window / (n - half) then
      redis.call('HINCRBY', ek..':wtok', newest[1], tokens)
      return
    end
  end
  redis.call('ZADD', ek..':win', f(now), seq)
  redis.call('HSET', ek..':wtok', seq, tokens)
end
-- Takes `tokens` (a ticket's estimate, `delta` from it: its real use) off or
-- onto the window charge of ticket `seq`, if the charge is still its own entry
-- (one that others joined keeps theirs). Returns whether it was there.
local function recharge(ek, seq, delta)
  if redis.call('HEXISTS', ek..':wtok', seq) == 0 then return false end
  redis.call('HINCRBY', ek..':wtok', seq, delta)
  redis.call('HINCRBY', ek, 'window_tokens', delta)
  return true
end
local function completion_rate(ek, quota)
  local n = redis.call('ZCARD', ek..':fl')
  if n == 0 then return 0 end
  local v = redis.call('HMGET', ek, 'latency', 'tokens_in_flight')
  local latency
  if v[1] ~= '' then latency = tonumber(v[1])
  else latency = tonumber(v[2]) / n / (quota.tps / quota.conc) end
  return n / math.max(latency, quota.min_retry)
end
local function refresh(quota)
  local names = redis.call('SMEMBERS', P..':ents')
  table.sort(names)
  local sum, n = 0, 0
  for _, name in ipairs(names) do
    local v = redis.call('HMGET', P..':e:'..name, 'state', 'slo')
    if v[1] == 'bound' then sum = sum + tonumber(v[2]); n = n + 1 end
  end
  local mean = 1
  if n > 0 then mean = sum / n end
  redis.call('HSET', P..':quota', 'mean_slo', f(mean))
  for _, name in ipairs(names) do
    local ek = P..':e:'..name
    local v = redis.call('HMGET', ek, 'weight', 'slo', 'burst', 'debt')
    local w = weight(quota, {weight = v[1], slo = v[2], burst = v[3], debt = v[4]}, mean)
    redis.call('HSET', ek, 'priority', f(w))
  end
end
