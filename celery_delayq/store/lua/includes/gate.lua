-- gate: the flow-control keys of a shard, the limit in force, promotion and batch completion.
--
-- Needs the includes sliced, lease and wake before it. The Python side is
-- celery_delayq/flow/gate.py (the names) and keys.py (ShardKeys: the same key names).
--
-- The gate's keys are not in KEYS: they share the shard's hash tag (so its cluster slot) and
-- are built from KEYS[1] ("<prefix>:{<prefix>:<i>}:due") minus "due". GATE_BASE is that.
local GATE_BASE = string.sub(KEYS[1], 1, #KEYS[1] - 3)
-- G_KEYS hash key -> its entry (key_read below): the last limit a job of it carried, and the
-- key's run-time override and pause when it has either; G_RATES hash key -> GCRA arrival time
-- ms; G_BOOKED hash job id -> the release time (ms) a deferred job booked from its key's
-- rate; G_CHECK hash job id -> "1" for a released job waiting for a worker whose next claim
-- is a check of its slot (hold.lua), not a redelivery (see gate.lua); G_BATCHES set of the
-- shard's batch ids; G_BATCH_EXPIRY zset finished batch id -> the time (ms) its record
-- expires (batch_check), read by the sweep (batch_delete.lua); G_OVERLAP hash schedule (its
-- overlap key) -> the id of its point that waits for a run to end (overlap.lua). The
-- commands used on them are all in the ACL rule of docs/security.md (no SISMEMBER, ZPOPMIN,
-- EXISTS or DEL).
local G_KEYS = GATE_BASE .. 'gate:keys'
local G_RATES = GATE_BASE .. 'gate:rates'
local G_BOOKED = GATE_BASE .. 'gate:booked'
local G_CHECK = GATE_BASE .. 'gate:check'
local G_OVERLAP = GATE_BASE .. 'gate:overlap'
local G_BATCHES = GATE_BASE .. 'batches'
local G_BATCH_EXPIRY = GATE_BASE .. 'batches:expiry'
-- run_key(key): zset job id -> slot expiry ms; wait_key(key): zset job id -> order score;
-- batch_hash(bid): the batch's hash.
local function run_key(key)
  return GATE_BASE .. 'gate:run:' .. key
end
local function wait_key(key)
  return GATE_BASE .. 'gate:wait:' .. key
end
local function batch_hash(bid)
  return GATE_BASE .. 'batch:' .. bid
end
-- PARK_MS: the due score of a parked job (gate.PARK_MS), never reached by a claim; PARK_TEXT
-- the same as text (a number passed to redis.call is written with 14 digits only).
-- GATE_TOKEN, RUN_TOKEN: the lease tokens of a gated and of a running job (gate.py).
local PARK_MS = 9000000000000000
local PARK_TEXT = '9000000000000000'
local GATE_TOKEN = 'gate'
local RUN_TOKEN = 'run'
-- gate_key_ok(key): a key as gate.check_key takes it (1 to 200 characters, no { } |).
local function gate_key_ok(key)
  return key ~= nil and key ~= '' and #key <= 200 and not string.find(key, '[{}|]')
end
-- wait_score(priority, due): the order of a parked job in wait_key, lowest first: higher
-- priority first, then earlier due (lua_formats.wait_score mirrors it). As text: Redis
-- would write the number with 14 digits only, and the score has 16.
local function wait_score(priority, due)
  return string.format('%.0f', (255 - priority) * 1e13 + due)
end
-- key_read(entry): a key's G_KEYS entry as own, override, paused: "<own>" (the last limit a job
-- of the key carried, "" for none) for a key with no override and no pause, else
-- "<own>|<override>|<paused>" (override: "<n>", "none" (no cap) or "" (none set); paused: "1"
-- or ""). own: text ("" for none; nil when the key has no entry); override: text or nil;
-- paused: a boolean. An entry that does not read so is taken as an own limit alone (as
-- lua_formats.parse_key_entry reads it).
local function key_read(entry)
  if not entry then
    return nil, nil, false
  end
  local own, override, paused = string.match(entry, '^([^|]*)|([^|]*)|([^|]*)$')
  if own == nil then
    return entry, nil, false
  end
  if override == '' then
    override = nil
  end
  return own, override, paused ~= ''
end
-- key_entry(own, override, paused): the G_KEYS entry key_read reads back (own nil: "").
local function key_entry(own, override, paused)
  if override == nil and not paused then
    return own or ''
  end
  return (own or '') .. '|' .. (override or '') .. '|' .. (paused and '1' or '')
