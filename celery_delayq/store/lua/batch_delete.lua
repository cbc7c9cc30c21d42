--[[ batch_delete: delete a batch's record (an operator's delete, or the sweep of expired ones).

KEYS[1] due        a parked completion job's member removed (mode "force")
KEYS[2] jobs       a parked completion job's envelope removed (mode "force")
KEYS[3] leases     a parked completion job's entry removed (mode "force")
KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): batch:<bid>, batches,
batches:expiry, gate:keys, gate:rates, gate:wait:<key>.

ARGV[1] batch id, ARGV[2] its gate key (batch:<bid>)
ARGV[3] mode: "done"    delete it when it is finished; refuse one still pending (returns 2)
              "force"   delete it finished or not; a completion job still parked (waiting for
                        the batch) is removed too. The caller cancels the waiting members first
                        (batch_cancel.lua); members a beat holds or that run are left to end,
                        their outcomes counted nowhere.
              "expired" the sweep: delete it only when batches:expiry gives it an expiry time at
                        or before now (returns 3 otherwise); a batch opened again under the id
                        since (stored, not finished) is kept and its stale entry removed. An
                        open batch never sealed (DelayQ.open_batch) whose time passed is
                        deleted with its parked completion job (on_complete never runs);
                        the caller cancels its waiting members first (Store.sweep_batches),
                        as for "force"; members running end counted nowhere

Returns 1 when the batch was deleted; 0 when there was no batch hash (what was left of one,
its ids and key records, is removed all the same); 2 when mode "done" found it not finished;
3 when mode "expired" found it not expired. A finished batch's completion job already made due
is left to its delivery.
Errors: a batch:<bid> that is not a hash (written by hand): nothing written.
Memory: no script flags: it only removes (HDEL, SREM, ZREM), which Redis runs when over
maxmemory, so a delete works on a full Redis and frees what it removes.
Bad input is refused with an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local bid, key, mode = ARGV[1], ARGV[2], ARGV[3]
if not gate_key_ok(bid) or not gate_key_ok(key) or (mode ~= 'done' and mode ~= 'force' and mode ~= 'expired') then
  return redis.error_reply('delayq batch_delete: batch id, key and mode (done, force or expired) expected')
end
local bkey = batch_hash(bid)
local read = redis.pcall('HMGET', bkey, 'total', 'done', 'completion', 'open')
if type(read) == 'table' and read.err then
  return redis.error_reply('delayq batch_delete: ' .. bkey .. ' is not a hash (written by hand): '
    .. 'nothing deleted')
end
local stored = read[1] ~= false or read[2] ~= false or read[3] ~= false
if mode == 'expired' then
  local at = tonumber(redis.call('ZSCORE', G_BATCH_EXPIRY, bid))
  if at == nil or at > server_now() then
    return 3
  end
  if stored and read[2] ~= '1' and read[4] ~= '1' then  -- opened again since: not finished, kept
    redis.call('ZREM', G_BATCH_EXPIRY, bid)
    return 3
  end
end
if stored and read[2] ~= '1' then
  if mode == 'done' then
    return 2
  end
  local completion = read[3]
  if completion and completion ~= '' and tonumber(redis.call('ZSCORE', KEYS[1], completion)) == PARK_MS then
    redis.call('ZREM', KEYS[1], completion)
    redis.call('HDEL', KEYS[2], completion)
    redis.call('HDEL', KEYS[3], completion)
  end
end
batch_forget(bid, key)
return stored and 1 or 0
