--[[ batch_open: record a new batch, and store its completion job parked until the batch ends.

KEYS[1] due        the completion job's member, score PARK_MS
KEYS[2] jobs       the completion job's envelope (stored form)
KEYS[3] leases     the completion job's entry (created, 0, "gate")
KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): batch:<bid>, batches.
The caller passes the shard of the batch's key, batch:<bid>, where its members and its
completion job ({batch:<bid>}:...) live.

ARGV[1] batch id, ARGV[2] total members (a whole number >= 0)
ARGV[3] completion job id, or "" (none), ARGV[4] its envelope (stored form; "" when none)
ARGV[5] created (ms), ARGV[6] meta (JSON: limit, priority, eta ms)
ARGV[7] "" (a batch sealed at once: DelayQ.batch) or the ms an open batch (DelayQ.open_batch)
        is kept unsealed: it is marked open ("open" 1, "open_ms" that), with "expires" created + that and the
        same time in batches:expiry (the sweep, batch_delete.lua, removes it then unless
        sealed; batch_grow.lua pushes it back at each add). Absent: "".

Returns 0 when batch:<bid> exists (its total is set; nothing written), else writes its hash (total, succeeded,
failed, cancelled 0, created, completion, meta), adds the id to batches, stores the completion
job (if any) parked: it is made due by the batch's completion (includes/gate.lua batch_check).
Returns 1.
No allow-oom flag: a full Redis refuses it at its first write (the hash), before anything is
written.
Bad input (an empty batch id or one with "{", "}" or "|", a total or created time that is not a
whole number, a completion id without an envelope) is refused with an error before anything is
written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local bid, completion, envelope = ARGV[1], ARGV[3], ARGV[4]
local total = int_arg(2)
local created = int_arg(5)
local open_ms = nil
if ARGV[7] ~= nil and ARGV[7] ~= '' then
  open_ms = int_arg(7)
  if open_ms == nil or open_ms < 1 then
    return redis.error_reply('delayq batch_open: the open time (ms) is a whole number >= 1 or ""')
  end
end
if not gate_key_ok(bid) or total == nil or total < 0 or created == nil or completion == nil
    or envelope == nil or ARGV[6] == nil or (completion ~= '' and envelope == '') then
  return redis.error_reply('delayq batch_open: batch id, total, completion id and envelope, created and meta expected')
end
local bkey = batch_hash(bid)
if redis.call('HEXISTS', bkey, 'total') == 1 then
  return 0
end
redis.call('HSET', bkey, 'total', total, 'succeeded', 0, 'failed', 0, 'cancelled', 0,
  'created', created, 'completion', completion, 'meta', ARGV[6])
redis.call('SADD', G_BATCHES, bid)
if open_ms then
  local expires = string.format('%d', created + open_ms)
  redis.call('HSET', bkey, 'open', '1', 'open_ms', ARGV[7], 'expires', expires)
  redis.call('ZADD', G_BATCH_EXPIRY, expires, bid)
end
if completion ~= '' then
  redis.call('HSET', KEYS[2], completion, envelope)
  redis.call('ZADD', KEYS[1], PARK_TEXT, completion)
  redis.call('HSET', KEYS[3], completion, lease_entry(created, 0, GATE_TOKEN))
end
return 1
