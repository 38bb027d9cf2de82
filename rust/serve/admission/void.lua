local quota = quota_get()
if not quota then return 0 end
local now = tick(quota, tonumber(ARGV[1]))
local undone = 0
for k = 2, #ARGV do
  local rid = ARGV[k]
  local seq = redis.call('HGET', P..':rid', rid)
  local ent = seq and release(seq)
  if ent then -- reserved: undo it, window charge included, as if never admitted
    local ek = P..':e:'..ent
    local tokens = redis.call('HGET', ek..':wtok', seq)
    if tokens then
      redis.call('HDEL', ek..':wtok', seq)
      redis.call('ZREM', ek..':win', seq)
      redis.call('HINCRBY', ek, 'window_tokens', '-'..tokens)
    end
    undone = undone + 1
  else -- not (yet) reserved: a script still queued in Redis must not reserve it
    redis.call('ZADD', P..':void', f(now + quota.lease), rid)
  end
end
return undone
