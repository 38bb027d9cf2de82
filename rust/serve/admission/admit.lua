local quota = quota_get()
if not quota then return {'unconfigured'} end
local ent, tokens = ARGV[1], tonumber(ARGV[2])
local now = tick(quota, tonumber(ARGV[3]))
if purge(now) > 0 then quota = quota_get() end
local ek = P..':e:'..ent
local e = redis.call('HMGET', ek, 'state', 'conc', 'tps', 'burstable', 'priority',
  'window_tokens')
if not e[1] then return {'401', 'unknown-entitlement', '', '', '0'} end
local w = e[5]
local rid = ARGV[4]
local again = redis.call('HGET', P..':rid', rid)
if again then return {'200', 'admitted', '', again, w} end -- a client retry: same ticket
if redis.call('ZSCORE', P..':void', rid) then return {'void'} end -- its client gave up
if e[1] ~= 'bound' then return {'403', e[1], '', '', w} end
local kv = tokens * quota.kvpt
local quota_room = quota.in_flight < quota.conc and quota.kv_in_flight + kv <= quota.kv
local may_burst = quota_room and e[4] == '1'
if redis.call('ZCARD', ek..':fl') >= tonumber(e[2]) and not may_burst then
  local retry = 1 / completion_rate(ek, quota)
  return {'429', 'concurrency', f(math.max(retry, quota.min_retry)), '', w}
end
local wt = expire(ek, tonumber(e[6]), now, quota)
local limit = tonumber(e[3]) * quota.window
local excess = wt + tokens - limit
if excess > 0 and not may_burst then
  if tokens > limit then return {'413', 'exceeds-token-budget', '', '', w} end
  local charges = redis.call('ZRANGE', ek..':win', 0, -1, 'WITHSCORES')
  local freed, at = 0, now
  for k = 1, #charges, 2 do
    freed = freed + tonumber(redis.call('HGET', ek..':wtok', charges[k]))
    if freed >= excess then at = tonumber(charges[k + 1]); break end
  end
  return {'429', 'token-budget', f(math.max(at + quota.window - now, quota.min_retry)), '', w}
end
if not quota_room then
  local lowest, rate = math.huge, 0
  for _, name in ipairs(redis.call('SMEMBERS', P..':ents')) do
    local ok = P..':e:'..name
    local r = completion_rate(ok, quota)
    if r > 0 then
      lowest = math.min(lowest, tonumber(redis.call('HGET', ok, 'priority')))
      rate = rate + r
    end
  end
  if tonumber(w) <= lowest then
    local retry = ''
    if rate > 0 then retry = f(math.max(1 / rate, quota.min_retry)) end
    return {'429', 'quota-contention', retry, '', w}
  end
end
local seq = string.format('%d', redis.call('INCR', P..':seq'))
redis.call('HSET', P..':tickets', seq, string.format('%d|%d|', kv, tokens)..ent)
redis.call('HSET', P..':rid', seq, rid, rid, seq)
redis.call('ZADD', P..':leases', f(now + quota.lease), seq)
redis.call('ZADD', ek..':fl', f(now), seq)
charge(ek, seq, tokens, now, quota)
redis.call('HINCRBY', ek, 'window_tokens', tokens)
redis.call('HINCRBY', ek, 'tokens_in_flight', tokens)
redis.call('HINCRBY', P..':quota', 'in_flight', 1)
if kv > 0 then
  redis.call('HINCRBY', ek, 'kv_in_flight', string.format('%d', kv))
  redis.call('HINCRBY', P..':quota', 'kv_in_flight', string.format('%d', kv))
end
return {'200', 'admitted', '', seq, w}
