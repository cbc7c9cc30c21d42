#!lua flags=allow-oom
--[[ batch_seal: seal an open batch (DelayQ.open_batch): no member is added after, and it
completes once every member ended (at once when they all have).

KEYS[1] due        the completion job made due when the seal completes the batch
KEYS[2] jobs       read (the completion job is still stored)
KEYS[3] leases     not written (the first write's target: an HDEL of the empty id)
KEYS[4] wake       lowered (with a wake message) when the batch completes with a completion job
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): batch:<bid>,
batches:expiry.

ARGV[1] batch id, ARGV[2] batch channel, ARGV[3] wake channel, ARGV[4] shard index
ARGV[5] ms a finished batch is kept (delayq_batch_expires), or "" (kept until deleted)

Returns {status, done}: status 1 when this call sealed it (its "open", "open_ms" and open "expires"
removed, its batches:expiry entry too), 2 when it was sealed already (nothing written), 0 when
there is no such batch; done is 1 when this call completed the batch (includes/gate.lua
batch_check: every member had ended already).
Memory: runs when Redis is over maxmemory (it frees a field; its first write is an HDEL that
deletes nothing, which Redis 6.2 never refuses), so a producer can always seal its batch.
Bad input (a bad batch id, shard or keep) is refused with an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local bid = ARGV[1]
local shard = int_arg(4)
local keep = keep_arg(5)
if not gate_key_ok(bid) or ARGV[2] == nil or ARGV[3] == nil or shard == nil or shard < 0 or keep == false then
  return redis.error_reply('delayq batch_seal: batch id, 2 channels, shard and keep expected')
end
redis.call('HDEL', KEYS[3], '')  -- the first write, never refused when full (see above)
local bkey = batch_hash(bid)
local h = redis.call('HMGET', bkey, 'total', 'open')
if h[1] == false then
  return {0, 0}
end
if h[2] ~= '1' then
  return {2, 0}
end
redis.call('HDEL', bkey, 'open', 'open_ms', 'expires')
redis.call('ZREM', G_BATCH_EXPIRY, bid)
return {1, batch_check(bid, ARGV[2], ARGV[3], shard, server_now(), keep)}
