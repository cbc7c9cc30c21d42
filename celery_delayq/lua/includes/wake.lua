-- wake: the shard's wake marker (KEYS[4]) and the wake message.
--
-- The marker holds the ms by which some beat will look at this shard again (WAKE_NEVER:
-- nothing is stored). The wake message, published on the wake channel, is
-- "<shard index>:<due ms>"; a sleeping beat that reads it looks at that shard by then. The
-- Python mirror is celery_delayq/leases.py (wake_message, parse_wake).
local WAKE_NEVER = '9999999999999999'
-- wake_message(shard, due): the message, from the shard index and the due time as text.
local function wake_message(shard, due)
  return shard .. ':' .. due
end
-- wake(channel, shard, due, text): when due (ms, a number) is earlier than the marker, or
-- there is no marker, set the marker to it and publish the wake message. text is the due
-- time as the caller wrote it (an ARGV), stored and published as is; nil: its digits.
local function wake(channel, shard, due, text)
  local marker = tonumber(redis.call('GET', KEYS[4]))
  if marker == nil or due < marker then
    text = text or string.format('%d', due)
    redis.call('SET', KEYS[4], text)
    redis.call('PUBLISH', channel, wake_message(shard, text))
  end
end
-- rearm(): set the marker to the earliest score left in the shard (KEYS[1]), or to WAKE_NEVER
-- when it is empty; that score as a number, or -1 (claim's and push's "next").
local function rearm()
  local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if head[2] then
    redis.call('SET', KEYS[4], head[2])
    return tonumber(head[2])
  end
  redis.call('SET', KEYS[4], WAKE_NEVER)
  return -1
end
