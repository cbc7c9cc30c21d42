--[[ gate_admin: change a gate key's limit or pause it, then let its parked jobs go.

KEYS[1] due        promoted jobs' scores set to now - priority
KEYS[2] jobs       read (is a parked job still stored?)
KEYS[4] wake       lowered (with a wake message) when jobs were promoted
KEYS[3] leases, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:keys,
gate:run:<key>, gate:wait:<key>.

ARGV[1] op: "limit" (override = ARGV[3], a whole number >= 1), "unlimit" (override "none":
        no cap), "clear" (no override: each job's own limit), "pause", "resume"; the override
        and the pause are kept in the key's gate:keys entry (includes/gate.lua key_entry)
ARGV[2] gate key, ARGV[3] value (the limit; "" otherwise)
ARGV[4] wake channel, ARGV[5] shard index

The key is recorded in gate:keys (its own limit "" when it was not there) so it is listed. Every op
then purges the key's expired slots whose job is gone and promotes its parked jobs into its
free slots (none while it is paused): an operator's resume or limit frees a key whose slots a
cancelled job's dead worker kept. A lowered
limit takes effect for the next jobs gated: running ones finish.
Returns how many parked jobs were promoted.
No allow-oom flag: a full Redis refuses it before anything is written.
Bad input is refused with an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local op, key = ARGV[1], ARGV[2]
local limit = int_arg(3)
local shard = int_arg(5)
if not gate_key_ok(key) or shard == nil or shard < 0 or ARGV[4] == nil then
  return redis.error_reply('delayq gate_admin: op, key, value, wake channel and shard expected')
end
if op == 'limit' then
  if limit == nil or limit < 1 then
    return redis.error_reply('delayq gate_admin: a limit must be a whole number >= 1')
  end
elseif op ~= 'unlimit' and op ~= 'clear' and op ~= 'pause' and op ~= 'resume' then
  return redis.error_reply('delayq gate_admin: op must be limit, unlimit, clear, pause or resume')
end
local own, override, paused = key_read(redis.call('HGET', G_KEYS, key))
if op == 'limit' then
  override = string.format('%d', limit)
elseif op == 'unlimit' then
  override = 'none'
elseif op == 'clear' then
  override = nil
elseif op == 'pause' then
  paused = true
else
  paused = false
end
-- the first write: refused when full
redis.call('HSET', G_KEYS, key, key_entry(own, override, paused))
return promote(key, ARGV[4], shard, server_now())
