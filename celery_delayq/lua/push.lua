--[[ push: claim a shard's due jobs and deliver, inside Redis, those whose message has a template.

The in-Redis delivery path (docs/how-it-works.md, "The in-Redis path"). Used only when the
Celery broker is this same Redis server and database, as deliver.lua. For each due job whose
kombu message can be made from a stored *template* (wire.py: one per job shape, that is per task,
options and producer), this script fills the template in with the job's own values, LPUSHes the
message into its queue's list and removes the job, all in this one step: no job data goes to the
beat and back, and a beat that dies at any point duplicates nothing. Every other due job (no
template yet, flow control, a schedule point, an expiry, a corrupt envelope, a push refused) is
claimed exactly as claim.lua claims it and returned to the beat, which delivers it the other way.

KEYS[1] due, KEYS[2] jobs, KEYS[3] leases, KEYS[4] wake: as claim.lua
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them)
The templates hash ("<base>wire", built from KEYS[1] minus "due", so it shares the shard's hash
tag) maps "<space>|<shape key>" to a template (JSON, see wire.py's lua_template) or to "-" (this
shape goes to the beat); a template that does not read, or names an empty queue or list key, is
a miss (the beat writes it again, or "-"). The queue lists are not declared in KEYS: this script is never sent to
a Redis Cluster (the lists live outside the shard's slot there).

ARGV[1] token: the claimer's lease token (no "|" in it)
ARGV[2] batch: most jobs to take
ARGV[3] reclaim TTL in ms (for the jobs returned to the beat)
ARGV[4] space: the beat's template namespace (a digest of the settings a message depends on)
ARGV[5] tag prefix: the delivery tags are this text followed by 12 hex digits, one per message
ARGV[6] the largest envelope (bytes) delivered here (delayq_max_payload); a longer one goes to the beat
ARGV[7], ARGV[8]: header names (gate, batch completion): an envelope naming either goes to the beat

Returns {now ms, next ms, repaired, pushed, P, (lateness ms, count) x P, U, (queue, task, count)
x U, then id, envelope, due ms, tries, miss for each job returned to the beat}: next, repaired
and the returned jobs as claim.lua; the lateness of the pushed jobs (the server's TIME after the
pushes minus each job's due time), counted by value; the templates used, by queue and task;
miss is the templates-hash field to fill for this job's shape (once per shape and call), or "".

A shape key is the envelope's fields less the job's own (id, argument reprs, body, creation time),
written with each string's length (so two shapes never share a key). A number in a shape must be a
whole number of at most 53 bits, and an empty object or array is not taken: such a shape goes to
the beat. (Numbers are compared as values: 1 and 1.0 in a header are one shape.)

Memory: no script flags. When Redis is over maxmemory the first write (an LPUSH, or the lease of a
returned job) is refused: nothing is written and the call fails with the OOM error; the beat
claims that shard with claim.lua then (which may run when full), and deliver.lua's pushes are
refused in the same way (see deliver.lua: a full broker must not grow). Bad arguments are refused
with an error before anything is written.
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
if space == nil or space == '' or tag_prefix == nil or gate_header == nil or done_header == nil then
  return redis.error_reply('delayq push: space, tag prefix and header names are required')
end
local WIRE = string.sub(KEYS[1], 1, #KEYS[1] - 3) .. 'wire'
local PLAIN_TAIL = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
-- SHAPE_ORDER: the fields a shape key is made of, in this order (each name is followed by its value
-- as canon writes it, which never opens with a letter of a name: the key reads back one way)
local SHAPE_ORDER = {'v', 't', 'o', 'r', 'ct', 'ce', 'q', 'h', 'p'}
local SHAPE_FIELDS = {}
for _, name in ipairs(SHAPE_ORDER) do
  SHAPE_FIELDS[name] = true
end
local OWN_FIELDS = {a = true, k = true, j = true, b = true, c = true}
local floor = math.floor
local byte, char, sub, find, format = string.byte, string.char, string.sub, string.find, string.format

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end

-- canon(v): v (decoded by cjson) written so that two different values never give one text; nil
-- for what is not taken (a fraction, a number past 53 bits, an empty table, a mixed table).
local function canon(v)
  local tv = type(v)
  if tv == 'string' then
    return 's' .. #v .. ':' .. v
  elseif tv == 'number' then
    if v == floor(v) and v > -9007199254740992 and v < 9007199254740992 then
      return format('i%.0f;', v)
    end
    return nil
  elseif tv == 'boolean' then
    return v and 'T' or 'F'
  elseif v == cjson.null then
    return 'N'
  elseif tv ~= 'table' then
    return nil
  end
  local count = 0
  for _ in pairs(v) do
    count = count + 1
  end
  if count == 0 then
    return nil
  end
  local parts
  if #v == count then
    parts = {'l', count, ':'}
    for i = 1, count do
      local c = canon(v[i])
      if c == nil then
        return nil
      end
      parts[#parts + 1] = c
    end
    return table.concat(parts)
  end
  local names = {}
  for name in pairs(v) do
    if type(name) ~= 'string' then
      return nil
    end
    names[#names + 1] = name
  end
  table.sort(names)
  parts = {'d', count, ':'}
  for _, name in ipairs(names) do
    local c = canon(v[name])
    if c == nil then
      return nil
    end
    parts[#parts + 1] = canon(name)
    parts[#parts + 1] = c
  end
  return table.concat(parts)
end

-- jstr(s): s as Python's json writes a string (ensure_ascii: \uXXXX for every byte outside
-- printable ASCII, UTF-16 surrogate pairs past U+FFFF), or nil when s is not valid UTF-8.
local ESCAPES = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
  ['\b'] = '\\b', ['\f'] = '\\f'}
local function jstr(s)
  if not find(s, '[^ -~]') and not find(s, '"', 1, true) and not find(s, '\\', 1, true) then
    return '"' .. s .. '"'
  end
  local out, i, n = {'"'}, 1, #s
  while i <= n do
    local c = byte(s, i)
    if c < 128 then
      local ch = char(c)
      local esc = ESCAPES[ch]
      if esc then
        out[#out + 1] = esc
      elseif c < 32 or c == 127 then
        out[#out + 1] = format('\\u%04x', c)
      else
        out[#out + 1] = ch
      end
      i = i + 1
    else
      local size, cp
      if c >= 240 and c < 245 then
        size, cp = 4, c - 240
      elseif c >= 224 then
        size, cp = 3, c - 224
      elseif c >= 194 and c < 224 then
        size, cp = 2, c - 192
      else
        return nil
      end
      if i + size - 1 > n then
        return nil
      end
      for k = i + 1, i + size - 1 do
        local b = byte(s, k)
        if b < 128 or b > 191 then
          return nil
        end
        cp = cp * 64 + (b - 128)
      end
      if (size == 3 and cp < 2048) or (size == 4 and (cp < 65536 or cp > 1114111)) then
        return nil
      end
      if cp >= 65536 then
        cp = cp - 65536
        out[#out + 1] = format('\\u%04x\\u%04x', 55296 + floor(cp / 1024), 56320 + cp % 1024)
      else
        out[#out + 1] = format('\\u%04x', cp)
      end
      i = i + size
    end
  end
  out[#out + 1] = '"'
  return table.concat(out)
end

-- base64(s): standard base64 with padding (kombu's body encoding for Redis). PAIRS maps 12 bits to
-- their two letters (built at the first use in a call).
local B64 = {}
local alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
for i = 1, 64 do
  B64[i - 1] = sub(alphabet, i, i)
end
local PAIRS
local function base64(s)
  if PAIRS == nil then
    PAIRS = {}
    for i = 0, 4095 do
      PAIRS[i] = B64[floor(i / 64)] .. B64[i % 64]
    end
  end
  local out, n, j = {}, #s, 0
  local full = n - n % 3
  for i = 1, full, 3 do
    local a, b, c = byte(s, i, i + 2)
    local v = a * 65536 + b * 256 + c
    local high = floor(v / 4096)
    out[j + 1] = PAIRS[high]
    out[j + 2] = PAIRS[v - high * 4096]
    j = j + 2
  end
  if n - full == 1 then
    local v = byte(s, n) * 65536
    out[j + 1] = B64[floor(v / 262144)] .. B64[floor(v / 4096) % 64] .. '=='
  elseif n - full == 2 then
    local a, b = byte(s, n - 1, n)
    local v = a * 65536 + b * 256
    out[j + 1] = B64[floor(v / 262144)] .. B64[floor(v / 4096) % 64] .. B64[floor(v / 64) % 64] .. '='
  end
  return table.concat(out)
end

-- seconds(ms): repr(ms / 1000.0) as Python writes it (the delayq_due header), for 0 <= ms.
local function seconds(ms)
  local frac = ms % 1000
  if frac == 0 then
    return format('%.0f.0', (ms - frac) / 1000)
  end
  local text = format('%.0f.%03d', (ms - frac) / 1000, frac)
  return (string.gsub(text, '0+$', ''))
end

-- iso(ms): due.due_iso(ms), the UTC time as datetime.isoformat() writes it, for years 1970-9999.
local function iso(ms)
  local frac = ms % 1000
  local s = (ms - frac) / 1000
  local days = floor(s / 86400)
  local rest = s - days * 86400
  -- civil_from_days (H. Hinnant)
  local z = days + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local d = doy - floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then
    y = y + 1
  end
  local text = format('%04d-%02d-%02dT%02d:%02d:%02d', y, m, d, floor(rest / 3600), floor(rest / 60) % 60, rest % 60)
  if frac ~= 0 then
    text = text .. format('.%03d000', frac)
  end
  return '"' .. text .. '+00:00"'
end

-- templates: field -> decoded template, or false (go to the beat; missing: a miss)
local templates, missed = {}, {}
local function template(field)
  local found = templates[field]
  if found == nil then
    local raw = redis.call('HGET', WIRE, field)
    if not raw then
      found = 'miss'
    elseif raw == '-' then
      found = false
    else
      local ok, decoded = pcall(cjson.decode, raw)
      found = ok and type(decoded) == 'table' and type(decoded.l) == 'table' and type(decoded.h) == 'table'
        and #decoded.l == #decoded.h + 1 and type(decoded.k) == 'string' and type(decoded.q) == 'string'
        and type(decoded.t) == 'string' and decoded.k ~= '' and decoded.q ~= '' and decoded or false
      if not found then
        found = 'miss'  -- a template that does not read is written again by the beat
      else
        for _, hole in ipairs(found.h) do
          if type(hole) ~= 'number' or hole < 0 or hole > 6 then
            found = 'miss'
            break
          end
          if hole == 6 then
            found.e = true
          end
        end
        for _, literal in ipairs(found ~= 'miss' and found.l or {}) do
          if type(literal) ~= 'string' then
            found = 'miss'
            break
          end
        end
      end
    end
    templates[field] = found
  end
  return found
end

local bodies = {[true] = {}, [false] = {}}  -- base64 or not -> body text -> its JSON
local times = {}  -- due ms -> {seconds, iso or false}
local tags = 0

-- prepare(stored): what every job of this envelope text (less its creation time) shares: {pieces,
-- template} where pieces are the template's literals with the argument reprs and the body filled in
-- and merged, and the numbers 0 (id), 4 (due seconds), 5 (tag), 6 (eta) where a job's own value goes;
-- or false (the job goes to the beat), and the miss field when the shape has no template yet.
local function prepare(stored)
  if sub(stored, 1, 11) ~= '{"v":2,"t":' or find(stored, gate_header, 1, true)
      or find(stored, done_header, 1, true) then
    return false
  end
  local ok, d = pcall(cjson.decode, stored)
  if not ok or type(d) ~= 'table' or d.v ~= 2 then
    return false
  end
  for name in pairs(d) do
    if not SHAPE_FIELDS[name] and not OWN_FIELDS[name] then
      return false
    end
  end
  local text, plain = d.j, true
  if text == nil then
    text, plain = d.b, false
  end
  local args, kwargs = d.a or '()', d.k or '{}'
  if type(text) ~= 'string' or type(args) ~= 'string' or type(kwargs) ~= 'string' then
    return false
  end
  local parts = {space, plain and '|j|' or '|b|'}
  for _, name in ipairs(SHAPE_ORDER) do
    local value = d[name]
    if value ~= nil then
      local c = canon(value)
      if c == nil then
        return false
      end
      parts[#parts + 1] = name
      parts[#parts + 1] = c
    end
  end
  local field = table.concat(parts)
  local t = template(field)
  if t == 'miss' then
    if missed[field] then
      return false
    end
    missed[field] = true
    return false, field
  elseif not t then
    return false
  end
  if plain then
    text = text .. PLAIN_TAIL
  end
  local cache = bodies[t.b == 1]
  local body = cache[text]
  if body == nil then
    if t.b == 1 then
      body = '"' .. base64(text) .. '"'
    else
      body = jstr(text)
    end
    cache[text] = body
  end
  local fixed = {[1] = jstr(args), [2] = jstr(kwargs), [3] = body}
  if not (fixed[1] and fixed[2] and body) then
    return false
  end
  -- the delivery tag's quotes and prefix join the literals around it: its hole takes 12 hex digits
  local pieces, run = {}, {t.l[1]}
  for n, hole in ipairs(t.h) do
    if fixed[hole] then
      run[#run + 1] = fixed[hole]
    else
      if hole == 5 then
        run[#run + 1] = '"' .. tag_prefix
      end
      pieces[#pieces + 1] = table.concat(run)
      pieces[#pieces + 1] = hole
      run = hole == 5 and {'"'} or {}
    end
    run[#run + 1] = t.l[n + 1]
  end
  pieces[#pieces + 1] = table.concat(run)
  -- Celery's message as kombu writes it: id, root_id, due, correlation_id, tag (one concatenation)
  local usual = #pieces == 11 and pieces[2] == 0 and pieces[4] == 0 and pieces[6] == 4 and pieces[8] == 0
    and pieces[10] == 5
  return {pieces, t, usual}
end

-- message(id, stored, due): the list key, the message and the template, or nil and the miss field.
-- The shared part is prepared once per call for each envelope text less its creation time.
local prepared = {}
local function message(id, stored, due)
  if #stored + #id + 16 > max_payload or due < 0 or due > 253402300799999 then
    return nil
  end
  local shared = stored
  local c = find(stored, ',"c":', #stored - 30, true)
  if c and find(stored, '^%d+}$', c + 5) then
    shared = sub(stored, 1, c - 1)
  end
  local ready = prepared[shared]
  if ready == nil then
    local miss
    ready, miss = prepare(stored)
    prepared[shared] = ready
    if miss then
      return nil, miss
    end
  end
  if not ready then
    return nil
  end
  local t = ready[2]
  local idj = jstr(id)
  if not idj then
    return nil
  end
  local when = times[due]
  if when == nil then
    when = {seconds(due), t.e and iso(due)}
    times[due] = when
  elseif t.e and not when[2] then
    when[2] = iso(due)
  end
  tags = tags + 1
  local tag = format('%012x', tags)
  local pieces = ready[1]
  if ready[3] then
    local p = pieces
    return t.k, p[1] .. idj .. p[3] .. idj .. p[5] .. when[1] .. p[7] .. idj .. p[9] .. tag .. p[11], t
  end
  local values = {[0] = idj, [4] = when[1], [5] = tag, [6] = when[2]}
  local parts = {}
  for n = 1, #pieces do
    local piece = pieces[n]
    if type(piece) == 'number' then
      parts[n] = values[piece]
    else
      parts[n] = piece
    end
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
    local due = tonumber(found[i + i])
    local tries = 0
    if leases[i] then
      local d, n = lease_read(leases[i])
      if d then
        due, tries = d, n
      else
        repaired = repaired + 1
      end
    end
    local key, text, t = message(id, stored, due)
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
