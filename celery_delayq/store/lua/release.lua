#!lua flags=allow-oom
--[[ release: a gated job's task ended; give its slot back and let parked jobs of its key go.

KEYS[1] due        the finished job's member removed; promoted jobs' scores set to now - priority
KEYS[2] jobs       the finished job's envelope removed; read for promoted and completion jobs
KEYS[3] leases     the finished job's entry removed
KEYS[4] wake       lowered (with a wake message) when jobs were promoted
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:keys,
gate:check, gate:run:<key>, gate:wait:<key>, batch:<bid>.

ARGV[1] job id, ARGV[2] gate key
ARGV[3] outcome: "succeeded", "failed" or "retry" (the task will run again: not counted)
ARGV[4] batch id, or "" (not a batch member)
ARGV[5] batch channel, ARGV[6] wake channel, ARGV[7] shard index
ARGV[8] ms a finished batch is kept (delayq_batch_expires), or "" (kept until deleted)

When the id has no slot in gate:run:<key> (released already: a double release) nothing is
done: {0, 0, 0}. Else the slot is removed, and the job too when it has a lease entry that is
not "gate" (running, or still the beat's); a job with no lease entry was stored again meanwhile
(a retry with a countdown) and is kept. A batch member's outcome (not "retry") is counted in
batch:<bid>, and the batch completed when it was its last (includes/gate.lua batch_check).
Then its parked jobs are promoted into its free slots (includes/gate.lua promote; when it has
parked jobs and no free slot, its expired slots whose job is gone are purged first).
Returns {1, promoted, done}: done is 1 when this call completed the batch.
Runs when Redis is over maxmemory (it frees a job; its first write is the ZREM of the slot,
which Redis 6.2 never refuses).
Bad input (an empty id, a bad key, an unknown outcome, a shard that is not a whole number) is
refused with an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include job
--!include wake
--!include gate
local id, key, outcome, bid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local shard = int_arg(7)
local keep = keep_arg(8)
if id == nil or id == '' or not gate_key_ok(key) or shard == nil or shard < 0 or bid == nil
    or ARGV[5] == nil or ARGV[6] == nil or keep == false then
  return redis.error_reply('delayq release: id, key, outcome, batch, 2 channels, shard and keep expected')
end
if outcome ~= 'succeeded' and outcome ~= 'failed' and outcome ~= 'retry' then
  return redis.error_reply('delayq release: the outcome must be succeeded, failed or retry')
end
if redis.call('ZREM', run_key(key), id) == 0 then  -- the first write (see above)
  return {0, 0, 0}
end
redis.call('HDEL', G_CHECK, id)
local entry = redis.call('HGET', KEYS[3], id)
if entry and not lease_holds(entry, GATE_TOKEN) then
  remove_job(id)
end
local now = nil  -- the server's TIME, read only when needed (a batch member, parked jobs)
local done = 0
if bid ~= '' and outcome ~= 'retry' and redis.call('HEXISTS', batch_hash(bid), 'total') == 1 then
  now = server_now()
  batch_add(bid, outcome, 1)
  done = batch_check(bid, ARGV[5], ARGV[6], shard, now, keep)
end
local promoted = promote(key, ARGV[6], shard, now)
return {1, promoted, done}
