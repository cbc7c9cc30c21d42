--[[ due_counts: how many of one shard's jobs fall due in each span of one or more series of
equal spans (the dashboard's charts), read without changing anything.

KEYS[1] due        counted by score
(only the due set: no other key of the shard is read)

ARGV: a series of spans is three numbers, start ms, span ms, spans; one or more series follow
each other (the overview: the next hour per minute, the next 24 hours per hour).

Returns every series' counts one after the other: for each span, the members whose score lies
in [start + i * span, start + (i + 1) * span). A job being delivered counts at its lease
expiry (its score), as ZCOUNT sees it.
Cost: one ZCOUNT per span, O(log n) each, whatever the number of jobs in a span; one EVALSHA
a shard in place of one ZCOUNT a shard and span sent by the client.
]]
local out = {}
for s = 1, #ARGV, 3 do
  local start = tonumber(ARGV[s])
  local span = tonumber(ARGV[s + 1])
  for i = 0, tonumber(ARGV[s + 2]) - 1 do
    local lo = start + i * span
    out[#out + 1] = redis.call('ZCOUNT', KEYS[1], string.format('%d', lo), '(' .. string.format('%d', lo + span))
  end
end
return out
