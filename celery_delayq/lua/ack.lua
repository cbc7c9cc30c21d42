#!lua flags=allow-oom
--[[ ack: remove delivered jobs, each only while it still holds the caller's lease.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead,
KEYS[6] schedules, KEYS[7] history (one shard; see sched_put.lua)

ARGV[1] token: the lease token the caller claimed with
ARGV[2..] job ids

A job that was re-claimed by another beat (its lease expired), rescheduled,
replaced or cancelled since no longer holds this token and is left alone, so a
stale claimer never deletes work it does not own.

Returns an array with one entry per id in ARGV order: 1 removed, 0 left alone.
Runs when Redis is over maxmemory: it only deletes.
]]
local suffix = '|' .. ARGV[1]
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local lease = redis.call('HGET', KEYS[3], id)
  if lease and string.sub(lease, -#suffix) == suffix then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
