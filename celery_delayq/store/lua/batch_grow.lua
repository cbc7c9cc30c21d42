--[[ batch_grow: reserve the next member numbers of an open batch (DelayQ.open_batch's add).

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules,
KEYS[7] history: not used here (KEYS[1] names the gate's keys: see includes/gate.lua)
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag): batch:<bid>, batches:expiry.

ARGV[1] batch id, ARGV[2] how many members are added (a whole number >= 1)

Returns {1, first, meta}: the batch's total was first, it is first + n now (the caller stores
members first .. first + n - 1 next), its expiry is pushed back to now + its "open_ms" (the
time batch_open.lua was given; in the hash and batches:expiry);
meta is the batch's meta JSON (limit, priority). {0} when there is no such batch, {2} when
it is sealed (or was made sealed by DelayQ.batch): nothing written. One script: two
processes adding at once get disjoint numbers, and the total counts each member once.
Memory: no allow-oom flag: a full Redis refuses it at its first write (the total), before
anything is written.
Bad input (a bad batch id, a count < 1) is refused with an error before anything is written;
an "open_ms" that does not read (written by hand) is taken as one day.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local bid = ARGV[1]
local n = int_arg(2)
if not gate_key_ok(bid) or n == nil or n < 1 then
  return redis.error_reply('delayq batch_grow: batch id and count >= 1 expected')
end
local bkey = batch_hash(bid)
local h = redis.call('HMGET', bkey, 'total', 'open', 'meta', 'open_ms')
local first = tonumber(h[1])
if first == nil then
  return {0}
end
if h[2] ~= '1' then
  return {2}
end
local expires = string.format('%d', server_now() + (tonumber(h[4]) or 86400000))
redis.call('HSET', bkey, 'total', string.format('%d', first + n), 'expires', expires)
redis.call('ZADD', G_BATCH_EXPIRY, expires, bid)
return {1, first, h[3] or '{}'}
