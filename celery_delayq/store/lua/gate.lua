--[[ gate: decide, for claimed gated jobs of one shard, which are released now.

KEYS[1] due        a parked job's score becomes PARK_MS, a deferred one's the time its rate allows
KEYS[2] jobs       read (is a slot's job still stored?)
KEYS[3] leases     read (held by the caller?); a parked or deferred job's entry gets token "gate"
KEYS[4] wake       lowered (with a wake message on ARGV[3]) to a deferred job's time, and when
                   a purge of expired slots lets parked jobs through
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
Not in KEYS (built from KEYS[1], same hash tag, so same cluster slot; see includes/gate.lua):
gate:keys, gate:rates, gate:booked, gate:check, gate:run:<key>, gate:wait:<key>.

ARGV[1] token: the beat's lease token (no "|")
ARGV[2] slot TTL ms: how long a released job's slot lasts unless its worker renews it
ARGV[3] wake channel, ARGV[4] shard index
ARGV[5..] six per job: id, key, limit ("" none), rate count ("" none), rate period ms ("" none),
          priority (0-255)

"now" is the server's TIME. For each job, in order:
- not held by the token (re-claimed, cancelled, replaced) -> "not-held", nothing done for it.
- at the first job of its key in the call, up to 10 expired slots of gate:run:<key> whose
  job is gone (cancelled while running, its worker dead) are removed; when some were, the
  key's parked jobs are promoted (as release.lua does) after this job's decision.
- its id is in gate:run:<key>, its slot has not expired and its id was in gate:check (hold.lua
  made this claim a check of a job whose message waits for a worker) -> "held": the lease
  entry is "run" again (due, tries - 1), the slot is left as it is, and the due score is
  now + TTL (with the id in gate:check again) or the slot's expiry when that comes first.
  The beat has looked in the result backend before (publish.py): a task found finished
  there was released as its worker would have released it, and is not gated.
- its id is in gate:run:<key> otherwise (a redelivery: its worker died, the slot expired, a
  claim took it again) -> "released", its one slot kept (expiry now + TTL).
- the key is paused, or the limit in force (its run-time override in gate:keys: a number, or
  "none" for no cap; else the job's limit; else no cap) <= the key's running slots -> "parked": score
  PARK_MS, lease entry (due, tries - 1, "gate"), listed in gate:wait:<key> by priority then due.
  With the first job of its key parked in this call come up to 10 *suspects* (the other
  parked jobs of the key in the call come without: the caller looks at a slot once): among the 50 slots of the key that expire last (those of
  jobs waiting for their worker, whose start TTL is the longest), those not expired whose job
  is gone (cancelled while its message waited, or a store restored from a snapshot in which
  it was), as id and slot expiry; the beat asks the result backend whether their task ended
  (publish.py), and gives such a slot back (release.lua) instead of waiting for its expiry.
- a rate is given and the job has not booked a release time (below) and the key's arrival
  time (GCRA, gate:rates) is after now -> "deferred": the job books that time (gate:booked),
  the arrival time moves on by period / count, and the job's score and ms = the booked time,
  lease entry (due, tries - 1, "gate"), the wake marker lowered to it; claimed again then, it
  is not deferred again (its booking is used up). So n jobs of a key due at once are spread
  period / count apart with one deferral each, and a backlog runs at exactly the rate (the
  next time counts from the last booked one, not from when a beat came to claim it). A job
  with no rate to wait for moves the arrival time to max(it, now) + period / count.
- else "released": ZADD gate:run:<key> now + TTL (the lease stays the beat's until hold.lua).
Every key seen is written to gate:keys with the job's limit ("" none; its override and pause
kept: includes/gate.lua key_entry): promotion reads it.

Returns one {code, ms, ...} per job: code "released" | "parked" | "deferred" | "held" |
"not-held"; ms is the time a deferred job is due again, else 0; a parked job's entry goes on
with its suspects, id and slot expiry ms in turn.
Memory: no allow-oom flag: a full Redis refuses the script at its first write (the HSET of
gate:keys after one HMGET of it, which may grow memory), before anything is written; each job keeps its beat lease
and is claimed and gated again once that lease expires.
Bad input (a token with "|", a TTL, shard, limit, rate or priority that is not a whole number
in range, a key gate.check_key refuses, a count of arguments that is not 4 + 6n) is refused
with an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include gate
local token = ARGV[1]
local ttl = int_arg(2)
local channel = ARGV[3]
local shard = int_arg(4)
if token == nil or token == '' or string.find(token, '|', 1, true) then
  return redis.error_reply('delayq gate: the token must be a non-empty string without "|"')
end
if ttl == nil or ttl < 1 or shard == nil or shard < 0 or (#ARGV - 4) % 6 ~= 0 then
  return redis.error_reply('delayq gate: slot TTL, shard and 6 arguments a job expected')
end
local function optional(i, low, high)
  if ARGV[i] == '' then
    return true
  end
  local n = int_arg(i)
  return n ~= nil and n >= low and n <= high
end
local seen = {}
for i = 5, #ARGV, 6 do
  local prio = int_arg(i + 5)
  if ARGV[i] == '' or not gate_key_ok(ARGV[i + 1]) or not optional(i + 2, 1, 1e15)
      or not optional(i + 3, 1, 1e15) or not optional(i + 4, 1, 1e15)
      or (ARGV[i + 3] == '') ~= (ARGV[i + 4] == '') or prio == nil or prio < 0 or prio > 255 then
    return redis.error_reply('delayq gate: job ' .. tostring((i - 5) / 6 + 1) .. ' has a bad id, key, limit, rate or priority')
  end
  seen[#seen + 1] = ARGV[i + 1]
  seen[#seen + 1] = ARGV[i + 2]
end
if #seen == 0 then
  return {}
end
local known = seen_keys(seen, true)  -- its HSET is the first write (see Memory above)
local now = server_now()
local expiry = now + ttl
local out = {}
local suspected = {}  -- keys whose suspects a parked job of this call brought already
local swept = {}  -- keys whose expired slots this call purged already
-- known: key -> {override, paused, running}: its override and pause, read once a call with
-- its gate:keys entry (nothing in the call changes them), and its slots' count, read once and
-- then counted here (the call's only change to it is a slot given to a job that had none;
-- purge runs before)
for i = 5, #ARGV, 6 do
  local id, key, limit = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local entry = redis.call('HGET', KEYS[3], id)
  if not (entry and lease_holds(entry, token)) then
    out[#out + 1] = {'not-held', 0}
  else
    local rkey = run_key(key)
    local purged = 0
    if not swept[key] then  -- once a key a call: a gate call deletes no job, so a second finds none
      swept[key] = true
      purged = purge(key, now)
    end
    local due, tries = lease_read(entry)
    if due == nil then
      due, tries = now, 1
    end
    local held_back = math.max(tries - 1, 0)
    local slot = tonumber(redis.call('ZSCORE', rkey, id))
    -- only a job with a slot has a gate:check entry (hold.lua; release.lua and purge drop it)
    local check = slot ~= nil and redis.call('HDEL', G_CHECK, id) == 1
    if slot and check and slot > now then
      redis.call('HSET', KEYS[3], id, lease_entry(due, held_back, RUN_TOKEN))
      local score = slot
      if now + ttl < slot then
        score = now + ttl
        redis.call('HSET', G_CHECK, id, '1')
      end
      redis.call('ZADD', KEYS[1], score, id)
      lower_marker(score)
      out[#out + 1] = {'held', 0}
    elseif slot then
      redis.call('ZADD', rkey, expiry, id)
      out[#out + 1] = {'released', 0}
    else
      local k = known[key]
      local cap = limit_from(k.override, limit)
      if cap ~= nil and not k.paused and k.running == nil then
        k.running = redis.call('ZCARD', rkey)
      end
      if k.paused or (cap ~= nil and cap <= k.running) then
        redis.call('ZADD', KEYS[1], PARK_TEXT, id)
        redis.call('HSET', KEYS[3], id, lease_entry(due, held_back, GATE_TOKEN))
        redis.call('ZADD', wait_key(key), wait_score(int_arg(i + 5), due), id)
        local parked = {'parked', 0}
        local slots = {}
        if not suspected[key] then  -- the first job of the key parked in this call brings them
          suspected[key] = true
          slots = redis.call('ZRANGE', rkey, '+inf', string.format('(%d', now), 'BYSCORE', 'REV',
            'LIMIT', 0, 50, 'WITHSCORES')
        end
        for j = 1, #slots, 2 do
          if #parked >= 22 then
            break
          end
          if redis.call('HEXISTS', KEYS[2], slots[j]) == 0 then
            parked[#parked + 1] = slots[j]
            parked[#parked + 1] = slots[j + 1]
          end
        end
        out[#out + 1] = parked
      else
        local deferred = nil
        if ARGV[i + 3] ~= '' and redis.call('HDEL', G_BOOKED, id) == 0 then
          local tat = tonumber(redis.call('HGET', G_RATES, key)) or 0
          local interval = int_arg(i + 4) / int_arg(i + 3)
          if tat > now then
            deferred = math.ceil(tat)
            redis.call('HSET', G_BOOKED, id, deferred)
            tat = tat + interval
          else
            tat = math.max(tat, now) + interval
          end
          redis.call('HSET', G_RATES, key, string.format('%.3f', tat))
        end
        if deferred then
          redis.call('ZADD', KEYS[1], deferred, id)
          redis.call('HSET', KEYS[3], id, lease_entry(due, held_back, GATE_TOKEN))
          wake(channel, shard, deferred)
          out[#out + 1] = {'deferred', deferred}
        else
          redis.call('ZADD', rkey, expiry, id)
          if k.running ~= nil then
            k.running = k.running + 1  -- a new member: this job had no slot
          end
          out[#out + 1] = {'released', 0}
        end
      end
    end
    if purged > 0 then
      promote(key, channel, shard, now)
    end
  end
end
return out
