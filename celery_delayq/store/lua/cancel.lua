#!lua flags=allow-oom
--[[ cancel: remove one job by id.

KEYS[1] due        the job's member, removed
KEYS[2] jobs       read (is it stored?), then removed
KEYS[3] leases     removed; whether there was one is the reply (2 or 1)
KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] job id

Returns
  0  no such job
  1  removed while waiting: it will never be published
  2  removed while a beat held it: it is being delivered now and may already
     be in the broker; the holder's ack will find nothing and no beat will
     deliver it again
Runs when Redis is over maxmemory: it only deletes.
]]
--!include job
local id = ARGV[1]
if redis.call('HEXISTS', KEYS[2], id) == 0 then
  return 0
end
if remove_job(id) == 1 then
  return 2
end
return 1
