--[[ requeue: put a dead-lettered job back as a waiting job, removing its dead letter.

KEYS[1] due        the job's member added
KEYS[2] jobs       read (is the id free?), then the envelope stored
KEYS[3] leases     a stray entry for the id is removed
KEYS[4] wake       lowered (with a wake message) when the job is due before it
KEYS[5] dead       the dead letter, read and then removed
KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] job id
ARGV[2] due time in ms
ARGV[3] the opening of an envelope that carries this id ('{"v":3,"i":<id as JSON>,'):
        an envelope that opens with it is stored without its id, as enqueue stores it
ARGV[4] wake channel
ARGV[5] shard index, echoed in the wake message

The envelope is the one kept in the dead-letter record. The job starts afresh:
no lease, tries counted from zero.

Returns
  1  requeued: the job waits in the shard, due at ARGV[2]; the dead letter is gone
  0  no dead letter with this id
  2  refused: a job with this id is stored (waiting or being delivered); requeueing
     would replace it. The dead letter is kept.
  3  refused: the dead-letter record holds no envelope. The dead letter is kept.
Requeueing earlier than the wake marker wakes a sleeping beat, as enqueue does.
A due time that is not a whole number of ms is refused with an error; nothing is written.
]]
--!include args
--!include wake
local id = ARGV[1]
local due = int_arg(2)
if due == nil then
  return redis.error_reply('delayq requeue: due time is not a whole number of ms: ' .. tostring(ARGV[2]))
end
local raw = redis.call('HGET', KEYS[5], id)
if not raw then
  return 0
end
if redis.call('HEXISTS', KEYS[2], id) == 1 then
  return 2
end
local ok, record = pcall(cjson.decode, raw)
if not ok or type(record) ~= 'table' or type(record.envelope) ~= 'string' or record.envelope == '' then
  return 3
end
local envelope = record.envelope
local opening = ARGV[3]
if string.sub(envelope, 1, #opening) == opening then
  envelope = string.sub(opening, 1, 7) .. string.sub(envelope, #opening + 1)  -- '{"v":3,' and the rest
end
redis.call('HSET', KEYS[2], id, envelope)
redis.call('HDEL', KEYS[3], id)
redis.call('ZADD', KEYS[1], due, id)
redis.call('HDEL', KEYS[5], id)
wake(ARGV[4], ARGV[5], due, ARGV[2])
return 1
