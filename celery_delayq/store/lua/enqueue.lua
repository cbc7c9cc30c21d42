--[[ enqueue: store jobs of one shard and wake a sleeping beat when needed.

KEYS[1] due        each stored job's member and due time
KEYS[2] jobs       each job's envelope, written
KEYS[3] leases     a leased job's entry is removed when it is stored again (status 3)
KEYS[4] wake       lowered (with a wake message) when a stored job is due before it
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
KEYS[8] shapes     shape id -> shape: the text many jobs' envelopes share (stored_forms.py, shared_form)
KEYS[9] unique     (mode "unique:<ms>" only) id -> the end (ms) of its uniqueness window

ARGV[1] mode: "keep" (a waiting job with the same id is kept), "replace", or "unique:<ms>":
        an id stays taken for <ms> (a whole number > 0) after its job was stored: a stored job
        with this id is kept (also while a beat holds it), and one stored less than <ms> ago
        that is no longer stored (delivered, or cancelled) stops the job (status 4)
ARGV[2] wake channel (pub/sub)
ARGV[3] shard index, echoed in the wake message
ARGV[4] clock: "at" (each due is a time, ms since the epoch) or "in" (each due is a
        delay in ms, >= 0, added to this server's TIME: apply_in and countdown count
        from the Redis server's now, never from the producer's clock)
ARGV[5] n: how many shapes follow
ARGV[6..5+2n] pairs: shape id, shape (written when the shapes hash lacks it)
ARGV[6+2n..] triples: job id, due (ms, integer; see ARGV[4]), envelope (stored form; one whose
        shape is left to the shapes hash carries its id: ',"S":"<id>"' after its body)

Returns a flat array: the server's now (TIME, ms), then two entries per job in
ARGV order: status, due ms (a time, also for "in": the stored due time).
  status 1  stored, no job had this id
  status 2  replaced a waiting job with this id (mode "replace")
  status 3  stored; the previous job with this id is being delivered (it was
            leased), so it is not touched by the stale holder's ack
  status 0  kept: a waiting job with this id exists (mode "keep"; in mode "unique", any stored
            job with this id); due ms is the existing job's due time
  status 4  taken (mode "unique"): the id's window is open and its job is no longer stored;
            due ms is the window's end
In mode "unique" the reply ends with one more entry: 1 when KEYS[9] was not a sorted set (a
corrupt record: it is deleted, so it cannot stop a key forever, and the caller reports it), else
0. Windows that ended are removed at each such call (after its other writes).
Jobs are handled in ARGV order: a job with the same id as an earlier one of
the same call sees that job as waiting. A new job costs HSETNX (HSET when
replacing) and one ZADD per call for all stored jobs.
When the earliest stored due time is earlier than the wake marker (or there is
no marker), the marker is lowered to it and "<shard>:<due ms>" is published on
the wake channel, so a sleeping beat wakes within milliseconds.
The shapes hash holds at most MAX_SHAPES (store.py: MAX_STORED_SHAPES) shapes: a job whose shape
finds no room is stored whole, its shape joined back in place of the id (no other change).
A call with another mode or clock, an incomplete triple, a due time that is not
a whole number of ms or a negative delay is refused with an error, before anything
is written.
]]
--!include args
--!include sliced
--!include wake
local window = nil
if string.sub(ARGV[1], 1, 7) == 'unique:' then
  local digits = string.match(ARGV[1], '^unique:([1-9]%d*)$')
  window = digits and #digits <= 12 and tonumber(digits)
  if not window or #KEYS < 9 then
    return redis.error_reply('delayq enqueue: mode "unique:<ms>" takes a whole number of ms > 0 '
      .. '(at most 12 digits) and the uniqueness key as KEYS[9]: ' .. ARGV[1])
  end
elseif ARGV[1] ~= 'keep' and ARGV[1] ~= 'replace' then
  return redis.error_reply('delayq enqueue: mode must be "keep", "replace" or "unique:<ms>"')
end
if ARGV[4] ~= 'at' and ARGV[4] ~= 'in' then
  return redis.error_reply('delayq enqueue: clock must be "at" or "in"')
