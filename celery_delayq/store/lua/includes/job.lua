-- job: remove one job from its shard.
--
-- remove_job(id): deletes job id's member of KEYS[1] (due), its envelope in KEYS[2] (jobs)
-- and its lease entry in KEYS[3] (leases), in that order: the first write is a ZREM, which
-- Redis 6.2 (no script flags) never refuses when over maxmemory. Returns 1 when the job had
-- a lease entry (a beat held it), else 0. Any part already missing is skipped.
local function remove_job(id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  return redis.call('HDEL', KEYS[3], id)
end
