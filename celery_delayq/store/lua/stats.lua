--[[ stats: one shard's counts for `celery delayq status`, read without changing anything.

KEYS[1] due        counted, and read by score
KEYS[3] leases     counted, and read for the head's due time
KEYS[5] dead       counted
KEYS[6] schedules  counted
KEYS[2] jobs, KEYS[4] wake, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

No ARGV. "now" is the server's TIME, as in claim.lua.

Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:keys
(with each key's pause), gate:booked, gate:run:<key>, gate:wait:<key> of the paused keys,
batches and batch:<bid>: read for what the gated lease entries wait for.

Returns {now ms, stored, leased, dead, schedules, overdue,
         head due ms, head id, next due ms, next id,
         running, slot, paused, batch, rate}
  stored     members of due: waiting jobs and jobs with a lease entry
  leased     lease entries: jobs a beat holds (including expired leases not yet re-claimed),
             and the flow-control entries counted below (the caller subtracts them)
  dead       dead letters
  schedules  recurring schedules whose definition lives on this shard
  overdue    members with score <= now: waiting jobs past their due time, and leased
             jobs whose lease expired (their holder died or stalled); no live beat holds them
  head       the overdue member a claim takes first (lowest score): its due time (the
             original due time of an expired lease) and id; -1 and "" when nothing is overdue
  next       the waiting job due soonest after now: its due time and id; -1 and "" when
             none. Members held by a live lease (their score is the lease expiry) are
             skipped, at most one per lease entry, so the walk is bounded by `leased`.
  running    slots taken (gate:run:<key>, summed over gate:keys): released gated jobs whose
             task is published or runs (lease token "run")
  slot       parked jobs (score PARK_MS) waiting for a slot of their full (capped) key
  paused     parked jobs of a paused key (gate:wait:<key> of each paused key of gate:keys)
  batch      batch completion jobs waiting (parked) for their batch's members to end
  rate       jobs deferred by their key's rate (gate:booked)
  Each is clamped so that running + slot + paused + batch + rate <= leased: a cancelled
  parked or deferred job leaves its gate:wait or gate:booked entry behind until its key is
  promoted or it is claimed.
Cost: TIME, ZCARD, three HLEN, a ZCOUNT and one ZRANGE BYSCORE ... LIMIT (a second for the
head when something is overdue): O(log n) when the shard holds no lease entry (8 commands). With
lease entries: pages of that ZRANGE (an HEXISTS a member read, O(log n + leased)), an HGET, a
ZCOUNT, an SMEMBERS, two HGETALL and an HLEN more, plus one ZCARD per gate key and per paused
key, an HMGET per batch of the shard and a ZSCORE per batch not done yet.
]]
--!include sliced
--!include lease
--!include wake
--!include gate
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stored = redis.call('ZCARD', KEYS[1])
local leased = redis.call('HLEN', KEYS[3])
local out = {now, stored, leased, redis.call('HLEN', KEYS[5]), redis.call('HLEN', KEYS[6]),
             redis.call('ZCOUNT', KEYS[1], '-inf', now), -1, '', -1, '', 0, 0, 0, 0, 0}
-- What the flow-control lease entries wait for (see Returns), counted per key, not per job.
-- Each is a lease entry: a shard without any (the usual shard of a store at rest) has none of
-- them, and its gate keys, paused keys and batches are not read.
if leased > 0 then
  local parked = math.min(redis.call('ZCOUNT', KEYS[1], PARK_TEXT, PARK_TEXT), leased)
  local batch = 0
  for _, bid in ipairs(redis.call('SMEMBERS', G_BATCHES)) do
    local h = redis.call('HMGET', batch_hash(bid), 'completion', 'done')
    local completion = h[1]
    if completion and completion ~= '' and not h[2]
        and tonumber(redis.call('ZSCORE', KEYS[1], completion)) == PARK_MS then
      batch = batch + 1
    end
  end
  batch = math.min(batch, parked)
  local paused = 0
  local running = 0
  local gate_keys = redis.call('HGETALL', G_KEYS)
  for i = 1, #gate_keys, 2 do
    running = running + redis.call('ZCARD', run_key(gate_keys[i]))
    local _, _, is_paused = key_read(gate_keys[i + 1])
    if is_paused then
      paused = paused + redis.call('ZCARD', wait_key(gate_keys[i]))
    end
  end
  paused = math.min(paused, parked - batch)
  local free = math.max(leased - parked, 0)
  local rate = math.min(redis.call('HLEN', G_BOOKED), free)
  out[11] = math.min(running, free - rate)
  out[12] = parked - batch - paused
  out[13] = paused
  out[14] = batch
  out[15] = rate
end
-- nothing overdue: no head to read
local head = out[6] > 0 and redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES') or {}
if head[1] then
  local due = tonumber(head[2])
  local lease = leased > 0 and redis.call('HGET', KEYS[3], head[1])
  if lease then
    -- a lease entry that does not read counts as claim.lua takes it: due at its score
    local d = lease_read(lease)
    if d then
      due = d
    end
  end
  out[7] = due
  out[8] = head[1]
end
local page = math.min(100, leased + 1)  -- at most one member a lease entry is skipped
local offset = 0
while true do
  local found = redis.call('ZRANGE', KEYS[1], '(' .. string.format('%d', now), '+inf', 'BYSCORE', 'LIMIT', offset, page, 'WITHSCORES')
  for i = 1, #found, 2 do
    if leased == 0 or redis.call('HEXISTS', KEYS[3], found[i]) == 0 then
      out[9] = tonumber(found[i + 1])
      out[10] = found[i]
      return out
    end
  end
  if #found < 2 * page or offset + page > leased then
    return out
  end
  offset = offset + page
end
