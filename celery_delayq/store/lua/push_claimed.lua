--[[ push_claimed: push ready broker messages into their queue lists and remove the jobs, in one step.

The push path, for the messages the beat built (lua/push.lua pushes the others on claim).
Used only when the Celery broker is this same Redis server and database (kombu's
Redis transport keeps a queue as a list it LPUSHes to and its consumer BRPOPs from).
The beat builds each message exactly as kombu would; this script publishes it and
acks the job atomically, so there is no moment at which a job is both in a queue and
still stored: a beat that dies at any point duplicates nothing.

KEYS[1] due        each pushed job's member, removed
KEYS[2] jobs       each pushed job's envelope, removed
KEYS[3] leases     read (the caller's?), each pushed job's entry removed
KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the lease token the caller claimed with
ARGV[2..] triples: job id, list key (the queue, as kombu names it), message (kombu's JSON)

A job no longer holding the caller's lease (its lease expired and another beat
re-claimed it, or it was cancelled, rescheduled or replaced meanwhile) is not pushed
and not touched. The list keys are not declared in KEYS: this script is never sent
to a Redis Cluster (the queue list lives outside the shard's slot there).

Returns one entry per job, in order: 1 pushed and removed, 0 not held (nothing done),
or the error text of a refused LPUSH (the job keeps its lease and is retried).
An incomplete triple is refused with an error, before anything is written.
Unlike claim and ack, this script has no allow-oom flag, and its first write is the
LPUSH: when the broker (this Redis) is over maxmemory, the push is refused (an OOM error
text for each job) and the job keeps its lease. A message is larger than the job it
replaces (about 965 bytes against 340), and a Celery worker cannot start on a Redis over
maxmemory, nor keep a message it pops there (kombu's unacked write is refused): pushing
into a full broker would grow it and lose messages (docs/operations.md, "A full Redis").
]]
--!include lease
--!include job
if #ARGV < 1 or (#ARGV - 1) % 3 ~= 0 then
  return redis.error_reply('delayq push_claimed: messages come in triples: id, list key, message')
end
local token = ARGV[1]
local out = {}
for i = 2, #ARGV, 3 do
  local id = ARGV[i]
  if held(id, token) then
    local pushed = redis.pcall('LPUSH', ARGV[i + 1], ARGV[i + 2])
    if type(pushed) == 'table' and pushed.err then
      out[#out + 1] = pushed.err
    else
      remove_job(id)
      out[#out + 1] = 1
    end
  else
    out[#out + 1] = 0
  end
end
return out
