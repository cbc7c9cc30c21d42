#!lua flags=allow-oom
--[[ claim: lease a bounded batch of due jobs of one shard to one beat.

KEYS[1] due        read by score; each taken job's score becomes its lease expiry
KEYS[2] jobs       each taken job's envelope, read
KEYS[3] leases     each taken job's entry (includes/lease.lua), read then written
KEYS[4] wake       set to the earliest score left (or WAKE_NEVER)
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the claimer's lease token (no "|" in it)
ARGV[2] batch: most jobs to take
ARGV[3] reclaim TTL in ms: how long the lease lasts
ARGV[4..9] optional, the gate in the claim (includes/gating.lua): slot TTL ms, park ("1"/"0"),
        wake channel, shard index, gate header name, batch completion header name

"now" is the server's TIME, never a client clock. Each due job (score <= now,
which includes leases that expired because their holder died) gets score
now + TTL and a lease entry holding its original due time, its delivery count
and the token. A member whose envelope is missing is dropped.

Returns {now ms, next ms, repaired, id, envelope, due ms, tries, id, envelope, ...}
(due ms: "<due ms>:<score>" for a job flow control held back, its old lease's token "gate":
its score is when it was let go; see includes/claiming.lua)
(with ARGV[4..9]: {now ms, next ms, repaired, {parked, id, key, ...}, id, envelope, ...}: how
many due capped jobs the claim parked, and the ids and keys of those it gave a slot, which are
among the jobs returned; see includes/gating.lua)
where next is the earliest score left in the shard after the claim (a lease
expiry counts: that is when it may need re-claiming), or -1 when the shard is
empty. The wake marker is set to next (or far future when empty).

A lease entry that does not read as "<due ms>|<tries>|<token>" (corrupt data) is
treated as an expired lease of unknown history: the job is claimed with its score
as its due time (its score is <= now, so whatever it held is over) and tries 1,
and the entry is replaced by a valid lease. repaired counts those entries, so the
caller can report them; one bad entry never makes the claim (and its shard) fail.
Memory: a claim runs when Redis is over maxmemory (it is how a full store drains): its
net growth is one lease entry per job taken, at most ARGV[2] per call (see
docs/operations.md), and with the gate in the claim one slot or waiting-list entry per capped
job it gates. Its first write is an HDEL that deletes nothing (no job has the
empty id): Redis 6.2, which has no script flags, refuses only a script's first write
when full, and never refuses HDEL (a command the documented ACL user already has).
A token holding "|" or a batch or TTL that is not a whole number >= 1 is refused
with an error, before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include claiming
--!include gate
--!include gating
local token = ARGV[1]
local batch = int_arg(2)
local ttl = int_arg(3)
if token == nil or token == '' or string.find(token, '|', 1, true) then
  return redis.error_reply('delayq claim: the token must be a non-empty string without "|"')
end
local g = gating_args(4)
if batch == nil or batch < 1 or ttl == nil or ttl < 1 or g == false then
  return redis.error_reply('delayq claim: batch and TTL must be whole numbers >= 1 (and the gating arguments read)')
end
redis.call('HDEL', KEYS[3], '')  -- the first write, never refused when full (see above)
local now = now_ms()
local jobs, gone, repaired = due_jobs(now, batch)
return hand_over_gated({now, -1, repaired}, jobs, gone, token, now, ttl, g)
