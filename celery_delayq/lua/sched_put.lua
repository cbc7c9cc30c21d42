--[[ sched_put: create or replace a recurring schedule and its next execution point.

KEYS[1] due        sorted set: job id -> due ms (a schedule's point is a job here)
KEYS[2] jobs       hash: job id -> envelope
KEYS[3] leases     hash: job id -> "<due ms>|<tries>|<token>"
KEYS[4] wake       string: wake marker (see enqueue.lua)
KEYS[5] dead       hash (not used here)
KEYS[6] schedules  hash: schedule name -> definition JSON
KEYS[7] history    hash: schedule name -> run state JSON
                   {"cur": point id, "next": ms, "last_run": ms, "last_task_id": id, "runs": n}

ARGV[1] schedule name
ARGV[2] mode: "add" (refuse a name that exists) or "put" (create or replace)
ARGV[3] definition JSON
ARGV[4] id of the next execution point, "" when there is none (paused, or the rule has ended)
ARGV[5] its due time in ms
ARGV[6] its envelope
ARGV[7] wake channel
ARGV[8] shard index
ARGV[9] optional: a repair of a stalled schedule (see schedules.StallSweep): the id of the
        point the schedule waits for. Nothing is written, and 2 returned, unless the
        schedule exists, its current point is still that id, and no job with that id is
        stored (so a beat that fired or a caller that changed it meanwhile wins).

A run state that does not read (corrupt data) is replaced by a fresh one.
The previous definition's waiting point is removed; a point a beat holds right
now is left to that beat, whose fire then sees it is no longer current and does
not advance the schedule. The run history (last run, run count) is kept.

Returns 1 stored, 0 refused (mode "add" and the name exists), 2 not stalled (ARGV[9]).
Another mode, or a due time that is not a whole number of ms, is refused with an
error, before anything is written.
]]
local name = ARGV[1]
if ARGV[2] ~= 'add' and ARGV[2] ~= 'put' then
  return redis.error_reply('delayq sched_put: mode must be "add" or "put"')
end
if ARGV[4] ~= '' and int_arg(5) == nil then
  return redis.error_reply('delayq sched_put: due time is not a whole number of ms: ' .. tostring(ARGV[5]))
end
if ARGV[2] == 'add' and redis.call('HEXISTS', KEYS[6], name) == 1 then
  return 0
end
local state = {runs = 0}
local raw = redis.call('HGET', KEYS[7], name)
if raw then
  -- a run state that does not read (corrupt data) is replaced by a fresh one
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' and decoded[1] == nil
      and (decoded.cur == nil or type(decoded.cur) == 'string') then
    state = decoded
  end
end
local stalled = ARGV[9]
if stalled and stalled ~= '' and (state.cur ~= stalled or redis.call('HEXISTS', KEYS[2], stalled) == 1
    or redis.call('HEXISTS', KEYS[6], name) == 0) then
  return 2
end
local cur = state.cur
if type(cur) == 'string' and cur ~= ARGV[4] and redis.call('HEXISTS', KEYS[3], cur) == 0 then
  redis.call('ZREM', KEYS[1], cur)
  redis.call('HDEL', KEYS[2], cur)
end
redis.call('HSET', KEYS[6], name, ARGV[3])
if ARGV[4] ~= '' then
  local due = int_arg(5)
  state.cur = ARGV[4]
  state.next = due
  redis.call('HDEL', KEYS[3], ARGV[4])
  redis.call('ZADD', KEYS[1], due, ARGV[4])
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[6])
  local marker = tonumber(redis.call('GET', KEYS[4]))
  if marker == nil or due < marker then
    redis.call('SET', KEYS[4], ARGV[5])
    redis.call('PUBLISH', ARGV[7], ARGV[8] .. ':' .. ARGV[5])
  end
else
  state.cur = nil
  state.next = nil
end
redis.call('HSET', KEYS[7], name, cjson.encode(state))
return 1
