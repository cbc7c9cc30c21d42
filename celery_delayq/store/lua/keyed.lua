--[[ keyed: store one job debounced or throttled by a key (apply_async's debounce, throttle).

KEYS[1] due        the job's member and due time (and a replaced job's, removed)
KEYS[2] jobs       the job's envelope, written (a replaced job's, removed)
KEYS[3] leases     read: a job a beat holds is never replaced
KEYS[4] wake       lowered (with a wake message) when the job is due before it
KEYS[5] dead, KEYS[6] schedules, KEYS[7] history: not used here
(the shard's seven keys, with its hash tag, in the order every script takes them; the shard
is the key's: every job id of a key begins with its hash tag)
KEYS[8] debounce   hash: key -> "<id of its pending job>|<ms of the call that opened its window>"
KEYS[9] debounce:due  sorted set: key -> its pending job's due (ms): records are dropped a day
                   after it (at most 100 a call)
KEYS[10] throttle  sorted set: key -> the end (ms) of its throttle window

ARGV[1] mode: "debounce" or "throttle"
ARGV[2] wake channel (pub/sub), ARGV[3] shard index, echoed in the wake message
ARGV[4] key, ARGV[5] job id, ARGV[6] envelope (stored form)
ARGV[7] debounce: wait (ms >= 0): the job is due that long after this call;
        throttle: the job's due, a time (ms) when ARGV[9] is "at", a delay (ms >= 0) when "in"
ARGV[8] debounce: max wait (ms > 0, or 0: none): never due later than that long after the
        call that opened the window; throttle: the period (ms > 0)
ARGV[9] clock ("at" or "in"; debounce: "in")

Debounce: when the key's record names a job that is stored and no beat holds it, that job is
replaced by this one (its id gone: status 2, the reply names it); else this job opens a new
window (status 1). The job is due at now + wait, but no later than the window's opening + max
wait. Throttle: while the key's window is open, nothing is stored (status 5, due: the window's
end); else the job is stored (status 1) and the window runs a period from now.
Returns {now, status, due ms, replaced id or "", corrupt}: corrupt is 1 when a record was not
of its type (it is replaced, so it cannot stop a key forever, and the caller reports it).
The job is written first: a full Redis refuses that write, and nothing changes.
Bad arguments are refused with an error before anything is written.
]]
--!include args
--!include wake
local mode = ARGV[1]
if mode ~= 'debounce' and mode ~= 'throttle' then
  return redis.error_reply('delayq keyed: mode must be "debounce" or "throttle"')
end
local id, key, envelope = ARGV[5], ARGV[4], ARGV[6]
local first_arg, second_arg = int_arg(7), int_arg(8)
if ARGV[9] ~= 'at' and ARGV[9] ~= 'in' then
  return redis.error_reply('delayq keyed: clock must be "at" or "in"')
end
if id == '' or key == '' or first_arg == nil or second_arg == nil
    or (ARGV[9] == 'in' and first_arg < 0) or second_arg < 0
    or (mode == 'throttle' and second_arg == 0) or (mode == 'debounce' and ARGV[9] ~= 'in') then
  return redis.error_reply('delayq keyed: bad arguments: ' .. mode .. ' ' .. tostring(ARGV[7])
    .. ' ' .. tostring(ARGV[8]) .. ' ' .. tostring(ARGV[9]))
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local corrupt = 0
local function of_type(k, kind)
  local found = redis.call('TYPE', k)['ok']
  if found ~= kind and found ~= 'none' then
    corrupt = 1
    return false
  end
  return true
end
local status, due, replaced = 1, 0, ''
if mode == 'throttle' then
  local open_until = of_type(KEYS[10], 'zset') and tonumber(redis.call('ZSCORE', KEYS[10], key))
  due = first_arg
  if ARGV[9] == 'in' then
    due = now + first_arg
  end
  if open_until and open_until > now then
    return {now, 5, open_until, '', corrupt}
  end
  redis.call('HSET', KEYS[2], id, envelope)
  if corrupt == 1 then
    redis.call('DEL', KEYS[10])
  end
  redis.call('ZADD', KEYS[10], now + second_arg, key)
  redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now)
else
  local opened = now
  local records_ok = of_type(KEYS[8], 'hash')
  local dues_ok = of_type(KEYS[9], 'zset')
  local record = records_ok and redis.call('HGET', KEYS[8], key)
  if record then
    local previous, since = string.match(record, '^(.+)|(%d+)$')
    if not previous then
      corrupt = 1
    elseif previous ~= id and redis.call('HEXISTS', KEYS[2], previous) == 1
        and redis.call('HEXISTS', KEYS[3], previous) == 0 then
      replaced, opened, status = previous, tonumber(since), 2
    end
  end
  due = now + first_arg
  if second_arg > 0 and opened + second_arg < due then
    due = opened + second_arg
  end
  redis.call('HSET', KEYS[2], id, envelope)
  if replaced ~= '' then
    redis.call('ZREM', KEYS[1], replaced)
    redis.call('HDEL', KEYS[2], replaced)
  end
  if not records_ok then
    redis.call('DEL', KEYS[8])
  end
  if not dues_ok then
    redis.call('DEL', KEYS[9])
  end
  redis.call('HSET', KEYS[8], key, id .. '|' .. string.format('%d', opened))
  redis.call('ZADD', KEYS[9], due, key)
  local ended = redis.call('ZRANGEBYSCORE', KEYS[9], '-inf', now - 86400000, 'LIMIT', 0, 100)
  if #ended > 0 then
    redis.call('HDEL', KEYS[8], unpack(ended))
    redis.call('ZREM', KEYS[9], unpack(ended))
  end
end
redis.call('ZADD', KEYS[1], due, id)
wake(ARGV[2], ARGV[3], due)
return {now, status, due, replaced, corrupt}
