#!lua flags=allow-oom
--[[ slot_renew: a worker keeps the slots of its running gated tasks.

KEYS[1] due        a running job's score (its slot expiry) becomes now + TTL
KEYS[3] leases     read (is the job held back, token "gate"?); a beat's entry becomes "run"
KEYS[4] wake       lowered to the new expiry when that is earlier (includes/wake.lua): the
                   slot TTL is shorter than the start TTL hold.lua gave
KEYS[2] jobs, KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag: see includes/gate.lua): gate:run:<key>,
gate:check.

ARGV[1] slot TTL ms
ARGV[2..] pairs: job id, gate key

For each job with a slot in gate:run:<key>: its slot expiry becomes now + TTL, and so does
its due score, unless the gate holds the job back (lease token "gate"). Its worker calls this
when the task starts and then every third of the TTL, so a lease entry that is still the
beat's (the task started before the beat's hold.lua) becomes the "run" one (due and tries
kept): the start TTL hold.lua gave (a message waiting for a worker) is over, and a worker
that dies is noticed after this TTL.
Returns one entry per pair: 1 renewed, 0 no slot (released, or purged).
Runs when Redis is over maxmemory (it rewrites scores, and lease entries with a token no
longer than before). Its first write is the HDEL of the first job's gate:check entry
(Redis 6.2 never refuses HDEL; see claim.lua).
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local ttl = int_arg(1)
if ttl == nil or ttl < 1 or (#ARGV - 1) % 2 ~= 0 then
  return redis.error_reply('delayq slot_renew: a slot TTL and pairs of id, key expected')
end
local expiry = server_now() + ttl
local out = {}
local renewed = false
for i = 2, #ARGV, 2 do
  local id, key = ARGV[i], ARGV[i + 1]
  local rkey = run_key(key)
  redis.call('HDEL', G_CHECK, id)  -- started: no more checks (hold.lua); the first write (above)
  -- the slot check and its new expiry in one ZADD XX CH (ZSCORE only when the expiry was
  -- that already: CH counts no change)
  if redis.call('ZADD', rkey, 'XX', 'CH', expiry, id) == 1 or redis.call('ZSCORE', rkey, id) then
    local entry = redis.call('HGET', KEYS[3], id)
    if entry and not lease_holds(entry, GATE_TOKEN) then
      if not lease_holds(entry, RUN_TOKEN) then
        local due, tries = lease_read(entry)
        if due then
          redis.call('HSET', KEYS[3], id, lease_entry(due, tries, RUN_TOKEN))
        end
      end
      redis.call('ZADD', KEYS[1], expiry, id)
      renewed = true
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if renewed then
  lower_marker(expiry)
end
return out
