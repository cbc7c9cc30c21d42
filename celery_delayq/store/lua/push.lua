--[[ push: claim a shard's due jobs and deliver, inside Redis, those whose message has a template.

Pushing on claim (docs/how-it-works.md); the broker is this Redis server and database (never a
Cluster: the queue lists are not in KEYS). A job whose envelope opens with its own texts, JSON-escaped
(envelope.py: "a", "k", "j" or "b"), and whose shape (the text from "t" to "c", or its id "S") has a
template (wire.py's lua_template) is joined into its message, LPUSHed and removed in one step:
nothing is decoded or encoded here, and a beat that dies at any point duplicates nothing. The other
due jobs (no template, an expiry, flow control, a schedule point, too long, a refused push) are
leased and returned as claim.lua does, for the beat (which dead-letters what is corrupt).
KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake as claim.lua (KEYS[5] dead, KEYS[6]
schedules, KEYS[7] history: unused); the templates hash: KEYS[1] with "wire" for "due". ARGV[1..3]
(token, batch, reclaim TTL ms) and [9..14] (optional: the gate in the claim) are claim.lua's
ARGV[1..3] and [4..9]; ARGV[4] the template space (a field: "<space>|<j or b>|<shape>"), [5] the
delivery tag prefix (a tag: it, then the job's id), [6] the longest envelope pushed here (bytes),
[7] and [8] the gate and batch completion header names (a shape naming one is the beat's).
Returns as claim.lua, with after "repaired": pushed, {lateness ms, count, ...} (TIME after the
pushes less the due time, by due time), {queue, task, count, ...} (the templates used), {id, field,
...} (the field to fill for the first job of each shape met without a template). Memory: no script
flags; over maxmemory the first write (an LPUSH or a lease) is refused: the call fails with the OOM
error having written nothing, and the beat claims with claim.lua.
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
local HOLES = {[0] = true, true, true, true, true, true}  -- 0 id, 1 args, 2 kwargs, 3 body, 4 due, 5 tag

-- template(shape, kind): the shape's template for body field kind ("j" or "b"), read once a call
-- (JSON: literals l around holes h, list key k, queue q, task t), its literals in place in t.parts,
-- the holes left at even indexes; else false (the beat's: "-", an expiry or a flow-control header
-- in the shape, an "S" not hex), or false and the field to fill (none yet, or one that does not read).
local seen, values = {j = {}, b = {}}, {}  -- values: a job's, by hole (message)
local function template(shape, kind)
  if seen[kind][shape] ~= nil then
    return seen[kind][shape]
  end
  seen[kind][shape] = false
  if find(shape, ',"x":', 1, true) or find(shape, gate_header, 1, true)
      or find(shape, done_header, 1, true) or find(shape, '^"S":') and not find(shape, '^"S":"%x+"$') then
    return false
  end
  local field = space .. '|' .. kind .. '|' .. shape
  local raw = redis.call('HGET', WIRE, field)
  local ok, t = pcall(cjson.decode, raw or '')
  if raw == '-' then
    return false
  elseif not (ok and type(t) == 'table' and type(t.l) == 'table' and type(t.h) == 'table'
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
  seen[kind][shape] = t
  return t
end

-- message(job): the list key, message and template of a job its template delivers; else nil (also
-- for a job too long, an id unfit for a tag, due past year 9999) and, on its shape's first miss,
-- the field to fill. "a", "k" and the body ("j" or "b") each end at the first '","' after them (in
-- JSON-escaped text every '"' follows a backslash); the shape ("t" or "S" on) ends at "c", the last.
local function message(job)
  local stored, id, due = job.envelope, job.id, job.due
  if #stored + #id + 16 > max_payload or not find(id, '^[%w%-_.:]*$') or not find(due, '^%d+$')
      or #due > 14 and tonumber(due) > 253402300799999 or sub(stored, 1, 12) ~= '{"v":3,"a":"' then
    return nil
  end
  local a = find(stored, '","', 13, true)
  local k = a and find(stored, '^","k":"', a) and find(stored, '","', a + 7, true)
  local kind = k and match(stored, '^","([jb])":"', k)
  local b = kind and find(stored, '","', k + 7, true)
  local c = b and find(stored, '^","[tS]":', b) and find(stored, ',"c":', #stored - 24, true)
  local shape = c and find(stored, '^%d+}$', c + 5) and sub(stored, b + 2, c - 1)
  if not shape then
    return nil
  end
  local t, miss = template(shape, kind)
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
  local list = key and lists[key]
  job.t = t
  if not key then
    back[#back + 1] = job
    misses[#misses + 1], misses[#misses + 2] = text and job.id, text  -- (no field: nothing added)
  elseif list then
    list[1][#list[1] + 1], list[2][#list[2] + 1] = text, job
  else
    lists[key], order[#order + 1] = {{text}, {job}}, key
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
        pushed[#pushed + 1], leased[#leased + 1] = job.id, job.leased and job.id or nil
        dues[job.due], used[job.t] = (dues[job.due] or 0) + 1, (used[job.t] or 0) + 1
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
return hand_over_gated({now, -1, repaired, #pushed, late, templates, misses}, back, gone, token, now, ttl, g)
