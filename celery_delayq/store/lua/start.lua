--[[ start: may a worker start this delivery of a job? The fence where the work happens.

A beat that publishes a job it leased through kombu (not push_claimed.lua or push.lua) puts its
claim in the message (the delayq_claim header, celery_delayq/worker/starts.py). A beat paused inside
its publish may have sent copies after another beat re-claimed and re-published the job: two
claims of one stored job reach the workers. The first whose worker calls this starts; a copy
of another claim is dropped. The same claim again (a Celery retry, a redelivery after a
worker died) starts.

The records are fields of hashes, one hash per shard, time bucket and part: a bucket is
W = 2^k s of the server's TIME, the least W (>= 1 s) with ARGV[2] <= 8 W, and each hash
expires ARGV[2] after its bucket ends (set at each write: the same time for every writer of
one TTL), so a record is kept at least ARGV[2] and a whole bucket goes at once. A record
written in bucket b is looked for in the buckets now - ceil(ARGV[2] / W) .. now (at most 9).
The names, <base>starts:<W s>:<bucket>:<part>, are built from KEYS[2] ("<base>starts:dropped"
minus "dropped": the shard's hash tag, so its cluster slot; ShardKeys.start_records).

KEYS[1] start record of the form before the hashes (a string holding the claim, one key a
        job instance: ShardKeys.started), only read: a job started by a worker of an earlier
        version is recognised until its key expires
KEYS[2] the shard's count of copies dropped (a string, INCR)
(both with the shard's hash tag)

ARGV[1] the delivery's claim: "<tries>|<beat token>" (compared with KEYS[1] only)
ARGV[2] TTL of a new record in ms (delayq_start_ttl: longer than a message waits in a queue)
ARGV[3] the job instance's part (0..255), ARGV[4] its field, ARGV[5] the claim's mark: the
        digests of keys.start_record (8 and 4 bytes)

Returns 1: start it (no record: this claim's record is written; or the record is this
claim's); 0: drop it (another claim of the job started first; KEYS[2] counted).
An empty claim, field or mark, a part that is not a whole number >= 0 or a TTL that is not a
whole number >= 1 is refused with an error, before anything is written. A full Redis refuses
the script (the caller then starts the task).
]]
--!include args
local claim, field, mark = ARGV[1], ARGV[4], ARGV[5]
local ttl, part = int_arg(2), int_arg(3)
if claim == nil or claim == '' or ttl == nil or ttl < 1 or part == nil or part < 0
    or field == nil or field == '' or mark == nil or mark == '' then
  return redis.error_reply('delayq start: a non-empty claim, a TTL >= 1 ms and a record (part, field, mark) expected')
end
local base = string.sub(KEYS[2], 1, #KEYS[2] - 7)
local width = 1000
while width * 8 < ttl do
  width = width * 2
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local bucket = math.floor(now / width)
local function records(b)
  return string.format('%s%d:%d:%d', base, width / 1000, b, part)
end
local held = nil
for b = bucket, bucket - math.ceil(ttl / width), -1 do
  held = redis.call('HGET', records(b), field)
  if held then
    break
  end
end
local same = mark
if not held then
  held = redis.call('GET', KEYS[1])
  same = claim
end
if not held then
  local key = records(bucket)
  redis.call('HSET', key, field, mark)
  redis.call('PEXPIRE', key, (bucket + 1) * width + ttl - now)
  return 1
end
if held == same then
  return 1
end
redis.call('INCR', KEYS[2])
return 0
