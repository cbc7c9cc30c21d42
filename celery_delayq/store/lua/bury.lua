#!lua flags=allow-oom
--[[ bury: move a claimed job that cannot be delivered to the dead-letter hash.

KEYS[1] due        the job's member, removed
KEYS[2] jobs       the job's envelope, removed
KEYS[3] leases     read (the caller's?), then removed
KEYS[5] dead       the record is stored under the job id
KEYS[4] wake, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the lease token the caller claimed with
ARGV[2] job id
ARGV[3] dead-letter record (JSON built by the caller: reason, envelope, times)

Only the current lease holder may bury a job, as with ack.

Returns 1 moved to the dead-letter hash, 0 the caller no longer holds the
lease (nothing changed).
Runs when Redis is over maxmemory; its first write is a ZREM, which Redis 6.2 (no script
flags) never refuses when full.
]]
--!include lease
--!include job
if #ARGV ~= 3 then
  return redis.error_reply('delayq bury: takes a token, a job id and a record')
end
local id = ARGV[2]
if not held(id, ARGV[1]) then
  return 0
end
remove_job(id)
redis.call('HSET', KEYS[5], id, ARGV[3])
return 1
