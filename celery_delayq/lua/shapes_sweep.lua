--[[ shapes_sweep: drop a shard's shapes hash when the shard holds no job.

KEYS[1..7] the shard's seven keys (KEYS[2] jobs is read); KEYS[8] its shapes hash
(envelope.py, shared_form; written by enqueue.lua with the jobs that use them)

A shape is only read for a job stored with its id, and enqueue.lua writes a job's shape in the
same step as the job: so when the jobs hash is empty no shape is in use, and dropping the hash
here, in one step, loses nothing. Returns 1 when it was dropped, else 0.
]]
if redis.call('HLEN', KEYS[2]) == 0 then
  return redis.call('DEL', KEYS[8])
end
return 0
