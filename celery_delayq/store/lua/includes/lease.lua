-- lease: the lease entry of a job a beat holds, and the check that a caller still holds it.
--
-- KEYS[3] (leases) maps a job id to "<due ms>|<tries>|<token>": the job's original due
-- time, how many times it has been claimed, and the claimer's token (no "|" in it). The
-- Python mirror is celery_delayq/store/lua_formats.py (tests/test_lua_formats.py compares the two).
--
-- lease_entry(due, tries, token): the entry (due and tries whole numbers).
local function lease_entry(due, tries, token)
  return string.format('%d|%d|%s', due, tries, token)
end
-- lease_read(entry): the entry's due ms and tries (numbers), or nil when it does not read
-- as "<due ms>|<tries>|..." (corrupt data: the scripts treat it as an expired lease).
local function lease_read(entry)
  local d, n = string.match(entry, '^(-?%d+)|(%d+)|')
  if d and n then
    return tonumber(d), tonumber(n)
  end
  return nil
end
-- lease_holds(entry, token): does the entry end with "|<token>"? (The whole token: a
-- token that only ends like it does not hold it. The rest of the entry is not read.)
local function lease_holds(entry, token)
  local suffix = '|' .. token
  return string.sub(entry, -#suffix) == suffix
end
-- held(id, token): does the caller with this token hold job id's lease (KEYS[3])?
local function held(id, token)
  local entry = redis.call('HGET', KEYS[3], id)
  return entry and lease_holds(entry, token)
end
