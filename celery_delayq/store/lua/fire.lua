#!lua flags=allow-oom
--[[ fire: ack a schedule's execution point and move the schedule to its next point.

This is lazy unrolling: a schedule only ever has one point stored; the beat
that delivered it computes the next one (cron, interval, timezone: in Python)
and this script swaps them atomically, so no schedule is ever scanned.

KEYS[1] due        the acked point's member removed, the next point's added
KEYS[2] jobs       the acked point's envelope removed, the next point's stored
KEYS[3] leases     read (the caller's?), then the acked point's entry removed
KEYS[4] wake       lowered (with a wake message) when the next point is due before it
KEYS[6] schedules  read (does the schedule still exist?)
KEYS[7] history    the run state, read and written
KEYS[5] dead: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the lease token the caller claimed the point with
ARGV[2] id of the point being acked
ARGV[3] schedule name
ARGV[4] the point's time in ms
ARGV[5] the task id that was published for it, "" when the missed-run policy skipped it
ARGV[6] id of the next point, "" when the rule has no more
ARGV[7] its due time in ms
ARGV[8] its envelope
ARGV[9] wake channel
ARGV[10] shard index

Returns
  1  acked and advanced
  3  acked and advanced, but the run state (history) did not read as a JSON object
     (corrupt data): it was reset (run count and last run lost) before advancing
  2  acked, not advanced: the schedule was deleted, paused or replaced while
     the point was being delivered (its current point is another, or none)
  0  the caller no longer holds the lease (another beat re-claimed the point):
     nothing changed; that beat will fire it
A point time or next due time that is not a whole number of ms is refused with an
error, before anything is written.
Runs when Redis is over maxmemory: its first write is a ZREM (never refused when full,
even on Redis 6.2), and the next point it stores replaces the one it acks.
]]
--!include args
--!include lease
--!include job
--!include wake
local id = ARGV[2]
if int_arg(4) == nil or (ARGV[6] ~= '' and int_arg(7) == nil) then
  return redis.error_reply('delayq fire: the point time and the next due time must be whole numbers of ms')
end
if not held(id, ARGV[1]) then
  return 0
end
remove_job(id)
local name = ARGV[3]
local raw = redis.call('HGET', KEYS[7], name)
if not raw or redis.call('HEXISTS', KEYS[6], name) == 0 then
  return 2
end
local ok, state = pcall(cjson.decode, raw)
local reset = not ok or type(state) ~= 'table' or state[1] ~= nil
  or (state.cur ~= nil and type(state.cur) ~= 'string')
if reset then
  state = {runs = 0, cur = id}
end
if state.cur ~= id then
  return 2
end
if ARGV[5] ~= '' then
  state.last_run = tonumber(ARGV[4])
  state.last_task_id = ARGV[5]
  state.runs = (tonumber(state.runs) or 0) + 1
end
if ARGV[6] ~= '' then
  local due = int_arg(7)
  state.cur = ARGV[6]
  state.next = due
  redis.call('ZADD', KEYS[1], due, ARGV[6])
  redis.call('HSET', KEYS[2], ARGV[6], ARGV[8])
  wake(ARGV[9], ARGV[10], due, ARGV[7])
else
  state.cur = nil
  state.next = nil
end
redis.call('HSET', KEYS[7], name, cjson.encode(state))
if reset then
  return 3
end
return 1
