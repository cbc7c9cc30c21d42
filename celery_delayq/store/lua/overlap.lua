--[[ overlap: may a schedule's point run now, while a run of the schedule may still be running?

A schedule with an overlap policy (schedules/spec.py OVERLAP_POLICIES, not "allow") has its
runs hold the one slot of its key (the schedule's name, gate:run:<name>) from their publish to
their end, as a capped job's slot is held: the worker renews it while the task runs and gives
it back when it ends (flow/slots.py, lua/slot_renew.lua, lua/release.lua), and a worker that
dies leaves it to expire (delayq_slot_ttl after its last renewal). The beat that claimed a due
point asks this script before publishing it.

KEYS[1] due        a waiting (buffer_one) point's score becomes the time it is looked at again
KEYS[3] leases     read (held by the caller?); the point's entry gets token "gate"
KEYS[4] wake       lowered (with a wake message) to a waiting point's time
KEYS[2] jobs: read by the purge of expired slots; KEYS[5] dead, KEYS[6] schedules,
KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:run:<key>,
gate:check, gate:overlap (hash key -> the id of the key's point that waits for a run to end:
one field a schedule at most, removed at its next run or by its delete, lua/sched_del.lua; a
point removed while it waited by a pause leaves its field until the next run).

ARGV[1] token: the caller's lease token (no "|")
ARGV[2] the point's id, ARGV[3] its schedule's key (its name: the point id's hash tag)
ARGV[4] policy: "skip", "buffer_one" or "cancel_previous"
ARGV[5] start TTL ms: the slot a run takes lasts this long unless its worker renews it
ARGV[6] poll ms: the longest a waiting point waits before it is looked at again
ARGV[7] wake channel, ARGV[8] shard index

"now" is the server's TIME. First the key's expired slots whose job is gone are removed (up
to 10: includes/gate.lua purge): a run whose worker died, or a message no worker started in
the start TTL. Then the key's remaining slots are the runs in flight:
- the point is not held by the token -> {"not-held"}: nothing done.
- the point holds a slot already (its beat died after this script and before its fire), or
  the key has none -> {"run", waited}: a slot until now + start TTL is taken for the point,
  and its lease entry gets token "gate" (due and tries kept), so the worker's renewal and
  release of the slot leave the stored point alone and the beat fires it with that token;
  waited: 1 when the point had waited (buffer_one: the key's gate:overlap field names it);
  the key's field is removed.
- "skip" -> {"skip", ids of the slots' runs}: nothing written; the beat fires the point
  unpublished.
- "cancel_previous" -> {"cancel", waited, ids...}: the slot taken as for "run"; the beat
  revokes the runs named and publishes the point.
- "buffer_one" -> {"wait", ms, ids...}: the point waits: its score becomes ms (the first
  slot's expiry, at most now + poll ms, at least now + 1), its lease entry (due, tries - 1,
  "gate"), the key's gate:overlap field its id, the wake marker lowered to ms. Any beat claims it
  again then, and asks again. So it runs within poll ms of the last run's end, or within
  delayq_slot_ttl (plus poll) of its worker's death.
Memory: no allow-oom flag: a full Redis refuses the script at its first write that may grow
memory (the ZADD of the slot, or the ZADD of the waiting point's score); only the purge of
expired slots may have run before. The point keeps the caller's lease and is claimed again
after it.
Bad input (a token with "|", an empty id, a bad key, an unknown policy, a TTL, poll or
shard that is not a whole number in range) is refused with an error before anything is
written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local token, id, key, policy = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl, poll, shard = int_arg(5), int_arg(6), int_arg(8)
if token == nil or token == '' or string.find(token, '|', 1, true) or id == nil or id == ''
    or not gate_key_ok(key) or ttl == nil or ttl < 1 or poll == nil or poll < 1
    or shard == nil or shard < 0 or ARGV[7] == nil then
  return redis.error_reply('delayq overlap: token, id, key, policy, start TTL, poll, channel and shard expected')
end
if policy ~= 'skip' and policy ~= 'buffer_one' and policy ~= 'cancel_previous' then
  return redis.error_reply('delayq overlap: the policy must be skip, buffer_one or cancel_previous')
end
local entry = redis.call('HGET', KEYS[3], id)
if not (entry and lease_holds(entry, token)) then
  return {'not-held'}
end
local rkey = run_key(key)
local now = server_now()
purge(key, now)
local due, tries = lease_read(entry)
if due == nil then
  due, tries = now, 1
end
local marked = redis.call('HGET', G_OVERLAP, key)
local waited = 0
if marked == id then
  waited = 1
end
local function take()
  redis.call('ZADD', rkey, now + ttl, id)  -- the first write that may grow memory
  redis.call('HSET', KEYS[3], id, lease_entry(due, tries, GATE_TOKEN))
  if marked then
    redis.call('HDEL', G_OVERLAP, key)
  end
end
if redis.call('ZSCORE', rkey, id) then
  take()
  return {'run', waited}
end
local holders = redis.call('ZRANGE', rkey, 0, 99)
if #holders == 0 then
  take()
  return {'run', waited}
end
if policy == 'skip' then
  return {'skip', unpack(holders)}
end
if policy == 'cancel_previous' then
  take()
  return {'cancel', waited, unpack(holders)}
end
local first = tonumber(redis.call('ZRANGE', rkey, 0, 0, 'WITHSCORES')[2]) or (now + poll)
local at = math.max(math.min(first, now + poll), now + 1)
redis.call('ZADD', KEYS[1], at, id)  -- the first write that may grow memory
redis.call('HSET', KEYS[3], id, lease_entry(due, math.max(tries - 1, 0), GATE_TOKEN))
redis.call('HSET', G_OVERLAP, key, id)
wake(ARGV[7], shard, at)
return {'wait', at, unpack(holders)}
