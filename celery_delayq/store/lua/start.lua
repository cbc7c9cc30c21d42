--[[ start: may a worker start this delivery of a job? The fence where the work happens.

A beat that publishes a job it leased through kombu (not push_claimed.lua or push.lua) puts its
claim in the message (the delayq_claim header, celery_delayq/worker/starts.py). A beat paused inside
its publish may have sent copies after another beat re-claimed and re-published the job: two
claims of one stored job reach the workers. The first whose worker calls this starts; a copy
of another claim is dropped. The same claim again (a Celery retry, a redelivery after a
worker died) starts.

KEYS[1] start record of one stored job instance (its id, due and creation time are in the
        name, so a job stored again under the same id later is another record): a string
        holding the claim that started it, expiring after ARGV[2]
KEYS[2] the shard's count of copies dropped (a string, INCR)
(both with the shard's hash tag)

ARGV[1] the delivery's claim: "<tries>|<beat token>"
ARGV[2] TTL of a new record in ms (delayq_start_ttl: longer than a message waits in a queue)

Returns 1: start it (no record: this claim's record is written; or the record is this
claim's); 0: drop it (another claim of the job started first; KEYS[2] counted).
An empty claim or a TTL that is not a whole number >= 1 is refused with an error, before
anything is written. A full Redis refuses the first write (the caller then starts the task).
]]
--!include args
local claim = ARGV[1]
local ttl = int_arg(2)
if claim == nil or claim == '' or ttl == nil or ttl < 1 then
  return redis.error_reply('delayq start: a non-empty claim and a TTL >= 1 ms expected')
end
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], claim, 'PX', ttl)
  return 1
end
if held == claim then
  return 1
end
redis.call('INCR', KEYS[2])
return 0
