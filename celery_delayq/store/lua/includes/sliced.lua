-- sliced: one command over more values than one Lua unpack takes.
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
