#!lua flags=allow-oom
--[[ hold: after publishing released gated jobs, mark them running instead of acking them.

KEYS[1] due        each held job's score becomes its slot expiry (now + TTL)
KEYS[2] jobs       not used here (the envelope stays: the job is stored while it runs)
KEYS[3] leases     read in one HMGET (held by the caller?), then the entry's token becomes "run"
KEYS[4] wake       lowered to the slot expiry when that is earlier (includes/wake.lua)
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:run:<key>,
gate:check.

ARGV[1] token: the beat's lease token
ARGV[2] start TTL ms (delayq_start_ttl): how long the message may wait for a worker
ARGV[3] check ms: 0, or how often a beat looks (in the result backend) whether the task of a
        job still waiting for its worker has finished already (a store restored from an
        older snapshot forgets the release: docs/guarantees.md)
ARGV[4..] pairs: job id, gate key

For each job that the token still holds and whose id has a slot in gate:run:<key> (gate.lua
gave it one): lease entry (due, tries, "run") and slot expiry now + TTL: the message may wait
that long in the broker. Its due score is that expiry too, or, with a check ms and an expiry
later than now + check, now + check with the id in gate:check: the claim then is a check
(gate.lua "held"), not a redelivery. Its worker takes the slot over when the task starts
(slot_renew.lua: expiry now + delayq_slot_ttl, renewed while it runs). A job whose message is
lost or whose worker dies is then claimed again when its slot expires (the score), and
gate.lua releases it again into the slot it has. The held jobs' lease entries and due scores
are written after the loop, in one HSET and one ZADD (an id given twice reads as held twice).
Returns one entry per pair: 1 held; 2 nothing to do: its worker started it already (lease
"run", slot kept) or it finished already (no envelope, no slot: release.lua removed it);
0 left alone (the token no longer holds it: its lease expired and another beat took it).
Runs when Redis is over maxmemory: it rewrites entries of the same size (and adds one short
gate:check entry a job when checks are on). Its first write is
an HDEL that deletes nothing (Redis 6.2 never refuses HDEL; see claim.lua).
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local token = ARGV[1]
local ttl = int_arg(2)
local check = int_arg(3)
if token == nil or token == '' or string.find(token, '|', 1, true) then
  return redis.error_reply('delayq hold: the token must be a non-empty string without "|"')
end
if ttl == nil or ttl < 1 or check == nil or check < 0 or (#ARGV - 3) % 2 ~= 0 then
  return redis.error_reply('delayq hold: a slot TTL, a check interval and pairs of id, key expected')
end
redis.call('HDEL', KEYS[3], '')  -- the first write, never refused when full (see above)
local now = server_now()
local expiry = now + ttl
local out = {}
local earliest = nil
-- the lease entries of all the jobs, read in one HMGET
local ids = {}
for i = 4, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
end
local leases = hmget(KEYS[3], ids)
-- the held jobs' lease entries and due scores, written in one HSET and one ZADD at the end
local entries, scores = {}, {}
for i = 4, #ARGV, 2 do
  local id, key = ARGV[i], ARGV[i + 1]
  local entry = leases[(i - 2) / 2]
  local rkey = run_key(key)
  -- the slot check and its new expiry in one ZADD XX CH (ZSCORE only when the expiry was
  -- that already: CH counts no change)
  if entry and lease_holds(entry, token)
      and (redis.call('ZADD', rkey, 'XX', 'CH', expiry, id) == 1 or redis.call('ZSCORE', rkey, id)) then
    local due, tries = lease_read(entry)
    if due == nil then
      due, tries = now, 1
    end
    entries[#entries + 1] = id
    entries[#entries + 1] = lease_entry(due, tries, RUN_TOKEN)
    local score = expiry
    if check > 0 and now + check < expiry then
      score = now + check
      redis.call('HSET', G_CHECK, id, '1')
    end
    scores[#scores + 1] = score
    scores[#scores + 1] = id
    earliest = math.min(earliest or score, score)
    out[#out + 1] = 1
  elseif redis.call('ZSCORE', rkey, id) then
    if entry and lease_holds(entry, RUN_TOKEN) then
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  elseif redis.call('HEXISTS', KEYS[2], id) == 0 then
    out[#out + 1] = 2
  else
    out[#out + 1] = 0
  end
end
call_sliced('HSET', KEYS[3], entries, 2)
call_sliced('ZADD', KEYS[1], scores, 2)
if earliest then
  lower_marker(earliest)  -- a start TTL or check shorter than the lease: the safety poll must see it
end
return out
