--[[ reschedule: move one waiting job to a new due time.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead,
KEYS[6] schedules, KEYS[7] history (one shard; see sched_put.lua)

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
local marker = tonumber(redis.call('GET', KEYS[4]))
if marker == nil or due < marker then
  redis.call('SET', KEYS[4], ARGV[2])
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. ':' .. ARGV[2])
end
return 1
