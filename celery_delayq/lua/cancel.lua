#!lua flags=allow-oom
--[[ cancel: remove one job by id.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead,
KEYS[6] schedules, KEYS[7] history (one shard; see sched_put.lua)

ARGV[1] job id

Returns
  0  no such job
  1  removed while waiting: it will never be published
  2  removed while a beat held it: it is being delivered now and may already
     be in the broker; the holder's ack will find nothing and no beat will
     deliver it again
Runs when Redis is over maxmemory: it only deletes.
]]
local id = ARGV[1]
if redis.call('HEXISTS', KEYS[2], id) == 0 then
  return 0
end
local held = redis.call('HDEL', KEYS[3], id)
redis.call('ZREM', KEYS[1], id)
redis.call('HDEL', KEYS[2], id)
if held == 1 then
  return 2
end
return 1
