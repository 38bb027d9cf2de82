local pool = pool_get()
if not pool or redis.call('EXISTS', P..':e:'..ARGV[1]) == 0 then return 0 end
redis.call('HSET', P..':e:'..ARGV[1], 'state', ARGV[2])
refresh(pool)
return 1
