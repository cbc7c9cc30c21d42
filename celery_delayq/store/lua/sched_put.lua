--[[ sched_put: create or replace a recurring schedule and its next execution point.

KEYS[1] due        the old waiting point removed, the next point added
KEYS[2] jobs       the old point's envelope removed, the next point's stored
KEYS[3] leases     read (a held point is left to its beat); a stray entry for the next point removed
KEYS[4] wake       lowered (with a wake message) when the next point is due before it
KEYS[6] schedules  the definition, read and written
KEYS[7] history    the run state, read and written
                   {"cur": point id, "next": ms, "last_run": ms, "last_task_id": id, "runs": n}
KEYS[5] dead: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

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
--!include args
--!include job
--!include wake
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
  remove_job(cur)
end
redis.call('HSET', KEYS[6], name, ARGV[3])
if ARGV[4] ~= '' then
  local due = int_arg(5)
  state.cur = ARGV[4]
  state.next = due
  redis.call('HDEL', KEYS[3], ARGV[4])
  redis.call('ZADD', KEYS[1], due, ARGV[4])
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[6])
  wake(ARGV[7], ARGV[8], due, ARGV[5])
else
  state.cur = nil
  state.next = nil
end
redis.call('HSET', KEYS[7], name, cjson.encode(state))
return 1