end
local shapes = int_arg(5)
if shapes == nil or shapes < 0 or 5 + 2 * shapes > #ARGV then
  return redis.error_reply('delayq enqueue: ARGV[5] must count the shape pairs that follow')
end
local first = 6 + 2 * shapes
if (#ARGV - first + 1) % 3 ~= 0 then
  return redis.error_reply('delayq enqueue: jobs come in triples: id, due ms, envelope')
end
local relative = ARGV[4] == 'in'
for i = first + 1, #ARGV, 3 do
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
-- the shapes: each written once a shard; those with no room left are joined back into their jobs
local MAX_SHAPES = 1000
local whole = nil
local room = nil
for i = 6, first - 1, 2 do
  if redis.call('HEXISTS', KEYS[8], ARGV[i]) == 0 then  -- (a shape seen before: this one command)
    room = room or MAX_SHAPES - redis.call('HLEN', KEYS[8])
    if room > 0 then
      redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1])
      room = room - 1
    else
      whole = whole or {}
      whole[ARGV[i]] = ARGV[i + 1]
    end
  end
end
local function envelope_at(i)
  local envelope = ARGV[i]
  if whole and string.sub(envelope, 1, 12) == '{"v":3,"a":"' then
    local at = string.find(envelope, '","S":"', 1, true)
    local shape = at and whole[string.sub(envelope, at + 7, at + 22)]
    if shape then
      envelope = string.sub(envelope, 1, at + 1) .. shape .. string.sub(envelope, at + 24)
    end
  end
  return envelope
end
local keep = ARGV[1] == 'keep'
local out = {now}
-- mode "unique": a record that is not a sorted set is read as empty, and replaced at the end
local corrupt = 0
if window then
  local kind = redis.call('TYPE', KEYS[9])['ok']
  if kind ~= 'zset' and kind ~= 'none' then
    corrupt = 1
  end
end
local windows = {}  -- window end, id pairs of those jobs: one ZADD at the end
local members = {}  -- due, id pairs of the jobs stored: one ZADD at the end
local pending = {}  -- id -> due of the job this call stored with that id
local earliest = nil
for i = first, #ARGV, 3 do
  local id = ARGV[i]
  local envelope = envelope_at(i + 2)
  local due = base + tonumber(ARGV[i + 1])
  local status
  if window then
    local open_until = corrupt == 0 and tonumber(redis.call('ZSCORE', KEYS[9], id))
    if open_until and open_until <= now then
      open_until = nil  -- ended: removed below
    end
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- kept; a held job's due is in its lease entry (its score is the lease's expiry)
      status = 0
      local lease = not pending[id] and redis.call('HGET', KEYS[3], id)
      due = pending[id] or (lease and tonumber(string.match(lease, '^(%-?%d+)|')))
        or tonumber(redis.call('ZSCORE', KEYS[1], id))
    elseif open_until then
      status = 4
      due = open_until
    else
      redis.call('HSET', KEYS[2], id, envelope)
      windows[#windows + 1] = now + window
      windows[#windows + 1] = id
      status = 1
    end
  elseif keep then
    if redis.call('HSETNX', KEYS[2], id, envelope) == 1 then
      status = 1
    elseif redis.call('HDEL', KEYS[3], id) == 1 then
      -- it was leased (being delivered): store the new job, drop the stale lease
      redis.call('HSET', KEYS[2], id, envelope)
      status = 3
    else
      status = 0
      due = pending[id] or tonumber(redis.call('ZSCORE', KEYS[1], id))
    end
  elseif redis.call('HSET', KEYS[2], id, envelope) == 1 then
    status = 1
  elseif redis.call('HDEL', KEYS[3], id) == 1 then
    status = 3
  else
    status = 2
  end
  if status ~= 0 and status ~= 4 then
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
if window then
  -- after the jobs' writes: the first write of a call is one Redis refuses when it is full
  if corrupt == 1 then
    redis.call('DEL', KEYS[9])
  end
  call_sliced('ZADD', KEYS[9], windows, 2)
  redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now)
  out[#out + 1] = corrupt
end
return out
