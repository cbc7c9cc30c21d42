--[[ get: read one job (or dead letter) by id without changing anything.

KEYS[1] due        the job's score, read
KEYS[2] jobs       the job's envelope, read
KEYS[3] leases     the job's entry, read
KEYS[5] dead       the dead letter, read when no job has the id
KEYS[4] wake, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] job id

Returns
  nil                                           no such job
  {"job", envelope, due ms, tries, lease until}  a stored job; tries is 0 and
      lease until is -1 unless a beat holds it (lease until is then the ms at
      which the lease expires, and due ms is the original due time; for a lease
      entry that does not read, due ms is the score and tries 0)
  {"job", envelope, due ms, tries, score, token}  a gated job: token "gate" (held
      back by the gate: parked or deferred; score is PARK_MS or the deferral) or
      "run" (its task runs; score is its slot expiry)
  {"dead", record}                               a dead-lettered job
]]
--!include lease
local id = ARGV[1]
local envelope = redis.call('HGET', KEYS[2], id)
if envelope then
  local score = tonumber(redis.call('ZSCORE', KEYS[1], id))
  local lease = redis.call('HGET', KEYS[3], id)
  if lease then
    local d, n = lease_read(lease)
    if d then
      if lease_holds(lease, 'gate') or lease_holds(lease, 'run') then
        return {'job', envelope, d, n, score, string.match(lease, '([^|]*)$')}
      end
      return {'job', envelope, d, n, score}
    end
    return {'job', envelope, score, 0, score}
  end
  return {'job', envelope, score, 0, -1}
end
local record = redis.call('HGET', KEYS[5], id)
if record then
  return {'dead', record}
end
return nil
