#!lua flags=allow-oom
--[[ ack: remove delivered jobs, each only while it still holds the caller's lease.

KEYS[1] due        each removed job's member
KEYS[2] jobs       each removed job's envelope
KEYS[3] leases     read (is "|<token>" its end?), then the entry removed
KEYS[4] wake, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)

ARGV[1] token: the lease token the caller claimed with
ARGV[2..] job ids

A job that was re-claimed by another beat (its lease expired), rescheduled,
replaced or cancelled since no longer holds this token and is left alone, so a
stale claimer never deletes work it does not own.

Returns an array with one entry per id in ARGV order: 1 removed, 0 left alone.
Runs when Redis is over maxmemory: it only deletes.
]]
--!include lease
--!include job
local token = ARGV[1]
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  if held(id, token) then
    remove_job(id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
