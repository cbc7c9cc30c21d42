#!lua flags=allow-oom
--[[ batch_cancel: remove a batch's members that have not been released, and count them.

KEYS[1] due        each cancelled member's member removed; a completion job made due
KEYS[2] jobs       each cancelled member's envelope removed
KEYS[3] leases     read (a member a beat holds or that runs is left alone), entry removed
KEYS[4] wake       lowered (with a wake message) when the batch completes with a completion job
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): batch:<bid>,
gate:wait:<key>.

ARGV[1] batch id, ARGV[2] its gate key (batch:<bid>)
ARGV[3] batch channel, ARGV[4] wake channel, ARGV[5] shard index
ARGV[6] ms a finished batch is kept (delayq_batch_expires), or "" (kept until deleted)
ARGV[7..] member ids

Each id whose job is stored with no lease entry (waiting) or a "gate" one (parked or
deferred) is removed, taken off gate:wait:<key> and counted in the batch's cancelled; one a
beat holds or that runs is left alone (it ends as succeeded or failed); the completion job
is never cancelled here. Then the completion check (includes/gate.lua batch_check).
Returns {cancelled, done}: done is 1 when this call completed the batch.
Runs when Redis is over maxmemory (it frees jobs; its first write is an HDEL that deletes
nothing, which Redis 6.2 never refuses).
]]
--!include args
--!include sliced
--!include lease
--!include job
--!include wake
--!include gate
local bid, key = ARGV[1], ARGV[2]
local shard = int_arg(5)
local keep = keep_arg(6)
if not gate_key_ok(bid) or not gate_key_ok(key) or shard == nil or shard < 0 or ARGV[3] == nil
    or ARGV[4] == nil or keep == false then
  return redis.error_reply('delayq batch_cancel: batch id, key, 2 channels, shard, keep and ids expected')
end
redis.call('HDEL', KEYS[3], '')  -- the first write, never refused when full (see above)
local bkey = batch_hash(bid)
local completion = redis.call('HGET', bkey, 'completion')
local wkey = wait_key(key)
local cancelled = 0
for i = 7, #ARGV do
  local id = ARGV[i]
  if id ~= completion and redis.call('HEXISTS', KEYS[2], id) == 1 then
    local entry = redis.call('HGET', KEYS[3], id)
    if not entry or lease_holds(entry, GATE_TOKEN) then
      remove_job(id)
      redis.call('ZREM', wkey, id)
      cancelled = cancelled + 1
    end
  end
end
local done = 0
if redis.call('HEXISTS', bkey, 'total') == 1 then
  if cancelled > 0 then
    batch_add(bid, 'cancelled', cancelled)
  end
  done = batch_check(bid, ARGV[3], ARGV[4], shard, server_now(), keep)
end
return {cancelled, done}
