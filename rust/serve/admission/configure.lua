local cfg = cjson.decode(ARGV[1])
local pk = P..':quota'
redis.call('HSET', pk, 'tokens_per_s', f(cfg.tokens_per_s), 'kv_bytes', f(cfg.kv_bytes),
  'concurrency', f(cfg.concurrency), 'kv_per_token', f(cfg.kv_bytes_per_token),
  'window_s', f(cfg.window_s), 'lease_s', f(cfg.lease_s),
  'window_entries', cfg.window_entries, 'void_markers', cfg.void_markers)
local k = cfg.constants
redis.call('HSET', pk, 'alpha_slo', f(k.alpha_slo), 'alpha_burst', f(k.alpha_burst),
  'alpha_debt', f(k.alpha_debt), 'gamma_debt', f(k.gamma_debt),
  'gamma_burst', f(k.gamma_burst), 'gamma_latency', f(k.gamma_latency),
  'min_retry', f(k.min_retry))
redis.call('HSETNX', pk, 'in_flight', 0)
redis.call('HSETNX', pk, 'kv_in_flight', 0)
redis.call('SET', P..':seq', ARGV[2], 'NX')
for _, e in ipairs(cfg.entitlements) do
  local ek = P..':e:'..e.name
  redis.call('SADD', P..':ents', e.name)
  redis.call('HSET', ek, 'weight', f(e.weight), 'burstable', e.burstable,
    'baseline', e.baseline, 'slo', f(e.slo_target_ms), 'tps', f(e.tokens_per_s),
    'kv', f(e.kv_bytes), 'conc', f(e.concurrency))
  redis.call('HSETNX', ek, 'state', e.state)
  redis.call('HSETNX', ek, 'served_rate', f(e.tokens_per_s))
  for _, k in ipairs({'served_at', 'latency'}) do redis.call('HSETNX', ek, k, '') end
  for _, k in ipairs({'debt', 'burst', 'tokens_in_flight', 'kv_in_flight', 'window_tokens'}) do
    redis.call('HSETNX', ek, k, 0)
  end
end
refresh(quota_get())
return 1
