--[[ push: claim a shard's due jobs and deliver, inside Redis, those whose message has a template.

Pushing on claim (docs/how-it-works.md): the broker is this Redis server and database (never a
Cluster: the queue lists are not in KEYS). A job whose envelope has its own texts first, JSON-escaped
(envelope.py: "a", "k", "j" or "b"), and whose shape (the text from "t" to "c", or its id "S") has a
template (wire.py's lua_template) is joined into its message, LPUSHed and removed in one step:
nothing is decoded or encoded here, and a beat that dies at any point duplicates nothing. The other
due jobs (no template, an expiry, flow control, a schedule point, too long, a refused push) are
leased and returned as claim.lua does, for the beat (which dead-letters what is corrupt).

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake: as claim.lua (KEYS[5] dead, KEYS[6]
schedules, KEYS[7] history: unused); the templates hash: KEYS[1] with "wire" for "due".
ARGV: token, batch, reclaim TTL ms (as claim.lua); the template space (a field is "<space>|<j or b>|
<shape>"); the delivery tag prefix (a tag is it and the job's id); the longest envelope pushed here
(bytes); the gate and batch completion header names (a shape naming one is the beat's); optional,
ARGV[9..14], the gate in the claim as claim.lua's ARGV[4..9] (includes/gating.lua): the due capped
jobs it can gate are given a slot (and returned) or parked (and not returned), as claim.lua does.
Returns {now ms, next ms, repaired, pushed, {lateness ms, count, ...}, {queue, task, count, ...},
{id, field, ...}, (with ARGV[9..14]: {parked, id, key, ...} as claim.lua's,) then id, envelope, due ms,
tries per job returned, as claim.lua}: the lateness
(TIME after the pushes less the due time) by due time; the templates used; the field to fill for
the first job of each shape met without a template.
Memory: no script flags. Over maxmemory the first write (an LPUSH or a lease) is refused: the call
fails with the OOM error having written nothing, and the beat claims with claim.lua.
]]
--!include args
--!include sliced
--!include lease
--!include wake
--!include claiming
--!include gate
--!include gating
local token, batch, ttl, space, tag_prefix = ARGV[1], int_arg(2), int_arg(3), ARGV[4], ARGV[5]
local max_payload, gate_header, done_header = int_arg(6), ARGV[7], ARGV[8]
local sub, find, match = string.sub, string.find, string.match
local g = gating_args(9)
if not (token and token ~= '' and not find(token, '|', 1, true) and batch and batch >= 1 and ttl and ttl >= 1
    and max_payload and space and space ~= '' and tag_prefix and not find(tag_prefix, '[^%w%-_.:]')
    and gate_header and done_header and g ~= false) then
  return redis.error_reply('delayq push: bad arguments (wanted: a token without "|", batch and TTL >= 1, '
    .. 'a payload limit, a space, a tag prefix of letters, digits and -_.:, two header names)')
end
local WIRE = sub(KEYS[1], 1, #KEYS[1] - 3) .. 'wire'
local MAX_DUE = 253402300799999  -- the last ms of year 9999 (15 digits): a later due time is the beat's
local HOLES = {[0] = true, true, true, true, true, true}  -- 0 id, 1 args, 2 kwargs, 3 body, 4 due, 5 tag

-- shape_template(shape, plain): the shape's template (read once a call; JSON: literals l around holes
-- h, list key k, queue q, task t), its literals in place in t.parts, the holes left at even indexes;
-- else false (the beat's: "-", an expiry or a flow-control header in the shape, an "S" not hex), or
-- false and the field to fill (none yet, or one that does not read).
local seen, values = {[true] = {}, [false] = {}}, {}  -- values: a job's, by hole (message)
local function shape_template(shape, plain)
  if seen[plain][shape] ~= nil then
    return seen[plain][shape]
  end
  seen[plain][shape] = false
  if find(shape, ',"x":', 1, true) or find(shape, gate_header, 1, true)
      or find(shape, done_header, 1, true) or find(shape, '^"S":') and not find(shape, '^"S":"%x+"$') then
    return false
  end
  local field = space .. (plain and '|j|' or '|b|') .. shape
  local raw = redis.call('HGET', WIRE, field)
  if raw == '-' then
    return false
  end
  local ok, t = pcall(cjson.decode, raw or '')
  if not (ok and type(t) == 'table' and type(t.l) == 'table' and type(t.h) == 'table'
      and #t.l == #t.h + 1 and type(t.k) == 'string' and t.k ~= '' and type(t.q) == 'string' and t.q ~= ''
      and type(t.t) == 'string') then
    return false, field
  end
  t.parts = {}
  for n, literal in ipairs(t.l) do
    if type(literal) ~= 'string' or n <= #t.h and not HOLES[t.h[n]] then
      return false, field
    end
    t.parts[n + n - 1] = t.h[n] == 5 and literal .. tag_prefix or literal  -- a tag: the prefix then the id
  end
  seen[plain][shape] = t
  return t
end

-- message(job): the list key, message and template of a job its template delivers; else nil and,
-- on its shape's first miss, the templates-hash field to fill.
local function message(job)
  local stored, id, due = job.envelope, job.id, job.due
  if #stored + #id + 16 > max_payload or not find(id, '^[%w%-_.:]*$') or not find(due, '^%d+$')
      or #due > 14 and tonumber(due) > MAX_DUE or sub(stored, 1, 12) ~= '{"v":3,"a":"' then
    return nil
  end
  -- "a", "k" and the body ("j" or "b") each end at the first '","' after them (in JSON-escaped
  -- text every '"' follows a backslash); the shape ("t" or "S" on) ends at "c", the last field
  local a = find(stored, '","', 13, true)
  local k = a and find(stored, '^","k":"', a) and find(stored, '","', a + 7, true)
  local kind = k and match(stored, '^","([jb])":"', k)
  local b = kind and find(stored, '","', k + 7, true)
  local named = b and match(stored, '^","([tS])":', b)
  local c = named and find(stored, ',"c":', #stored - 24, true)
  local shape = c and find(stored, '^%d+}$', c + 5) and sub(stored, b + 2, c - 1)
  if not shape then
    return nil
  end
  local t, miss = shape_template(shape, kind == 'j')
  if not t then
    return nil, miss
  end
  values[0], values[1], values[2], values[3], values[4], values[5] =
    id, sub(stored, 13, a - 1), sub(stored, a + 7, k - 1), sub(stored, k + 7, b - 1), due, id
  local parts, h = t.parts, t.h
  for n = 1, #h do
    parts[n + n] = values[h[n]]
  end
  return t.k, table.concat(parts), t
end

local now = now_ms()
local jobs, gone, repaired = due_jobs(now, batch)
local lists, order, back, misses = {}, {}, {}, {}  -- list key -> {messages, jobs}; the keys in order
for _, job in ipairs(jobs) do
  local key, text, t = message(job)
  if key then
    local list = lists[key]
    if not list then
      list = {{}, {}}
      lists[key], order[#order + 1] = list, key
    end
    job.t = t
    list[1][#list[1] + 1] = text
    list[2][#list[2] + 1] = job
  else
    back[#back + 1] = job
    if text then
      misses[#misses + 1] = job.id
      misses[#misses + 1] = text
    end
  end
end
local pushed, leased, dues, used = {}, {}, {}, {}
for _, key in ipairs(order) do
  local messages, list_jobs = lists[key][1], lists[key][2]
  for first = 1, #messages, UNPACK_MAX do
    local last = math.min(first + UNPACK_MAX - 1, #messages)
    local reply = redis.pcall('LPUSH', key, unpack(messages, first, last))
    local refused = type(reply) == 'table' and reply.err
    if refused and #pushed == 0 and sub(refused, 1, 3) == 'OOM' then
      return redis.error_reply(refused)  -- nothing written yet (see Memory above)
    end
    for at = first, last do
      local job = list_jobs[at]
      if refused then  -- (a key that is not a list): the beat buries the job
        back[#back + 1] = job
      else
        pushed[#pushed + 1] = job.id
        if job.leased then
          leased[#leased + 1] = job.id
        end
        dues[job.due] = (dues[job.due] or 0) + 1
        used[job.t] = (used[job.t] or 0) + 1
      end
    end
  end
end
call_sliced('ZREM', KEYS[1], pushed, 1)
call_sliced('HDEL', KEYS[2], pushed, 1)
call_sliced('HDEL', KEYS[3], leased, 1)
local after = #pushed > 0 and now_ms() or now  -- (the lateness clock: only when something went)
local late, templates = {}, {}
for due, count in pairs(dues) do
  late[#late + 1], late[#late + 2] = after - tonumber(due), count
end
for t, count in pairs(used) do
  templates[#templates + 1], templates[#templates + 2], templates[#templates + 3] = t.q, t.t, count
end
if not g then
  return hand_over({now, -1, repaired, #pushed, late, templates, misses}, back, gone, token, now + ttl)
end
local keep, released, parked = gate_claimed(back, now, g)
table.insert(released, 1, parked)
return hand_over({now, -1, repaired, #pushed, late, templates, misses, released}, keep, gone, token, now + ttl)
