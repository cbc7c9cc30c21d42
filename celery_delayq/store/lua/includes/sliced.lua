-- sliced: one command over more values than one Lua unpack takes (call_sliced, hmget).
--
-- call_sliced(command, key, values, step): redis.call(command, key, ...) for the values in
-- slices of at most UNPACK_MAX (the loader's prelude: scripts.LUA_UNPACK_MAX; Lua's C stack
-- fails an unpack of about 8000 values), each slice a multiple of step so that pairs (ZADD
-- score, member) stay whole (claim's and enqueue's ZADD of a whole batch).
local function call_sliced(command, key, values, step)
  local size = UNPACK_MAX - UNPACK_MAX % step
  for first = 1, #values, size do
    redis.call(command, key, unpack(values, first, math.min(first + size - 1, #values)))
  end
end
-- hmget(key, fields): HMGET over any number of fields (in slices of UNPACK_MAX, as
-- call_sliced); the values in the order of fields (false: no such field).
local function hmget(key, fields)
  local out = {}
  for first = 1, #fields, UNPACK_MAX do
    local got = redis.call('HMGET', key, unpack(fields, first, math.min(first + UNPACK_MAX - 1, #fields)))
    for i = 1, #got do
      out[#out + 1] = got[i]
    end
  end
  return out
end
