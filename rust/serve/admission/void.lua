local quota = quota_get()
if not quota then return 0 end
local now = tick(quota, tonumber(ARGV[1]))
local undone = 0
for k = 2, #ARGV do
  local rid = ARGV[k]
  local seq = redis.call('HGET', P..':rid', rid)
  local ent, tokens
  if seq then ent, tokens = release(seq) end
  if ent then -- reserved: undo it, window charge included, as if never admitted
    local ek = P..':e:'..ent
    if recharge(ek, seq, -tonumber(tokens))
      and tonumber(redis.call('HGET', ek..':wtok', seq)) == 0 then
      redis.call('HDEL', ek..':wtok', seq)
      redis.call('ZREM', ek..':win', seq)
    end
    undone = undone + 1
  else -- not (yet) reserved: a script still queued in Redis must not reserve it
    redis.call('ZADD', P..':void', f(now + quota.lease), rid)
  end
end
-- At most void_markers: the oldest go first (a script that late meets its lease).
local extra = redis.call('ZCARD', P..':void') - quota.void_markers
if extra > 0 then redis.call('ZPOPMIN', P..':void', extra) end
return undone
