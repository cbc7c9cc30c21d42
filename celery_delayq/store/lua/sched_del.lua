--[[ sched_del: delete a recurring schedule, its run state and its waiting point.

KEYS[1] due        the schedule's waiting point, removed
KEYS[2] jobs       the waiting point's envelope, removed
KEYS[3] leases     read (a held point is left to its beat)
KEYS[6] schedules  the definition, read and removed
KEYS[7] history    the run state, read and removed
KEYS[4] wake, KEYS[5] dead: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
KEYS[8] gate:overlap  the field for this schedule (its overlap key: the name) is removed: a
                   point of it that waited for a run to end (overlap buffer_one) will not run

ARGV[1] schedule name

A point a beat holds right now is left to it; its fire finds the schedule gone,
removes the point without publishing it, and does not advance.

Returns 1 deleted, 0 no such schedule.
]]
--!include job
local name = ARGV[1]
if redis.call('HEXISTS', KEYS[6], name) == 0 then
  return 0
end
local raw = redis.call('HGET', KEYS[7], name)
if raw then
  local ok, state = pcall(cjson.decode, raw)  -- a run state that does not read names no point
  local cur = ok and type(state) == 'table' and state.cur
  if type(cur) == 'string' and redis.call('HEXISTS', KEYS[3], cur) == 0 then
    remove_job(cur)
  end
end
redis.call('HDEL', KEYS[6], name)
redis.call('HDEL', KEYS[7], name)
redis.call('HDEL', KEYS[8], name)
return 1
