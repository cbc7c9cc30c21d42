--[[ shapes_sweep: drop a shard's shapes hash when the shard holds no job.

KEYS[2] jobs: read (is it empty?)
KEYS[1] due, KEYS[3] leases, KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not
used here (the shard's seven keys, in the order every script takes them)
KEYS[8] shapes: the shard's shapes hash (stored_forms.py, shared_form; written by enqueue.lua with
the jobs that use them)

A shape is only read for a job stored with its id, and enqueue.lua writes a job's shape in the
same step as the job: so when the jobs hash is empty no shape is in use, and dropping the hash
here, in one step, loses nothing. Returns 1 when it was dropped, else 0.
]]
-- (PEXPIRE with 0 deletes the key at once, and the documented ACL rule has it, not DEL)
if redis.call('HLEN', KEYS[2]) == 0 then
  return redis.call('PEXPIRE', KEYS[8], 0)
end
return 0
