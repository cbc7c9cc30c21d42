-- claiming: take a shard's due jobs and lease to a beat those it is to deliver (claim.lua, push.lua).
--
-- now_ms(): the server's TIME in ms (never a client's clock).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- due_jobs(now, batch): reads only. Up to batch jobs of KEYS[1] (due) with score <= now, which
-- includes leases that expired because their holder died, each {id, envelope, due, tries, leased,
-- let_go}:
-- due (ms, as text) and tries from its lease entry (KEYS[3], includes/lease.lua; the pattern of
-- lease_read, the due time kept as text) when it has one, else its score and 0. Then the members
-- whose envelope (KEYS[2]) is missing; and repaired: how many lease entries did not read (corrupt:
-- taken as an expired lease of unknown history, so the score and 0). let_go: for a job flow
-- control held back (its lease entry's token is "gate": parked, or deferred by its rate), its
-- score as text: when flow control let it go (includes/gate.lua promote: that time less the
-- job's priority; a deferred job: its booked time); nil for any other job. One HLEN saves the
-- leases' HMGET when no job of the shard is leased.
local function due_jobs(now, batch)
  local found = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, batch, 'WITHSCORES')
  local ids = {}
  for i = 1, #found, 2 do
    ids[#ids + 1] = found[i]
  end
  local envelopes = hmget(KEYS[2], ids)
  local leases = redis.call('HLEN', KEYS[3]) > 0 and hmget(KEYS[3], ids) or {}
  local jobs, gone, repaired = {}, {}, 0
  for i, id in ipairs(ids) do
    local lease = leases[i]
    if not envelopes[i] then
      gone[#gone + 1] = id
    else
      local job = {id = id, envelope = envelopes[i], due = found[i + i], tries = 0, leased = lease}
      if lease then
        local d, n = string.match(lease, '^(%-?%d+)|(%d+)|')
        if d then
          job.due, job.tries = d, tonumber(n)
          if string.sub(lease, -5) == '|gate' then
            job.let_go = found[i + i]
          end
        else
          repaired = repaired + 1
        end
      end
      jobs[#jobs + 1] = job
    end
  end
  return jobs, gone, repaired
end
-- hand_over(out, jobs, gone, token, expiry): remove the members in gone with their lease entries;
-- lease each job of jobs to token until expiry (its score; its entry: its due time, tries + 1 and
-- the token; the entries in one HSET, the scores in one ZADD) and append its id, envelope, due ms
-- and tries to out (due ms as a number; for a job with a let_go, the text "<due ms>:<let_go>");
-- then rearm the wake marker (includes/wake.lua) and set out[2] to the next
-- score. Returns out.
local function hand_over(out, jobs, gone, token, expiry)
  call_sliced('ZREM', KEYS[1], gone, 1)
  call_sliced('HDEL', KEYS[3], gone, 1)
  local zargs, entries = {}, {}
  for _, job in ipairs(jobs) do
    local tries = job.tries + 1
    entries[#entries + 1] = job.id
    entries[#entries + 1] = lease_entry(job.due, tries, token)
    zargs[#zargs + 1] = expiry
    zargs[#zargs + 1] = job.id
    out[#out + 1] = job.id
    out[#out + 1] = job.envelope
    if job.let_go then
      out[#out + 1] = job.due .. ':' .. job.let_go
    else
      out[#out + 1] = tonumber(job.due)
    end
    out[#out + 1] = tries
  end
  call_sliced('HSET', KEYS[3], entries, 2)
  call_sliced('ZADD', KEYS[1], zargs, 2)
  out[2] = rearm()
  return out
end
