local quota = quota_get()
if not quota then return 0 end
local now = tick(quota, tonumber(ARGV[1]))
purge(now)
for _, name in ipairs(redis.call('SMEMBERS', P..':ents')) do
  local ek = P..':e:'..name
  local wt = redis.call('HGET', ek, 'window_tokens')
  if wt then expire(ek, tonumber(wt), now, quota) end
end
return 1
