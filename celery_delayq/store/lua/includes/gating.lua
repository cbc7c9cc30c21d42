-- gating: the gate inside a claim (claim.lua, push.lua): a due capped job whose key has a free
-- slot is given it by the claim itself, and one whose key is full is parked there, so neither
-- goes through gate.lua (docs/flow-control.md, "The gate in the claim").
--
-- Needs the includes args, sliced, lease, wake and gate before it.
--
-- gating_args(i): the gating arguments from ARGV[i] on: slot TTL ms, park ("1": a job whose key
-- is full is parked here; "0": it is handed to the beat, whose gate.lua parks it and names the
-- slots to look up in the result backend), wake channel, shard index, gate header name, batch
-- completion header name. Returns them as a table, nil when ARGV[i] is absent (no gating: the
-- claim is as before), or false when they do not read (the caller refuses the call).
local function gating_args(i)
  if ARGV[i] == nil then
    return nil
  end
  local ttl, shard = int_arg(i), int_arg(i + 3)
  local park, channel, header, done = ARGV[i + 1], ARGV[i + 2], ARGV[i + 4], ARGV[i + 5]
  if ttl == nil or ttl < 1 or shard == nil or shard < 0 or (park ~= '0' and park ~= '1')
      or channel == nil or header == nil or header == '' or done == nil or done == '' then
    return false
  end
  return {ttl = ttl, park = park == '1', channel = channel, shard = shard,
    header = '"' .. header .. '":{', done = '"' .. done .. '"'}
end
-- gate_of(job, g): key, limit (text, "" for none) and priority of a claimed job the claim may
-- gate itself: never claimed before, or parked or promoted without a claim counted (lease token
-- "gate", tries 0); whose envelope names the gate header once, with no rate, no batch
-- completion and no schedule point; whose header reads (key, limit, priority as gate.py checks
-- them) and whose id carries the key's tag. Else nil: the beat's gate decides (gate.lua), as it
-- did for every gated job before.
local function gate_of(job, g)
  if job.tries ~= 0 or (job.leased and not lease_holds(job.leased, GATE_TOKEN)) then
    return nil
  end
  local env = job.envelope
  local at = string.find(env, g.header, 1, true)
  if not at or string.find(env, g.header, at + 1, true) or string.find(env, g.done, 1, true)
      or string.find(env, ',"s":[', 1, true) then
    return nil
  end
  local open = at + #g.header - 1
  local close = string.find(env, '}', open, true)
  if not close then
    return nil
  end
  local ok, h = pcall(cjson.decode, string.sub(env, open, close))
  if not ok or type(h) ~= 'table' or h.rate ~= nil or type(h.key) ~= 'string' or not gate_key_ok(h.key) then
    return nil
  end
  local tag = '{' .. h.key .. '}'
  if string.sub(job.id, 1, #tag) ~= tag then
    return nil
  end
  local limit, prio = h.limit, h.priority
  if limit == nil then
    limit = ''
  elseif type(limit) == 'number' and limit >= 1 and limit == math.floor(limit) and limit < 9007199254740992 then
    limit = string.format('%d', limit)
  else
    return nil
  end
  if prio == nil then
    prio = 0
  elseif type(prio) ~= 'number' or prio < 0 or prio > 255 or prio ~= math.floor(prio) then
    return nil
  end
  return h.key, limit, prio
end
-- gate_claimed(jobs, now, g): the gate of gate.lua for the claimed jobs gate_of reads (the
-- others are left as they are). Every key seen is recorded in gate:keys with the job's limit
-- (includes/gate.lua seen_keys: one HMGET, and one HSET when a limit changed), which gives
-- its override and pause too. With the key paused, or the limit in force (the override, else
-- the job's) at most the key's
-- running slots (after a purge of its expired slots whose job is gone, which promotes its
-- parked jobs when it removed some): parked as gate.lua parks (score PARK_MS, lease entry
-- (due, 0, "gate"), gate:wait:<key> by priority then due), or with g.park false left to the
-- beat. Else released: a slot in gate:run:<key> until now + g.ttl, and the job handed to the
-- beat (leased by hand_over) to publish and hold. Returns the jobs to hand over, the released
-- ones as a flat list of id, key, and how many were parked.
local function gate_claimed(jobs, now, g)
  local seen, found = {}, {}
  for n, job in ipairs(jobs) do
    local key, limit, prio = gate_of(job, g)
    if key then
      found[n] = {key, limit, prio}
      seen[#seen + 1] = key
      seen[#seen + 1] = limit
    end
  end
  if #seen == 0 then
    return jobs, {}, 0
  end
  local known = seen_keys(seen, false)
  -- parks: the parked jobs' due scores (PARK_MS); waits: key -> its parked jobs' wait scores
  -- and ids (waited: the keys in order); entries: their lease entries. Each written in one
  -- command at the end (a key's wait list is read in the loop only by its promote, which runs
  -- before the key's first park).
  local keep, released, parks, parked = {}, {}, {}, 0
  local waits, waited, entries = {}, {}, {}
  for n, job in ipairs(jobs) do
    local f = found[n]
    if not f then
      keep[#keep + 1] = job
    else
      local key, limit, rkey = f[1], f[2], run_key(f[1])
      local k = known[key]
      local cap = limit_from(k.override, limit)
      local full = k.paused
      if not full and cap ~= nil then
        if k.running == nil then
          k.running = redis.call('ZCARD', rkey)
        end
        if cap <= k.running and not k.purged then
          k.purged = true
          if purge(key, now) > 0 then
            promote(key, g.channel, g.shard, now)
            k.running = redis.call('ZCARD', rkey)
          end
        end
        full = cap <= k.running
      end
      if full and not g.park then
        keep[#keep + 1] = job
      elseif full then
        local due = tonumber(job.due)
        local w = waits[key]
        if w == nil then
          w = {}
          waits[key] = w
          waited[#waited + 1] = key
        end
        w[#w + 1] = wait_score(f[3], due)
        w[#w + 1] = job.id
        entries[#entries + 1] = job.id
        entries[#entries + 1] = lease_entry(due, 0, GATE_TOKEN)
        parks[#parks + 1] = PARK_TEXT
        parks[#parks + 1] = job.id
        parked = parked + 1
      else
        if redis.call('ZADD', rkey, now + g.ttl, job.id) == 1 and k.running ~= nil then
          k.running = k.running + 1
        end
        keep[#keep + 1] = job
        released[#released + 1] = job.id
        released[#released + 1] = key
      end
    end
  end
  for _, key in ipairs(waited) do
    call_sliced('ZADD', wait_key(key), waits[key], 2)
  end
  call_sliced('HSET', KEYS[3], entries, 2)
  call_sliced('ZADD', KEYS[1], parks, 2)
  return keep, released, parked
end
-- hand_over_gated(out, jobs, gone, token, now, ttl, g): hand_over (includes/claiming.lua) of jobs
-- until now + ttl; with g (gating_args), through gate_claimed first, out then getting {parked,
-- id, key, ...}: how many it parked, then the ids and keys of those it released.
local function hand_over_gated(out, jobs, gone, token, now, ttl, g)
  if g then
    local released, parked
    jobs, released, parked = gate_claimed(jobs, now, g)
    table.insert(released, 1, parked)
    out[#out + 1] = released
  end
  return hand_over(out, jobs, gone, token, now + ttl)
end
