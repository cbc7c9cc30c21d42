--[[ enqueue: store jobs of one shard and wake a sleeping beat when needed.

KEYS[1] due        each stored job's member and due time
KEYS[2] jobs       each job's envelope, written
KEYS[3] leases     a leased job's entry is removed when it is stored again (status 3)
KEYS[4] wake       lowered (with a wake message) when a stored job is due before it
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] mode: "keep" (a waiting job with the same id is kept) or "replace"
ARGV[2] wake channel (pub/sub)
ARGV[3] shard index, echoed in the wake message
ARGV[4] clock: "at" (each due is a time, ms since the epoch) or "in" (each due is a
        delay in ms, >= 0, added to this server's TIME: apply_in and countdown count
        from the Redis server's now, never from the producer's clock)
ARGV[5..] triples: job id, due (ms, integer; see ARGV[4]), envelope

Returns a flat array: the server's now (TIME, ms), then two entries per job in
ARGV order: status, due ms (a time, also for "in": the stored due time).
  status 1  stored, no job had this id
  status 2  replaced a waiting job with this id (mode "replace")
  status 3  stored; the previous job with this id is being delivered (it was
            leased), so it is not touched by the stale holder's ack
  status 0  kept: a waiting job with this id exists (mode "keep"); due ms is
            the existing job's due time
Jobs are handled in ARGV order: a job with the same id as an earlier one of
the same call sees that job as waiting. A new job costs HSETNX (HSET when
replacing) and one ZADD per call for all stored jobs.
When the earliest stored due time is earlier than the wake marker (or there is
no marker), the marker is lowered to it and "<shard>:<due ms>" is published on
the wake channel, so a sleeping beat wakes within milliseconds.
A call with another mode or clock, an incomplete triple, a due time that is not
a whole number of ms or a negative delay is refused with an error, before anything
is written.
]]
--!include args
--!include sliced
--!include wake
if ARGV[1] ~= 'keep' and ARGV[1] ~= 'replace' then
  return redis.error_reply('delayq enqueue: mode must be "keep" or "replace"')
end
if ARGV[4] ~= 'at' and ARGV[4] ~= 'in' then
  return redis.error_reply('delayq enqueue: clock must be "at" or "in"')
end
if (#ARGV - 4) % 3 ~= 0 then
  return redis.error_reply('delayq enqueue: jobs come in triples: id, due ms, envelope')
end
local relative = ARGV[4] == 'in'
for i = 6, #ARGV, 3 do
  local n = int_arg(i)
  if n == nil then
    return redis.error_reply('delayq enqueue: due time is not a whole number of ms: ' .. ARGV[i])
  end
  if relative and n < 0 then
    return redis.error_reply('delayq enqueue: delay must be >= 0 ms: ' .. ARGV[i])
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local base = 0
if relative then
  base = now
end
local keep = ARGV[1] == 'keep'
local out = {now}
local members = {}  -- due, id pairs of the jobs stored: one ZADD at the end
local pending = {}  -- id -> due of the job this call stored with that id
local earliest = nil
for i = 5, #ARGV, 3 do
  local id = ARGV[i]
  local due = base + tonumber(ARGV[i + 1])
  local status
  if keep then
    if redis.call('HSETNX', KEYS[2], id, ARGV[i + 2]) == 1 then
      status = 1
    elseif redis.call('HDEL', KEYS[3], id) == 1 then
      -- it was leased (being delivered): store the new job, drop the stale lease
      redis.call('HSET', KEYS[2], id, ARGV[i + 2])
      status = 3
    else
      status = 0
      due = pending[id] or tonumber(redis.call('ZSCORE', KEYS[1], id))
    end
  elseif redis.call('HSET', KEYS[2], id, ARGV[i + 2]) == 1 then
    status = 1
  elseif redis.call('HDEL', KEYS[3], id) == 1 then
    status = 3
  else
    status = 2
  end
  if status ~= 0 then
    members[#members + 1] = due
    members[#members + 1] = id
    pending[id] = due
    if earliest == nil or due < earliest then
      earliest = due
    end
  end
  out[#out + 1] = status
  out[#out + 1] = due
end
call_sliced('ZADD', KEYS[1], members, 2)
if earliest ~= nil then
  wake(ARGV[2], ARGV[3], earliest)
end
return out
