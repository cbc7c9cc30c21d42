--[[ push: claim a shard's due jobs and deliver, inside Redis, those whose message has a template.

The in-Redis delivery path (docs/how-it-works.md, "The in-Redis path"). Used only when the
Celery broker is this same Redis server and database, as deliver.lua. Each due job whose
envelope holds its message's own parts already encoded (envelope.py: "a", "k", "j"/"b" first)
and whose *shape* (the envelope's text from "t" to "c", or its id "S" when the shapes hash keeps
it: a shape kept so never names an expiry or flow control) has a stored template (wire.py: its
message cut at the job's own values) becomes its message here by joining: the template's literals
with the id, the argument reprs and the body cut out of the envelope, the due time (the job's
score, as Redis gives it) and a delivery tag. Nothing is decoded or encoded here. The message is
LPUSHed into its queue's list and the job removed in this one step: no job data goes to the beat
and back, and a beat that dies at any point duplicates nothing. Every other due job (no template
yet, flow control, a schedule point, an expiry, another envelope form, a push refused) is claimed
exactly as claim.lua claims it and returned to the beat, which delivers it the other way.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake: as claim.lua
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
The templates hash ("<base>wire", from KEYS[1] less "due": the shard's hash tag) maps
"<space>|<j or b>|<shape>" to a template (JSON: wire.py's lua_template) or to "-" (this shape goes
to the beat); a template that does not read is a miss (the beat writes it again). The queue
lists are not in KEYS: this script is never sent to a Redis Cluster.

ARGV[1] token: the claimer's lease token (no "|" in it)
ARGV[2] batch: most jobs to take
ARGV[3] reclaim TTL in ms (for the jobs returned to the beat)
ARGV[4] space: the beat's template namespace (a digest of the settings a message depends on)
ARGV[5] tag prefix: a message's delivery tag is this text and the job's id (unique per call)
ARGV[6] the largest envelope (bytes) delivered here (delayq_max_payload); a longer one goes to the beat
ARGV[7], ARGV[8]: header names (gate, batch completion): a shape naming either goes to the beat

Returns {now ms, next ms, repaired, pushed, P, (lateness ms, count) x P, U, (queue, task, count)
x U, then id, envelope, due ms, tries, miss for each job returned to the beat}: next, repaired
and the returned jobs as claim.lua; the lateness of the pushed jobs (the server's TIME after the
pushes minus each job's due time), counted by value; the templates used, by queue and task;
miss is the templates-hash field to fill for this job's shape (once per shape and call), or "".

Memory: no script flags. When Redis is over maxmemory the first write (an LPUSH, or the lease of a
returned job) is refused: nothing is written and the call fails with the OOM error; the beat
claims that shard with claim.lua then (which may run when full). Bad arguments are refused with
an error before anything is written.
]]
--!include args
--!include sliced
--!include lease
--!include wake
local token = ARGV[1]
local batch = int_arg(2)
local ttl = int_arg(3)
local space = ARGV[4]
local tag_prefix = ARGV[5]
local max_payload = int_arg(6)
local gate_header = ARGV[7]
local done_header = ARGV[8]
if token == nil or token == '' or string.find(token, '|', 1, true) then
  return redis.error_reply('delayq push: the token must be a non-empty string without "|"')
end
if batch == nil or batch < 1 or ttl == nil or ttl < 1 or max_payload == nil then
  return redis.error_reply('delayq push: batch, TTL and payload limit must be whole numbers >= 1')
end
if space == nil or space == '' or tag_prefix == nil or gate_header == nil or done_header == nil
    or string.find(tag_prefix, '[^%w%-_.:]') then
  return redis.error_reply('delayq push: space, tag prefix (letters, digits, -_.:) and header names are required')
end
local WIRE = string.sub(KEYS[1], 1, #KEYS[1] - 3) .. 'wire'
local sub, find, match = string.sub, string.find, string.match

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- template(field): the decoded template of a templates-hash field, its parts ready to fill (the
-- literals in place, the holes left for the job's values); false (the beat delivers) or 'miss'
-- (none yet, or one that does not read).
local function template(field)
  local raw = redis.call('HGET', WIRE, field)
  if raw == '-' then
    return false
  end
  local ok, t = pcall(cjson.decode, raw or '')
  if not (ok and type(t) == 'table' and type(t.l) == 'table' and type(t.h) == 'table'
      and #t.l == #t.h + 1 and type(t.k) == 'string' and t.k ~= '' and type(t.q) == 'string'
      and t.q ~= '' and type(t.t) == 'string') then
    return 'miss'
  end
  t.parts = {t.l[1]}
  for n, hole in ipairs(t.h) do
    if type(hole) ~= 'number' or hole < 0 or hole > 5 or type(t.l[n + 1]) ~= 'string' then
      return 'miss'
    end
    t.parts[n + n + 1] = t.l[n + 1]
  end
  return t
end

-- shapes: a shape's text -> its template, false (the beat delivers) or 'miss'; looked at once a call.
local shapes, missed = {[true] = {}, [false] = {}}, {}
local function shape_template(shape, plain)
  local found = shapes[plain][shape]
  if found == nil then
    found = false
    -- an expiry "x" or a flow-control header in the shape: the beat delivers
    if not (find(shape, ',"x":', 1, true) or find(shape, gate_header, 1, true)
        or find(shape, done_header, 1, true)) then
      local field = space .. (plain and '|j|' or '|b|') .. shape
      found = template(field)
      if found == 'miss' then
        missed[#missed + 1] = field
      end
    end
    shapes[plain][shape] = found
    return found, found == 'miss' and missed[#missed] or nil
  end
  return found
end

-- message(id, stored, due): the list key, the message and the template of a job (due: its due ms
-- as text); or nil, and the templates-hash field to fill when its shape has no template yet.
local function message(id, stored, due)
  if #stored + #id + 16 > max_payload or find(id, '[^%w%-_.:]') or not find(due, '^%d+$')
      or sub(stored, 1, 12) ~= '{"v":3,"a":"' then
    return nil
  end
  -- the job's own texts: {"v":3,"a":"...","k":"...","j" or "b":"...","t":... Each ends at the first
  -- '","' after it: in JSON-escaped text every '"' follows a backslash.
  local a1 = find(stored, '","', 13, true)
  if not a1 or sub(stored, a1, a1 + 6) ~= '","k":"' then
    return nil
  end
  local k1 = find(stored, '","', a1 + 7, true)
  local kind = k1 and sub(stored, k1, k1 + 6)
  if kind ~= '","j":"' and kind ~= '","b":"' then
    return nil
  end
  local b1 = find(stored, '","', k1 + 7, true)
  local after = b1 and sub(stored, b1, b1 + 5)
  if after ~= '","t":' and after ~= '","S":' then
    return nil
  end
  -- the shape: from "t" to the creation time, which ends the envelope (a schedule point after it:
  -- the beat delivers); or, left to the shapes hash, its id: {"v":3,...,"S":"<16 hex digits>","c":...}
  local c = find(stored, ',"c":', #stored - 24, true)
  if not c or not find(stored, '^%d+}$', c + 5) then
    return nil
  end
  local shape = sub(stored, b1 + 2, c - 1)
  if after == '","S":' and not find(shape, '^"S":"%x+"$') then
    return nil
  end
  local t, miss = shape_template(shape, kind == '","j":"')
  if not t or t == 'miss' then
    return nil, miss
  end
  local values = {[0] = id, sub(stored, 13, a1 - 1), sub(stored, a1 + 7, k1 - 1), sub(stored, k1 + 7, b1 - 1),
    due, tag_prefix .. id}
  local parts, h = t.parts, t.h
  for n = 1, #h do
    parts[n + n] = values[h[n]]
  end
  return t.k, table.concat(parts), t
end

-- hmget(key, ids): HMGET over any number of fields (sliced as call_sliced).
local function hmget(key, ids)
  local out = {}
  for first = 1, #ids, UNPACK_MAX do
    local got = redis.call('HMGET', key, unpack(ids, first, math.min(first + UNPACK_MAX - 1, #ids)))
    for i = 1, #got do
      out[#out + 1] = got[i]
    end
  end
  return out
end

local now = server_ms()
local found = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, batch, 'WITHSCORES')
local ids = {}
for i = 1, #found, 2 do
  ids[#ids + 1] = found[i]
end
local envelopes = hmget(KEYS[2], ids)
local leases = {}  -- (no job of a shard whose leases hash is empty has a lease: one HLEN)
if redis.call('HLEN', KEYS[3]) > 0 then
  leases = hmget(KEYS[3], ids)
end
local repaired = 0
local lists, order = {}, {}  -- list key -> {messages, job indexes}; keys in first-seen order
local due_of, tries_of, made_by = {}, {}, {}  -- by job index: due ms, tries, template
local back = {}  -- jobs for the beat: {id, envelope, due, tries, miss}
local gone = {}  -- members whose envelope is missing
for i, id in ipairs(ids) do
  local stored = envelopes[i]
  if not stored then
    gone[#gone + 1] = id
  else
    local due_text = found[i + i]
    local tries = 0
    if leases[i] then
      local d, n = match(leases[i], '^(%-?%d+)|(%d+)|')
      if d then
        due_text, tries = d, tonumber(n)
      else
        repaired = repaired + 1
      end
    end
    local due = tonumber(due_text)
    local key, text, t = message(id, stored, due_text)
    if key then
      local list = lists[key]
      if list == nil then
        list = {{}, {}}
        lists[key] = list
        order[#order + 1] = key
      end
      local at = #list[1] + 1
      list[1][at], list[2][at] = text, i
      due_of[i], tries_of[i], made_by[i] = due, tries, t
    else
      back[#back + 1] = {id, stored, due, tries, text or ''}
    end
  end
end
-- push: a refused LPUSH (a key that is not a list) sends its jobs to the beat, which buries them
local pushed, leased, used, dues = {}, {}, {}, {}
for _, key in ipairs(order) do
  local list = lists[key]
  local messages, jobs = list[1], list[2]
  for first = 1, #messages, UNPACK_MAX do
    local last = math.min(first + UNPACK_MAX - 1, #messages)
    local reply = redis.pcall('LPUSH', key, unpack(messages, first, last))
    local refused = type(reply) == 'table' and reply.err
    if refused and #pushed == 0 and string.sub(reply.err, 1, 3) == 'OOM' then
      return redis.error_reply(reply.err)  -- nothing written yet (see Memory above)
    end
    for at = first, last do
      local i = jobs[at]
      if refused then
        back[#back + 1] = {ids[i], envelopes[i], due_of[i], tries_of[i], ''}
      else
        pushed[#pushed + 1] = ids[i]
        if leases[i] then
          leased[#leased + 1] = ids[i]
        end
        local due = due_of[i]
        dues[due] = (dues[due] or 0) + 1
        local t = made_by[i]
        used[t] = (used[t] or 0) + 1
      end
    end
  end
end
call_sliced('ZREM', KEYS[1], pushed, 1)
call_sliced('HDEL', KEYS[2], pushed, 1)
call_sliced('HDEL', KEYS[3], leased, 1)
call_sliced('ZREM', KEYS[1], gone, 1)
call_sliced('HDEL', KEYS[3], gone, 1)
local after = #pushed > 0 and server_ms() or now  -- (the lateness clock: only when something went)
local out = {now, -1, repaired, #pushed, 0}
local late = {}
for due, count in pairs(dues) do
  late[after - due] = (late[after - due] or 0) + count
end
for lateness, count in pairs(late) do
  out[#out + 1] = lateness
  out[#out + 1] = count
  out[5] = out[5] + 1
end
local counted = #out + 1
out[counted] = 0
for t, count in pairs(used) do
  out[#out + 1] = t.q
  out[#out + 1] = t.t
  out[#out + 1] = count
  out[counted] = out[counted] + 1
end
-- the jobs for the beat are leased as claim.lua leases them
local expiry = now + ttl
local zargs = {}
for _, job in ipairs(back) do
  local tries = job[4] + 1
  redis.call('HSET', KEYS[3], job[1], lease_entry(job[3], tries, token))
  zargs[#zargs + 1] = expiry
  zargs[#zargs + 1] = job[1]
  out[#out + 1] = job[1]
  out[#out + 1] = job[2]
  out[#out + 1] = job[3]
  out[#out + 1] = tries
  out[#out + 1] = job[5]
end
call_sliced('ZADD', KEYS[1], zargs, 2)
out[2] = rearm()
return out
