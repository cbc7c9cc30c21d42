#!lua flags=allow-oom
--[[ renew: extend the leases a beat still holds, just before it publishes (the fence).

KEYS[1] due        each held job's score set to its new lease expiry (ZADD XX)
KEYS[3] leases     read (the caller's?), never written
KEYS[2] jobs, KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the lease token the caller claimed with
ARGV[2] reclaim TTL in ms: the renewed leases expire at the server's now + TTL
ARGV[3..] job ids

A job whose lease entry still ends with the caller's token gets score now + TTL in the due
set (ZADD XX: a job no longer in it is not added back); its lease entry is left as it is
(due time, tries, token). Any other job (re-claimed by another beat after the lease
expired, cancelled, replaced, or already delivered) is left alone: the caller must not
publish it. "now" is the server's TIME.

Memory: runs when Redis is over maxmemory (a fenced beat in front of a full store must go
on delivering); it only changes scores. Its first write is an HDEL that deletes nothing,
which Redis 6.2 (no script flags) never refuses, as in claim.lua.

Returns {now ms, flag, flag, ...}: one flag per id in ARGV order, 1 held (renewed), 0 not.
A token holding "|" or a TTL that is not a whole number >= 1 is refused with an error,
before anything is written.
]]
--!include args
--!include lease
local token = ARGV[1]
local ttl = int_arg(2)
if token == nil or token == '' or string.find(token, '|', 1, true) then
  return redis.error_reply('delayq renew: the token must be a non-empty string without "|"')
end
if ttl == nil or ttl < 1 then
  return redis.error_reply('delayq renew: the TTL must be a whole number >= 1')
end
redis.call('HDEL', KEYS[3], '')  -- the first write, never refused when full (see above)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = now + ttl
local out = {now}
for i = 3, #ARGV do
  local id = ARGV[i]
  if held(id, token) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
