--[[ get: read one job (or dead letter) by id without changing anything.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead,
KEYS[6] schedules, KEYS[7] history (one shard; see sched_put.lua)

ARGV[1] job id

Returns
  nil                                           no such job
  {"job", envelope, due ms, tries, lease until}  a stored job; tries is 0 and
      lease until is -1 unless a beat holds it (lease until is then the ms at
      which the lease expires, and due ms is the original due time; for a lease
      entry that does not read, due ms is the score and tries 0)
  {"dead", record}                               a dead-lettered job
]]
local id = ARGV[1]
local envelope = redis.call('HGET', KEYS[2], id)
if envelope then
  local score = tonumber(redis.call('ZSCORE', KEYS[1], id))
  local lease = redis.call('HGET', KEYS[3], id)
  if lease then
    local d, n = string.match(lease, '^(-?%d+)|(%d+)|')
    if d and n then
      return {'job', envelope, tonumber(d), tonumber(n), score}
    end
    return {'job', envelope, score, 0, score}
  end
  return {'job', envelope, score, 0, -1}
end
local record = redis.call('HGET', KEYS[5], id)
if record then
  return {'dead', record}
end
return nil
