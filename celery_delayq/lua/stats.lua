--[[ stats: one shard's counts for `celery delayq status`, read without changing anything.

KEYS[1] due        counted, and read by score
KEYS[3] leases     counted, and read for the head's due time
KEYS[5] dead       counted
KEYS[6] schedules  counted
KEYS[2] jobs, KEYS[4] wake, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

No ARGV. "now" is the server's TIME, as in claim.lua.

Returns {now ms, stored, leased, dead, schedules, overdue,
         head due ms, head id, next due ms, next id}
  stored     members of due: waiting and leased jobs
  leased     lease entries (jobs a beat holds, including expired leases not yet re-claimed)
  dead       dead letters
  schedules  recurring schedules whose definition lives on this shard
  overdue    members with score <= now: waiting jobs past their due time, and leased
             jobs whose lease expired (their holder died or stalled); no live beat holds them
  head       the overdue member a claim takes first (lowest score): its due time (the
             original due time of an expired lease) and id; -1 and "" when nothing is overdue
  next       the waiting job due soonest after now: its due time and id; -1 and "" when
             none. Members held by a live lease (their score is the lease expiry) are
             skipped, at most one per lease entry, so the walk is bounded by `leased`.
Cost: ZCARD, three HLEN, ZCOUNT, and ZRANGE BYSCORE ... LIMIT pages: O(log n + leased).
]]
--!include lease
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stored = redis.call('ZCARD', KEYS[1])
local leased = redis.call('HLEN', KEYS[3])
local out = {now, stored, leased, redis.call('HLEN', KEYS[5]), redis.call('HLEN', KEYS[6]),
             redis.call('ZCOUNT', KEYS[1], '-inf', now), -1, '', -1, ''}
local head = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if head[1] then
  local due = tonumber(head[2])
  local lease = redis.call('HGET', KEYS[3], head[1])
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
local page = 100
local offset = 0
while true do
  local found = redis.call('ZRANGE', KEYS[1], '(' .. string.format('%d', now), '+inf', 'BYSCORE', 'LIMIT', offset, page, 'WITHSCORES')
  for i = 1, #found, 2 do
    if redis.call('HEXISTS', KEYS[3], found[i]) == 0 then
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
