#!lua flags=allow-oom
--[[ cancel: remove one job by id.

KEYS[1] due        the job's member, removed (its score read first)
KEYS[2] jobs       read (is it stored?), then removed
KEYS[3] leases     read, then removed; whether there was one is the reply (2 or 1)
KEYS[4] wake       lowered (with a wake message) when parked jobs were promoted (below)
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:keys,
gate:run:<key>, gate:wait:<key> of a gated job's key.

ARGV[1] job id, ARGV[2] wake channel, ARGV[3] shard index

A gated job a release promoted (lease token "gate", its score no longer PARK_MS: due for a
claim to give it its key's free slot) carries that slot's turn: removed before a claim, the
key's other parked jobs would wait for a release that never comes. So when such a job is
removed, its key (read from its id, "{<key>}...": gate.gated_id) is promoted as a release
promotes it (includes/gate.lua promote: its parked jobs into its free slots).

Returns
  0  no such job
  1  removed while waiting (a gated job parked, deferred or promoted included: its entry is
     "gate", not a beat's): it will never be published
  2  removed while a beat held it: it is being delivered now and may already
     be in the broker; the holder's ack will find nothing and no beat will
     deliver it again
Runs when Redis is over maxmemory: it deletes, and a promotion only moves scores.
Bad input (no channel, a shard that is not a whole number) is refused before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include job
--!include wake
--!include gate
local id = ARGV[1]
local shard = int_arg(3)
if id == nil or ARGV[2] == nil or shard == nil or shard < 0 then
  return redis.error_reply('delayq cancel: id, wake channel and shard expected')
end
if redis.call('HEXISTS', KEYS[2], id) == 0 then
  return 0
end
local entry = redis.call('HGET', KEYS[3], id)
local gated = entry and lease_holds(entry, GATE_TOKEN)
local promoted_key = nil
if gated and tonumber(redis.call('ZSCORE', KEYS[1], id)) ~= PARK_MS then
  promoted_key = string.match(id, '^{([^{}|]+)}')
end
remove_job(id)
if promoted_key and gate_key_ok(promoted_key) then
  promote(promoted_key, ARGV[2], shard, nil)
end
if entry and not gated then
  return 2
end
return 1
