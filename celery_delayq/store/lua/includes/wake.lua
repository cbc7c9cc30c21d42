-- wake: the shard's wake marker (KEYS[4]) and the wake message.
--
-- The marker holds the ms by which some beat will look at this shard again (WAKE_NEVER:
-- nothing is stored). The wake message, published on the wake channel, is
-- "<shard index>:<due ms>"; a sleeping beat that reads it looks at that shard by then. The
-- Python mirror is celery_delayq/store/lua_formats.py (wake_message, parse_wake).
local WAKE_NEVER = '9999999999999999'
-- wake_message(shard, due): the message, from the shard index and the due time as text.
local function wake_message(shard, due)
  return shard .. ':' .. due
end
-- The safety poll of every beat reads the markers (Store.wake_markers) and claims only the
-- shards whose marker is due, missing or unreadable: so a marker is never later than the
-- earliest score of its shard's due set, except while it is missing or unreadable.
--
-- wake(channel, shard, due, text): when due (ms, a number) is earlier than the marker, or
-- there is no marker, set the marker to it and publish the wake message. text is the due
-- time as the caller wrote it (an ARGV), stored and published as is; nil: its digits. A
-- marker that was missing or did not read becomes the earliest of due and the shard's head
-- (KEYS[1]), so it does not pass over a job stored while it was lost.
local function wake(channel, shard, due, text)
  local marker = tonumber(redis.call('GET', KEYS[4]))
  if marker == nil or due < marker then
    text = text or string.format('%d', due)
    local stored = text
    if marker == nil then
      local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
      if head[2] and tonumber(head[2]) < due then
        stored = head[2]
      end
    end
    redis.call('SET', KEYS[4], stored)
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
-- lower_marker(due): set the marker to due (ms, a number) when it is earlier, with no wake
-- message: for a score moved earlier that no beat need look at at once (a slot expiry:
-- hold.lua, slot_renew.lua); the safety poll claims the shard by then. A missing or
-- unreadable marker is left: the safety poll claims such a shard anyway.
local function lower_marker(due)
  local marker = tonumber(redis.call('GET', KEYS[4]))
  if marker ~= nil and due < marker then
    redis.call('SET', KEYS[4], string.format('%d', due))
  end
end
