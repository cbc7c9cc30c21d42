#!lua flags=allow-oom
--[[ bury: move a claimed job that cannot be delivered to the dead-letter hash.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead,
KEYS[6] schedules, KEYS[7] history (one shard; see sched_put.lua)

ARGV[1] token: the lease token the caller claimed with
ARGV[2] job id
ARGV[3] dead-letter record (JSON built by the caller: reason, envelope, times)

Only the current lease holder may bury a job, as with ack.

Returns 1 moved to the dead-letter hash, 0 the caller no longer holds the
lease (nothing changed).
Runs when Redis is over maxmemory; its first write is a ZREM, which Redis 6.2 (no script
flags) never refuses when full.
]]
if #ARGV ~= 3 then
  return redis.error_reply('delayq bury: takes a token, a job id and a record')
end
local id = ARGV[2]
local suffix = '|' .. ARGV[1]
local lease = redis.call('HGET', KEYS[3], id)
if not lease or string.sub(lease, -#suffix) ~= suffix then
  return 0
end
redis.call('ZREM', KEYS[1], id)
redis.call('HDEL', KEYS[2], id)
redis.call('HDEL', KEYS[3], id)
redis.call('HSET', KEYS[5], id, ARGV[3])
return 1
