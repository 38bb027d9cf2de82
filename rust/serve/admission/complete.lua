local quota = quota_get()
if not quota then return 0 end
local seq, actual, latency = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local info = redis.call('HGET', P..':tickets', seq)
if not info then return 0 end
local now = tick(quota, tonumber(ARGV[4]))
purge(now)
if redis.call('HEXISTS', P..':tickets', seq) == 0 then return 0 end
local est, ent = string.match(info, '^%d+|(%d+)|(.*)$')
local ek = P..':e:'..ent
if latency < 0 then -- never served (flow control's queue): give back, learn nothing
  recharge(ek, seq, -tonumber(est))
  release(seq)
  return 1
end
local v = redis.call('HMGET', ek, 'served_rate', 'served_at', 'tps', 'kv', 'conc', 'debt',
  'burst', 'latency', 'baseline', 'weight', 'slo', 'kv_in_flight')
local tps = tonumber(v[3])
local decay = 1
if v[2] ~= '' then decay = math.exp(-(now - tonumber(v[2])) / quota.window) end
local rate = tonumber(v[1]) * decay + actual / quota.window
local function over(used, base) return math.max(used / base - 1, 0) end
local delta = over(rate, tps) + over(tonumber(v[12]), tonumber(v[4]))
  + over(redis.call('ZCARD', ek..':fl'), tonumber(v[5]))
local burst = quota.gamma_burst * tonumber(v[7]) + (1 - quota.gamma_burst) * delta
local debt = tonumber(v[6])
if v[9] == '1' then
  debt = quota.gamma_debt * debt + (1 - quota.gamma_debt) * (tps - rate) / tps
end
if v[8] ~= '' then
  latency = quota.gamma_latency * tonumber(v[8]) + (1 - quota.gamma_latency) * latency
end
recharge(ek, seq, actual - tonumber(est)) -- the window counts what it used
release(seq)
local w = weight(quota, {weight = v[10], slo = v[11], burst = burst, debt = debt}, quota.mean)
redis.call('HSET', ek, 'served_rate', f(rate), 'served_at', f(now), 'burst', f(burst),
  'debt', f(debt), 'latency', f(latency), 'priority', f(w))
return 1