end
-- limit_from(override, own): the limit in force given a key's override (nil for none, "none":
-- no cap, "<n>"; one that does not read is ignored), else own (the job's limit as text, ""
-- for none; nil), as a number or nil for no cap.
local function limit_from(override, own)
  if override == 'none' then
    return nil
  end
  if override and tonumber(override) then
    return tonumber(override)
  end
  if own and own ~= '' then
    return tonumber(own)
  end
  return nil
end
-- seen_keys(seen, always): record the keys a call's jobs carry, with each one's limit, in
-- G_KEYS, from seen (key, own limit text, ...: the last of a key wins), each key's override and
-- pause kept; an entry whose own limit is the same is not written (all are when always). One
-- HMGET, and one HSET when an entry changes. Returns key -> {override, paused} as read.
local function seen_keys(seen, always)
  local own, order = {}, {}
  for i = 1, #seen, 2 do
    if own[seen[i]] == nil then
      order[#order + 1] = seen[i]
    end
    own[seen[i]] = seen[i + 1]
  end
  local entries = hmget(G_KEYS, order)
  local known, writes = {}, {}
  for n, key in ipairs(order) do
    local old, override, paused = key_read(entries[n])
    known[key] = {override = override, paused = paused}
    if always or old ~= own[key] then
      writes[#writes + 1] = key
      writes[#writes + 1] = key_entry(own[key], override, paused)
    end
  end
  call_sliced('HSET', G_KEYS, writes, 2)
  return known
end
-- server_now(): the server's TIME in ms.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- purge(key, now): remove up to 10 expired slots of the key whose job is gone (cancelled
-- while it ran, and its worker died: no release comes), with their gate:check entries; how
-- many were removed.
local function purge(key, now)
  local rkey = run_key(key)
  local purged = 0
  for _, old in ipairs(redis.call('ZRANGE', rkey, '-inf', now, 'BYSCORE', 'LIMIT', 0, 10)) do
    if redis.call('HEXISTS', KEYS[2], old) == 0 then
      purged = purged + redis.call('ZREM', rkey, old)
      redis.call('HDEL', G_CHECK, old)
    end
  end
  return purged
end
-- promote(key, channel, shard, now): unless the key has no parked job or is paused, move as
-- many parked jobs of it as it has free slots (all, with no cap) from wait_key to due now -
-- priority (claimed first by priority), and wake the beats. When the key has no free slot, its
-- expired slots whose job is gone are purged first (above; a claim or gate that finds the key
-- full purges too). A member whose job is no longer parked (cancelled, or stored again
-- meanwhile: its score is not PARK_MS) is dropped from the list without counting. Returns how
-- many were moved. The list's first two are read first (a key with none parked costs one
-- read), and are the jobs moved when one or two slots are free (the usual release: no second
-- read of the list); the moved jobs' due scores are written in one ZADD a read.
-- now: the server's time in ms, or nil: read here (TIME) only when the key has parked jobs.
local function promote(key, channel, shard, now)
  local wkey = wait_key(key)
  local popped = redis.call('ZRANGE', wkey, 0, 1, 'WITHSCORES')
  if popped[1] == nil then
    return 0
  end
  local own, override, paused = key_read(redis.call('HGET', G_KEYS, key))
  if paused then
    return 0
  end
  now = now or server_now()
  -- free: the key's free slots, nil for no cap; reuse: the head read above holds the jobs to
  -- move (one or two free slots)
  local free = nil
  local limit = limit_from(override, own)
  if limit ~= nil then
    local rkey = run_key(key)
    free = limit - redis.call('ZCARD', rkey)
    if free <= 0 and purge(key, now) > 0 then
      free = limit - redis.call('ZCARD', rkey)
    end
    if free <= 0 then
      return 0
    end
  end
  local moved, reuse = 0, free ~= nil and free <= 2
  while true do
    if reuse then
      reuse = false
      if free == 1 then
        popped = {popped[1], popped[2]}
      end
    else
      local want = 500
      if free ~= nil then
        want = math.min(free - moved, 500)
      end
      popped = redis.call('ZRANGE', wkey, 0, want - 1, 'WITHSCORES')
      if popped[1] == nil then
        break
      end
    end
    local ids = {}
    for j = 1, #popped, 2 do
      ids[#ids + 1] = popped[j]
    end
    redis.call('ZREM', wkey, unpack(ids))
    local scores = {}
    for j = 1, #popped, 2 do
      local id = popped[j]
      if tonumber(redis.call('ZSCORE', KEYS[1], id)) == PARK_MS then
        local priority = 255 - math.floor(tonumber(popped[j + 1]) / 1e13)
        scores[#scores + 1] = now - priority
        scores[#scores + 1] = id
        moved = moved + 1
      end
    end
    call_sliced('ZADD', KEYS[1], scores, 2)
    if free ~= nil and moved >= free then
      break
    end
  end
  if moved > 0 then
    wake(channel, shard, now - 255)
  end
  return moved
end
-- batch_add(bid, field, n): add n to a count of the batch's hash; a count that does not read
-- (written by hand) counts as 0 (HINCRBY would fail the script after its first writes).
local function batch_add(bid, field, n)
  local bkey = batch_hash(bid)
  local count = tonumber(redis.call('HGET', bkey, field)) or 0
  redis.call('HSET', bkey, field, string.format('%d', count + n))
end
-- batch_check(bid, batch_channel, channel, shard, now, keep): when the batch is sealed (no
-- "open" field: an open batch, DelayQ.open_batch, completes only at its seal, batch_seal.lua),
-- its succeeded + failed + cancelled reach its total and it was not done yet (HSETNX done), set its
-- "finished" field to now (ms: when its completion job was let go, the start of that job's
-- publish lateness), make its completion job (if any, still parked) due at now - 256, wake the beats, and publish
-- "<bid>|{counts}" on batch_channel (lua_formats.batch_message mirrors it; with pcall: an ACL
-- user without the channel loses the message, never the writes after it). keep: ms the
-- finished batch is kept (delayq_batch_expires), or nil (kept until deleted): its hash gets
-- that TTL and an "expires" field, and G_BATCH_EXPIRY its expiry time, in this same step (a
-- crash cannot leave a finished batch without one). Returns 1 when this call completed the
-- batch, else 0.
local function batch_check(bid, batch_channel, channel, shard, now, keep)
  local bkey = batch_hash(bid)
  local h = redis.call('HMGET', bkey, 'total', 'succeeded', 'failed', 'cancelled', 'completion', 'open')
  local total = tonumber(h[1])
  if total == nil or h[6] == '1' then
    return 0
  end
  local s, f, c = tonumber(h[2]) or 0, tonumber(h[3]) or 0, tonumber(h[4]) or 0
  if s + f + c < total or redis.call('HSETNX', bkey, 'done', '1') == 0 then
    return 0
  end
  -- when flow control let the completion job go: its publish lateness counts from here
  redis.call('HSET', bkey, 'finished', string.format('%d', now))
  if keep then
    local expires = string.format('%d', now + keep)
    redis.call('HSET', bkey, 'expires', expires)
    redis.call('PEXPIRE', bkey, keep)
    redis.call('ZADD', G_BATCH_EXPIRY, expires, bid)
  end
  local completion = h[5]
  if completion and completion ~= '' and redis.call('HEXISTS', KEYS[2], completion) == 1 then
    if tonumber(redis.call('ZSCORE', KEYS[1], completion)) == PARK_MS then
      redis.call('ZADD', KEYS[1], now - 256, completion)
      wake(channel, shard, now - 256)
    end
  end
  local counts = string.format('{"total":%d,"succeeded":%d,"failed":%d,"cancelled":%d}', total, s, f, c)
  redis.pcall('PUBLISH', batch_channel, bid .. '|' .. counts)
  return 1
end
-- keep_arg(i): ARGV[i] as batch_check's keep: a whole number of ms >= 1, or nil for "" (kept
-- until deleted); false when it is neither (the caller refuses the call).
local function keep_arg(i)
  local raw = ARGV[i]
  if raw == '' then
    return nil
  end
  local keep = int_arg(i)
  if keep == nil or keep < 1 then
    return false
  end
  return keep
end
-- batch_forget(bid, key): remove what is left of a batch: its hash (field by field: no DEL in
-- the ACL rule), its ids in G_BATCHES and G_BATCH_EXPIRY, and its key's records (G_KEYS,
-- G_RATES, and the parked list wait_key). Slots of members still running
-- (run_key) are left to their release.
local function batch_forget(bid, key)
  local bkey = batch_hash(bid)
  local fields = redis.call('HGETALL', bkey)
  for i = 1, #fields, 2 do
    redis.call('HDEL', bkey, fields[i])
  end
  redis.call('SREM', G_BATCHES, bid)
  redis.call('ZREM', G_BATCH_EXPIRY, bid)
  redis.call('HDEL', G_KEYS, key)
  redis.call('HDEL', G_RATES, key)
  local wkey = wait_key(key)
  for _, id in ipairs(redis.call('ZRANGE', wkey, 0, -1)) do
    redis.call('ZREM', wkey, id)
  end
end
