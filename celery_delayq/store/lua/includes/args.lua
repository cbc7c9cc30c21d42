-- args: read a script's arguments.
--
-- int_arg(i): ARGV[i] as a whole number (a time in ms, a count), or nil when it is not one
-- (the scripts check every argument before their first write, so bad input changes nothing).
local function int_arg(i)
  local n = tonumber(ARGV[i])
  if n and n == math.floor(n) and n > -9007199254740992 and n < 9007199254740992 then
    return n
  end
  return nil
end
