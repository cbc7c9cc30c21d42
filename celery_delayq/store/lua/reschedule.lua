--[[ reschedule: move one waiting job to a new due time.

KEYS[1] due        the job's new due time
KEYS[2] jobs       read (is it stored?)
KEYS[3] leases     read (does a beat hold it?)
KEYS[4] wake       lowered (with a wake message) when the new due time is before it
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] job id
ARGV[2] new due time in ms
ARGV[3] wake channel
ARGV[4] shard index, echoed in the wake message

Returns
  0  no such job
  1  moved
  2  refused: a beat holds the job (it is being delivered now); moving it
     would deliver it twice
Moving a job earlier than the wake marker wakes a sleeping beat, as enqueue does.
A due time that is not a whole number of ms is refused with an error; nothing is written.
]]
--!include args
--!include wake
local id = ARGV[1]
local due = int_arg(2)
if due == nil then
  return redis.error_reply('delayq reschedule: due time is not a whole number of ms: ' .. tostring(ARGV[2]))
end
if redis.call('HEXISTS', KEYS[2], id) == 0 then
  return 0
end
if redis.call('HEXISTS', KEYS[3], id) == 1 then
  return 2
end
redis.call('ZADD', KEYS[1], due, id)
wake(ARGV[3], ARGV[4], due, ARGV[2])
return 1
