"""What tests need of a store and of Redis itself: a :class:`Store` on a URL and the ``store``
fixture (in ``pytest_plugins``), the server's clock, ids on one shard, snapshots
of the database, the broker's lists and the ids published there, command statistics, and jobs
written raw, buried or passed through a key's gate (:func:`gate_due`) the way a beat does, and
leases ended on the server (:func:`expire_leases`) instead of waiting for them to run out."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.config import DelayQConfig
from celery_delayq.flow.gate import Gate, member_id
from celery_delayq.schedules.rules import IntervalRule
from celery_delayq.store import lateness
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.flow import GateDecision
from celery_delayq.store.keys import KeySpace
from celery_delayq.store.stored_forms import joined_form, loaded_form, shape_id_of


def make_store(url: str, **settings: Any) -> Store:
    """A :class:`Store` on ``url`` with ``delayq_<name>`` settings given as ``name=value``."""
    values = {"delayq_url": url, **{f"delayq_{k}": v for k, v in settings.items()}}
    return Store(DelayQConfig.from_mapping(values))


def server_ms(client: Any) -> int:
    """The server's clock (``TIME``) in ms, as the claim script computes it."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# KEYS: a shard's due, leases and wake keys. ARGV: job ids (none: every job the shard's leases
# hash holds). Each held job that is still in the due set gets the score a lease that ran out
# 1 ms ago has (the server's TIME - 1, the claim script's clock), and the wake marker is brought
# down to it when later, as after a real expiry (the claim set the marker to the shard's next
# score, which was at most the lease's end). The lease entry is left as it is: the claim reads
# it to know the job's due time and tries. Returns the ids whose lease it ended.
_EXPIRE_LEASES = """
local t = redis.call('TIME')
local ended = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - 1)
local ids = ARGV
if #ids == 0 then
  ids = redis.call('HKEYS', KEYS[2])
end
local done = {}
for _, id in ipairs(ids) do
  if redis.call('HEXISTS', KEYS[2], id) == 1 and redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], 'XX', ended, id)
    done[#done + 1] = id
  end
end
if #done > 0 then
  local marker = tonumber(redis.call('GET', KEYS[3]))
  if marker == nil or marker > tonumber(ended) then
    redis.call('SET', KEYS[3], ended)
  end
end
return done
"""


def expire_leases(store: Store, job_ids: Iterable[str] | None = None) -> list[str]:
    """End the leases of ``job_ids`` (every lease in the store when None) now, on the server,
    as if each had run out 1 ms ago: what a test would otherwise sleep a reclaim TTL for. The
    next claim takes the jobs again (tries + 1, their due time kept) and the holder's renew
    or ack is refused once another beat has claimed them. Returns the ids whose lease ended
    (a job not leased, or gone, is left alone)."""
    if job_ids is None:
        work = [(keys, []) for keys in store.keys.all_shards()]
    else:
        by_shard: dict[int, list[str]] = {}
        for job_id in job_ids:
            by_shard.setdefault(store.keys.shard_of(job_id), []).append(job_id)
        work = [(store.keys.shard(index), ids) for index, ids in by_shard.items()]
    ended: list[str] = []
    for keys, ids in work:
        done = store.client.eval(_EXPIRE_LEASES, 3, keys.due, keys.leases, keys.wake, *ids)
        ended.extend(item.decode() if isinstance(item, bytes) else str(item) for item in done)
    return ended


# KEYS: a key's running set (job id -> slot expiry ms). Every slot's expiry becomes the server's
# TIME - 1: the slots ran out 1 ms ago, as when delayq_slot_ttl passes with no renewal.
_EXPIRE_SLOTS = """
local t = redis.call('TIME')
local ended = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - 1)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], 'XX', ended, id)
end
return ids
"""


def expire_slots(store: Store, key: str) -> list[str]:
    """End the slots of ``key``'s running jobs now, on the server, as if ``delayq_slot_ttl``
    had passed with no renewal; the jobs' leases are left as they are. Returns their ids."""
    done = store.client.eval(_EXPIRE_SLOTS, 1, store.keys.for_key(key).running(key))
    return [item.decode() if isinstance(item, bytes) else str(item) for item in done]


def ids_on_shard(keys: KeySpace, shard: int, n: int, stem: str = "job") -> list[str]:
    """``n`` job ids that all hash to ``shard``."""
    found: list[str] = []
    i = 0
    while len(found) < n:
        candidate = f"{stem}-{i}"
        if keys.shard_of(candidate) == shard:
            found.append(candidate)
        i += 1
    return found


def snapshot(url: str) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key of the database with its type and DUMP: equal snapshots mean nothing changed."""
    raw = redis.Redis.from_url(url)
    try:
        return {key: (raw.type(key), raw.dump(key)) for key in raw.keys("*")}
    finally:
        raw.close()


def broker_lists(client: Any) -> dict[str, list[dict[str, Any]]]:
    """Messages in every list key (the Redis broker's queues), decoded, oldest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in client.keys("*"):
        if client.type(key) == "list":
            # kombu LPUSHes and consumers BRPOP: the oldest message is at the right end.
            out[key] = [json.loads(m) for m in reversed(client.lrange(key, 0, -1))]
    return out


def command_calls(client: Any, command: str) -> tuple[int, int]:
    """``(calls, failed_calls)`` of ``command`` from ``INFO commandstats`` (Lua calls count too)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)), int(stats.get("failed_calls", 0))


@pytest.fixture
def store(redis_url: str) -> Iterator[Store]:
    """Leases last 30 s: they never run out during a test unless it ends them
    (:func:`expire_leases`)."""
    s = make_store(redis_url, reclaim_ttl=30.0)
    yield s
    s.close()


#: How soon (ms) the first point of a schedule added with :func:`rule_due_soon` is due.
SOON_MS = 20


#: The interval of :func:`rule_due_soon` (ms): the latest its first point can be.
SOON_EVERY_MS = 100


def rule_due_soon(store: Store) -> IntervalRule:
    """Every :data:`SOON_EVERY_MS`, on a grid whose next point is :data:`SOON_MS` after now
    on ``store``'s server clock: a schedule of ``store``'s app added at once with this rule has
    its first point due that soon, and when the add reads the clock later than that (a loaded
    machine), the next point of the grid, within SOON_EVERY_MS. The clock is read once before:
    that read makes the round trip (``TIME``) which the add would otherwise make between this
    anchor and its own reading of the clock. (A test fires its points with the next point it
    names, not the rule's.)"""
    store.server_now_ms()
    return IntervalRule(SOON_EVERY_MS, store.server_now_ms() + SOON_MS - SOON_EVERY_MS)


def published_ids(r: redis.Redis, queue: str = "celery") -> list[str]:
    return [m["headers"]["id"] for m in broker_lists(r).get(queue, [])]


def store_raw_job(app: Celery, job_id: str, due_ms: int, envelope: str) -> None:
    """Write a job straight into its shard's keys (no script, no validation)."""
    keys = get_store(app).keys.for_job(job_id)
    client = get_store(app).client
    client.zadd(keys.due, {job_id: due_ms})
    client.hset(keys.jobs, job_id, envelope)


def bury(app: Celery, job_id: str, reason: str = "publish failed: boom", dead_at: int | None = None) -> None:
    """Dead-letter a due job the way a beat does (claim, then bury with the beat's record)."""
    store = get_store(app)
    [claimed] = store.claim([store.keys.shard_of(job_id)], "beat-bury")
    [job] = [j for j in claimed.jobs if j.id == job_id]
    record = {
        "reason": reason,
        "task": "t.add",
        "due": job.due_ms,
        "tries": job.tries,
        "dead_at": dead_at or int(time.time() * 1000),
        "beat": "beat-bury",
        "envelope": job.envelope,
    }
    assert store.bury("beat-bury", job_id, record)


def stored_lateness(r: redis.Redis, kind: str = "start") -> lateness.Snapshot:
    """A lateness histogram (the workers' start one by default), read straight from Redis."""
    return lateness.Snapshot.from_fields(r.hgetall(lateness.key_for("delayq", kind)))


def gate_due(
    app: Celery, r: redis.Redis, key: str, n: int, limit: int | None, token: str = "beat-flow-test"
) -> dict[str, GateDecision]:
    """``n`` jobs of ``key`` stored due, claimed and passed through the gate as a beat does."""
    store: Store = get_store(app)
    now = server_ms(r)
    ids = [f"{{{key}}}job-{i}" for i in range(n)]
    for i, job_id in enumerate(ids):
        app.tasks["t.add"].apply_at((now - 1000 + i) / 1000, (i, i), task_id=job_id)
    shard = store.keys.shard_of(ids[0])
    [claimed] = store.claim([shard], token)
    assert sorted(j.id for j in claimed.jobs) == sorted(ids)
    gated = store.gate(token, {shard: [(job_id, Gate(key, limit)) for job_id in ids]}, 60_000)
    return {job_id: result.decision for job_id, result in gated.items()}


def open_batch(app: Celery, batch_id: str, n: int, due_s: float) -> None:
    """A batch of ``n`` jobs of ``t.add`` due at ``due_s`` (UNIX seconds), opened as a producer
    opens one (the batch first, then its members)."""
    assert get_store(app).open_batch(batch_id, n, None, {})
    for i in range(n):
        app.tasks["t.add"].apply_at(due_s, (i, i), task_id=member_id(batch_id, i))


def make_full(client: redis.Redis, margin: int = 256_000) -> int:
    """Set ``maxmemory`` ``margin`` bytes under the memory used now: every write that may grow
    memory is refused from then on. Returns the limit. The margin is wider than what the server
    frees by itself between two commands (a client's query buffer, up to 32 KiB each, is given
    back by the server's cron): with 20 KB, a write now and then found the server under its limit
    again and went through (seen in CI on Redis 6.2)."""
    limit = int(client.info("memory")["used_memory"]) - margin
    client.config_set("maxmemory", limit)
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        client.set("delayq-test:probe", "x")
    return limit


def stored(r: redis.Redis, job_id: str, prefix: str = "delayq", shards: int = 16) -> dict[str, Any]:
    """The envelope stored for ``job_id``, decoded."""
    keys = KeySpace(prefix, shards).for_job(job_id)
    raw = r.hget(keys.jobs, job_id)
    assert raw is not None, f"no job {job_id!r}"
    shape_id = shape_id_of(raw)
    if shape_id is not None:  # the shape the job left to the shard's shapes hash
        raw = joined_form(raw, r.hget(keys.shapes, shape_id))
    return dict(json.loads(loaded_form(job_id, raw)))
