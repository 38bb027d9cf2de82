local quota = quota_get()
if not quota or redis.call('EXISTS', P..':e:'..ARGV[1]) == 0 then return 0 end
redis.call('HSET', P..':e:'..ARGV[1], 'state', ARGV[2])
refresh(quota)
return 1
