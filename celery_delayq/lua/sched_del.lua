--[[ sched_del: delete a recurring schedule, its run state and its waiting point.

KEYS[1..7] due, jobs, leases, wake, dead, schedules, history (one shard; see sched_put.lua)

ARGV[1] schedule name

A point a beat holds right now is left to it; its fire finds the schedule gone,
removes the point without publishing it, and does not advance.

Returns 1 deleted, 0 no such schedule.
]]
local name = ARGV[1]
if redis.call('HEXISTS', KEYS[6], name) == 0 then
  return 0
end
local raw = redis.call('HGET', KEYS[7], name)
if raw then
  local ok, state = pcall(cjson.decode, raw)  -- a run state that does not read names no point
  local cur = ok and type(state) == 'table' and state.cur
  if type(cur) == 'string' and redis.call('HEXISTS', KEYS[3], cur) == 0 then
    redis.call('ZREM', KEYS[1], cur)
    redis.call('HDEL', KEYS[2], cur)
  end
end
redis.call('HDEL', KEYS[6], name)
redis.call('HDEL', KEYS[7], name)
return 1
