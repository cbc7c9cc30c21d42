"""Every Lua script's edges, through :class:`Store` (and raw ``SCRIPTS`` calls), on a real server:
each test runs on every supported server in turn (Redis 6.2, Valkey, redis-server on PATH)."""

from __future__ import annotations

import json
import re
import time
from importlib import resources
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import StoreError
from celery_delayq.store.delivery import ACK_CHUNK
from celery_delayq.store.facade import Store
from celery_delayq.store.jobs import ENQUEUE_CHUNK, CancelOutcome, EnqueueOutcome, RescheduleOutcome
from celery_delayq.store.keys import KeySpace
from celery_delayq.store.scripts import INCLUDES, SCRIPTS, ScriptCall, expand, run_pipelined, script_from_text
from tests.support.polling import wait_for
from tests.support.server_kinds import redis_server
from tests.support.store import command_calls, expire_leases, ids_on_shard, make_store, server_ms
from tests.support.wake import Wake, wake

__all__ = ["redis_server", "wake"]  # fixtures, used by name

FAR_FUTURE = "9999999999999999"


def claim_one(store: Store, shard: int, token: str, batch: int | None = None) -> Any:
    [result] = store.claim([shard], token, batch)
    return result


# -- enqueue ----------------------------------------------------------------------------------


def test_enqueue_new_job_is_stored_in_its_shard(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    assert store.enqueue([("a", due, "env-a")]) == [(EnqueueOutcome.NEW, due)]
    shard = store.keys.for_job("a")
    assert r.zscore(shard.due, "a") == due
    assert r.hget(shard.jobs, "a") == "env-a"
    assert not r.hexists(shard.leases, "a")
    # No other shard got anything.
    others = [s for s in store.keys.all_shards() if s != shard]
    assert all(r.zcard(s.due) == 0 and r.hlen(s.jobs) == 0 for s in others)


def test_enqueue_relative_adds_the_delay_to_the_servers_time(store: Store, r: redis.Redis) -> None:
    """Clock "in": each due is a delay that the script adds to its TIME (one call and a
    pipeline of shards); the reply's first entry is that TIME, which the store keeps."""
    before = server_ms(r)
    (one,) = store.enqueue([("a", 5000, "env-a")], relative=True)
    many = store.enqueue([(f"m{i}", 1000 * i, "env") for i in range(40)], relative=True)
    after = server_ms(r)
    assert one[0] == EnqueueOutcome.NEW and before + 5000 <= one[1] <= after + 5000
    assert r.zscore(store.keys.for_job("a").due, "a") == one[1]
    for i, (status, due) in enumerate(many):
        assert status == EnqueueOutcome.NEW and before + 1000 * i <= due <= after + 1000 * i
        assert r.zscore(store.keys.for_job(f"m{i}").due, f"m{i}") == due
    assert before <= store.server_now_ms() <= server_ms(r)


def test_enqueue_keep_leaves_the_waiting_job_untouched(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "first")])
    assert store.enqueue([("a", due + 5000, "second")]) == [(EnqueueOutcome.KEPT, due)]
    shard = store.keys.for_job("a")
    assert r.zscore(shard.due, "a") == due
    assert r.hget(shard.jobs, "a") == "first"


def test_enqueue_replace_overwrites_the_waiting_job(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "first")])
    assert store.enqueue([("a", due + 5000, "second")], replace=True) == [
        (EnqueueOutcome.REPLACED, due + 5000)
    ]
    shard = store.keys.for_job("a")
    assert r.zscore(shard.due, "a") == due + 5000
    assert r.hget(shard.jobs, "a") == "second"
    assert store.count() == 1


def test_enqueue_same_id_twice_in_one_call_keeps_the_first(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    result = store.enqueue([("a", due, "first"), ("a", due + 1, "second")])
    assert result == [(EnqueueOutcome.NEW, due), (EnqueueOutcome.KEPT, due)]
    assert r.hget(store.keys.for_job("a").jobs, "a") == "first"


@pytest.mark.parametrize("replace", [False, True], ids=["keep", "replace"])
def test_enqueue_onto_a_leased_job_stores_the_new_one(store: Store, r: redis.Redis, replace: bool) -> None:
    past = server_ms(r) - 1000
    store.enqueue([("a", past, "old")])
    shard = store.keys.shard_of("a")
    held = claim_one(store, shard, "beat-1")
    assert [j.id for j in held.jobs] == ["a"]

    new_due = server_ms(r) + 60_000
    # Even in keep mode: the leased job is being delivered, so the new one is stored.
    assert store.enqueue([("a", new_due, "new")], replace=replace) == [(EnqueueOutcome.AFTER_HELD, new_due)]
    record = store.get("a")
    assert record is not None
    assert (record.state, record.due_ms, record.envelope, record.tries) == (
        "waiting",
        new_due,
        "new",
        0,
    )
    # The old holder's ack must not delete the new job.
    assert store.ack("beat-1", {shard: ["a"]}) == {"a": False}
    assert store.get("a") == record
    # And its bury neither.
    assert store.bury("beat-1", "a", {"reason": "x"}) is False
    assert store.get("a") == record


def test_enqueue_groups_by_shard_in_one_pipeline(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    jobs = [(f"j{i}", due + i, f"env{i}") for i in range(40)]
    shards = {store.keys.shard_of(job_id) for job_id, _, _ in jobs}
    assert len(shards) > 1
    r.script_load(SCRIPTS["enqueue"].source)
    calls_before, _ = command_calls(r, "evalsha")
    result = store.enqueue(jobs)
    calls_after, _ = command_calls(r, "evalsha")
    assert result == [(EnqueueOutcome.NEW, due + i) for i in range(40)]
    assert calls_after - calls_before == len(shards)  # one script call per shard
    for job_id, job_due, envelope in jobs:
        keys = store.keys.for_job(job_id)
        assert r.zscore(keys.due, job_id) == job_due
        assert r.hget(keys.jobs, job_id) == envelope


# -- claim ------------------------------------------------------------------------------------


def test_claim_on_an_empty_shard(store: Store, r: redis.Redis) -> None:
    result = claim_one(store, 3, "beat-1")
    assert result.shard == 3
    assert result.jobs == []
    assert result.next_ms is None
    assert r.get(store.keys.shard(3).wake) == FAR_FUTURE


def test_claim_takes_at_most_batch_and_says_more_is_due(store: Store, r: redis.Redis) -> None:
    shard = 5
    ids = ids_on_shard(store.keys, shard, 7)
    base = server_ms(r) - 10_000
    store.enqueue([(job_id, base + i, f"env-{job_id}") for i, job_id in enumerate(ids)])

    first = claim_one(store, shard, "beat-1", batch=3)
    assert [j.id for j in first.jobs] == ids[:3]  # due order
    assert [j.due_ms for j in first.jobs] == [base, base + 1, base + 2]
    assert [j.envelope for j in first.jobs] == [f"env-{i}" for i in ids[:3]]
    assert all(j.tries == 1 for j in first.jobs)
    assert first.next_ms is not None and first.next_ms <= first.now_ms  # loop again at once

    second = claim_one(store, shard, "beat-1", batch=3)
    assert [j.id for j in second.jobs] == ids[3:6]
    assert second.next_ms is not None and second.next_ms <= second.now_ms

    third = claim_one(store, shard, "beat-1", batch=3)
    assert [j.id for j in third.jobs] == ids[6:]
    # Only leases are left: next is the earliest lease expiry, in the future.
    assert third.next_ms is not None and third.next_ms > third.now_ms
    assert claim_one(store, shard, "beat-1", batch=3).jobs == []


def test_claim_uses_the_server_clock(store: Store, r: redis.Redis) -> None:
    shard = 2
    due_now, due_later = ids_on_shard(store.keys, shard, 2)
    now = server_ms(r)
    store.enqueue([(due_now, now - 1, "x"), (due_later, now + 5_000, "y")])
    before = server_ms(r)
    result = claim_one(store, shard, "beat-1")
    after = server_ms(r)
    assert before <= result.now_ms <= after
    assert [j.id for j in result.jobs] == [due_now]
    assert result.next_ms == now + 5_000  # the future job, still waiting
    record = store.get(due_later)
    assert record is not None and record.state == "waiting"


def test_claim_several_shards_in_one_call(store: Store, r: redis.Redis) -> None:
    [a] = ids_on_shard(store.keys, 1, 1)
    [b] = ids_on_shard(store.keys, 9, 1)
    past = server_ms(r) - 1
    store.enqueue([(a, past, "a"), (b, past, "b")])
    results = store.claim([9, 4, 1], "beat-1")
    assert [res.shard for res in results] == [9, 4, 1]
    assert [[j.id for j in res.jobs] for res in results] == [[b], [], [a]]


def test_claim_drops_a_due_member_without_envelope(store: Store, r: redis.Redis) -> None:
    shard = 4
    ghost, real = ids_on_shard(store.keys, shard, 2)
    keys = store.keys.shard(shard)
    past = server_ms(r) - 1000
    store.enqueue([(real, past + 1, "real")])
    r.zadd(keys.due, {ghost: past})
    r.hset(keys.leases, ghost, f"{past}|1|someone")
    result = claim_one(store, shard, "beat-1")
    assert [j.id for j in result.jobs] == [real]
    assert r.zscore(keys.due, ghost) is None
    assert not r.hexists(keys.leases, ghost)
    assert store.get(ghost) is None
    assert store.count() == 1


def test_expired_lease_is_reclaimed_with_original_due(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) - 500
    store.enqueue([("a", due, "env")])
    shard = store.keys.shard_of("a")

    first = claim_one(store, shard, "beat-1")
    assert [(j.id, j.due_ms, j.tries) for j in first.jobs] == [("a", due, 1)]
    lease_until = first.now_ms + 30_000
    assert first.next_ms == lease_until
    record = store.get("a")
    assert record is not None
    assert (record.state, record.due_ms, record.tries, record.lease_until_ms) == (
        "leased",
        due,
        1,
        lease_until,
    )
    assert claim_one(store, shard, "beat-2").jobs == []  # not before the lease ends
    # The lease runs out (its score moved to the server's now - 1 ms, as when its TTL passes).
    assert expire_leases(store, ["a"]) == ["a"]

    second = claim_one(store, shard, "beat-2")
    assert [(j.id, j.due_ms, j.tries, j.envelope) for j in second.jobs] == [("a", due, 2, "env")]

    # The first beat's ack is stale: nothing is removed.
    assert store.ack("beat-1", {shard: ["a"]}) == {"a": False}
    record = store.get("a")
    assert record is not None and record.state == "leased" and record.tries == 2
    # The new holder's ack removes it.
    assert store.ack("beat-2", {shard: ["a"]}) == {"a": True}
    assert store.get("a") is None
    assert store.count() == 0


def test_a_job_due_before_1970_is_reclaimed_like_any_other(store: Store, r: redis.Redis) -> None:
    """The public API refuses due times before the epoch, but a job stored with one through the
    Store must not wedge its shard: its lease ("-5|1|token") is read back as any other."""
    store.enqueue([("neg", -5, "env")])
    shard = store.keys.shard_of("neg")
    first = claim_one(store, shard, "beat-1")
    assert [(j.id, j.due_ms, j.tries) for j in first.jobs] == [("neg", -5, 1)]
    record = store.get("neg")
    assert record is not None and (record.state, record.due_ms, record.tries) == ("leased", -5, 1)
    assert expire_leases(store) == ["neg"]
    second = claim_one(store, shard, "beat-2")
    assert [(j.id, j.due_ms, j.tries) for j in second.jobs] == [("neg", -5, 2)]


def test_unexpired_lease_is_not_reclaimed(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) - 1, "env")])
    shard = store.keys.shard_of("a")
    assert len(claim_one(store, shard, "beat-1").jobs) == 1
    assert claim_one(store, shard, "beat-2").jobs == []


# -- ack --------------------------------------------------------------------------------------


def test_ack_reports_each_id(store: Store, r: redis.Redis) -> None:
    shard = 6
    a, b = ids_on_shard(store.keys, shard, 2)
    store.enqueue([(a, server_ms(r) - 1, "a"), (b, server_ms(r) + 60_000, "b")])
    claim_one(store, shard, "beat-1")
    assert store.ack("beat-1", {shard: [a, b, "missing"]}) == {a: True, b: False, "missing": False}
    assert store.get(a) is None
    assert store.get(b) is not None


def test_ack_matches_the_whole_token_not_a_suffix(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) - 1, "env")])
    shard = store.keys.shard_of("a")
    claim_one(store, shard, "xabc")
    assert store.ack("abc", {shard: ["a"]}) == {"a": False}
    assert store.ack("bc", {shard: ["a"]}) == {"a": False}
    assert store.ack("xabc", {shard: ["a"]}) == {"a": True}


# -- renew (the fence before a publish) -------------------------------------------------------


def test_renew_extends_only_the_leases_the_token_holds(store: Store, r: redis.Redis) -> None:
    shard = 3
    mine, theirs, waiting = ids_on_shard(store.keys, shard, 3)
    now = server_ms(r)
    store.enqueue([(mine, now - 2, "m"), (theirs, now - 1, "t"), (waiting, now + 60_000, "w")])
    claim_one(store, shard, "beat-1", batch=1)
    claim_one(store, shard, "beat-2", batch=1)
    due = store.keys.shard(shard).due
    before = {job_id: r.zscore(due, job_id) for job_id in (mine, theirs, waiting)}
    held, server_now = store.renew("beat-1", {shard: [mine, theirs, waiting, "missing"]})
    assert held == {mine: True, theirs: False, waiting: False, "missing": False}
    assert server_now is not None and server_now >= now
    # Only beat-1's lease moved, to the server's now + TTL; nothing else changed or was added.
    assert r.zscore(due, mine) == server_now + 30_000 >= before[mine]  # type: ignore[operator]
    assert r.zscore(due, theirs) == before[theirs] and r.zscore(due, waiting) == before[waiting]
    assert r.zscore(due, "missing") is None
    assert r.hget(store.keys.shard(shard).leases, mine).endswith("|1|beat-1")  # type: ignore[union-attr]
    assert store.renew("beat-1", {}) == ({}, None)


def test_renew_after_expiry_and_re_claim_says_not_held(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) - 1, "env")])
    shard = store.keys.shard_of("a")
    claim_one(store, shard, "beat-1")
    assert expire_leases(store, ["a"]) == ["a"]
    claim_one(store, shard, "beat-2")
    assert store.renew("beat-1", {shard: ["a"]})[0] == {"a": False}
    assert store.renew("beat-2", {shard: ["a"]})[0] == {"a": True}


# -- cancel -----------------------------------------------------------------------------------


def test_cancel_while_waiting(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) + 60_000, "env"), ("b", server_ms(r) + 60_000, "env")])
    assert store.cancel("a") == CancelOutcome.CANCELLED
    assert store.get("a") is None
    assert store.cancel("a") == CancelOutcome.MISSING
    assert store.get("b") is not None  # the other job is untouched
    keys = store.keys.for_job("a")
    assert r.zscore(keys.due, "a") is None and not r.hexists(keys.jobs, "a")


def test_cancel_while_leased_then_the_holders_ack_is_a_no_op(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) - 1, "env")])
    shard = store.keys.shard_of("a")
    claim_one(store, shard, "beat-1")
    assert store.cancel("a") == CancelOutcome.DELIVERING
    keys = store.keys.shard(shard)
    assert (r.zscore(keys.due, "a"), r.hget(keys.jobs, "a"), r.hget(keys.leases, "a")) == (
        None,
        None,
        None,
    )
    assert store.ack("beat-1", {shard: ["a"]}) == {"a": False}
    assert store.get("a") is None
    assert store.count() == 0
    assert claim_one(store, shard, "beat-2").jobs == []


def test_cancel_missing(store: Store) -> None:
    assert store.cancel("nope") == CancelOutcome.MISSING


# -- reschedule -------------------------------------------------------------------------------


def test_reschedule_waiting_job_moves_it(store: Store, r: redis.Redis) -> None:
    now = server_ms(r)
    store.enqueue([("a", now + 60_000, "env")])
    shard = store.keys.shard_of("a")
    assert claim_one(store, shard, "beat-1").jobs == []

    assert store.reschedule("a", now - 2000) == RescheduleOutcome.MOVED
    record = store.get("a")
    assert record is not None and record.due_ms == now - 2000 and record.state == "waiting"
    [job] = claim_one(store, shard, "beat-1").jobs
    assert (job.id, job.due_ms, job.envelope) == ("a", now - 2000, "env")


def test_reschedule_later_is_not_claimed_early(store: Store, r: redis.Redis) -> None:
    now = server_ms(r)
    store.enqueue([("a", now - 1000, "env")])
    assert store.reschedule("a", now + 60_000) == RescheduleOutcome.MOVED
    assert claim_one(store, store.keys.shard_of("a"), "beat-1").jobs == []


def test_reschedule_leased_job_is_refused(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) - 1
    store.enqueue([("a", due, "env")])
    shard = store.keys.shard_of("a")
    claim_one(store, shard, "beat-1")
    keys = store.keys.shard(shard)
    before = (r.zscore(keys.due, "a"), r.hget(keys.leases, "a"))
    assert store.reschedule("a", due + 60_000) == RescheduleOutcome.DELIVERING
    assert (r.zscore(keys.due, "a"), r.hget(keys.leases, "a")) == before
    assert store.ack("beat-1", {shard: ["a"]}) == {"a": True}


def test_reschedule_missing(store: Store) -> None:
    assert store.reschedule("nope", 1000) == RescheduleOutcome.MISSING
    assert store.count() == 0


# -- get and bury -----------------------------------------------------------------------------


def test_get_waiting_leased_dead_missing(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) - 1000
    store.enqueue([("a", due, "env-a")])
    shard = store.keys.shard_of("a")

    waiting = store.get("a")
    assert waiting is not None
    assert (waiting.id, waiting.shard, waiting.due_ms, waiting.envelope, waiting.state) == (
        "a",
        shard,
        due,
        "env-a",
        "waiting",
    )
    assert (waiting.tries, waiting.lease_until_ms) == (0, None)

    result = claim_one(store, shard, "beat-1")
    leased = store.get("a")
    assert leased is not None
    assert (leased.due_ms, leased.envelope, leased.state, leased.tries) == (
        due,
        "env-a",
        "leased",
        1,
    )
    assert leased.lease_until_ms == result.now_ms + 30_000

    assert store.bury("beat-1", "a", {"reason": "r", "due": due, "tries": 1, "envelope": "env-a"})
    dead = store.get("a")
    assert dead is not None
    assert (dead.state, dead.due_ms, dead.tries, dead.envelope, dead.lease_until_ms) == (
        "dead",
        due,
        1,
        "env-a",
        None,
    )
    assert store.get("missing") is None


def test_get_raw_script_replies(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "env")])
    keys = store.keys.for_job("a").core
    assert SCRIPTS["get"](store.client, keys, ["a"]) == ["job", "env", due, 0, -1]
    assert SCRIPTS["get"](store.client, keys, ["other"]) is None


def test_bury_only_by_the_lease_holder(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) - 1
    store.enqueue([("a", due, "env")])
    shard = store.keys.shard_of("a")
    claim_one(store, shard, "beat-1")
    record = {"reason": "cannot deliver", "due": due, "tries": 1, "envelope": "env"}

    assert store.bury("beat-2", "a", record) is False
    leased = store.get("a")
    assert leased is not None and leased.state == "leased"
    assert store.count_dead() == 0

    assert store.bury("beat-1", "a", record) is True
    keys = store.keys.shard(shard)
    assert json.loads(r.hget(keys.dead, "a") or "null") == record
    assert (r.zscore(keys.due, "a"), r.hget(keys.jobs, "a"), r.hget(keys.leases, "a")) == (
        None,
        None,
        None,
    )
    assert store.count() == 0
    assert store.count_dead() == 1
    assert list(store.dead()) == [("a", record)]
    assert store.bury("beat-1", "a", record) is False  # already buried


def test_bury_a_waiting_job_is_refused(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) + 60_000, "env")])
    assert store.bury("beat-1", "a", {"reason": "x"}) is False
    record = store.get("a")
    assert record is not None and record.state == "waiting"


# -- NOSCRIPT ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reply", [-1, 4, None, b"1"])
def test_a_reply_that_is_none_of_the_scripts_codes_raises(
    store: Store, monkeypatch: pytest.MonkeyPatch, reply: Any
) -> None:
    """A reply out of step with the script's header is an error, never taken for another answer."""
    monkeypatch.setattr(store, "_write", lambda *args: reply)
    with pytest.raises(StoreError, match=r"^delayq cancel: unexpected reply .* \(its codes are 0 to 2\)$"):
        store.cancel("a")
    monkeypatch.setattr("celery_delayq.store.schedules.run_pipelined", lambda client, calls, **kw: [reply])
    with pytest.raises(StoreError, match=r"^delayq fire: unexpected reply .* \(its codes are 0 to 3\)$"):
        store.fire("beat-1", [(0, ["p", "s", 0, "", "", 0, ""])])
    monkeypatch.setattr("celery_delayq.store.base.run_pipelined", lambda client, calls, **kw: [[reply]])
    with pytest.raises(StoreError, match=r"^delayq push_claimed: unexpected reply"):
        store.push_claimed("beat-1", {0: [("a", "celery", "{}")]})


def test_script_flush_before_a_single_call(store: Store, r: redis.Redis) -> None:
    store.enqueue([("a", server_ms(r) + 60_000, "env")])
    r.script_flush()
    zrem_before, _ = command_calls(r, "zrem")
    evalsha_before, failed_before = command_calls(r, "evalsha")
    assert store.cancel("a") == CancelOutcome.CANCELLED
    zrem_after, _ = command_calls(r, "zrem")
    evalsha_after, failed_after = command_calls(r, "evalsha")
    assert zrem_after - zrem_before == 1  # the script body ran exactly once
    assert failed_after - failed_before == 1  # the NOSCRIPT attempt
    assert evalsha_after - evalsha_before == 2
    assert store.get("a") is None
    assert r.script_exists(SCRIPTS["cancel"].sha_for(store.client)) == [True]  # the form this server runs


def test_script_flush_before_a_raw_call(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "env")])
    r.script_flush()
    keys = store.keys.for_job("a").core
    args = ["a", due - 1000, store.keys.wake_channel, store.keys.shard_of("a")]
    assert SCRIPTS["reschedule"](store.client, keys, args) == 1  # moved
    record = store.get("a")
    assert record is not None and record.due_ms == due - 1000


def test_script_flush_before_a_pipeline(store: Store, r: redis.Redis) -> None:
    due = server_ms(r) - 1000
    jobs = [(f"j{i}", due + i, f"env{i}") for i in range(30)]
    shards = {store.keys.shard_of(job_id) for job_id, _, _ in jobs}
    r.script_flush()
    hset_before, _ = command_calls(r, "hset")
    _, failed_before = command_calls(r, "evalsha")
    result = store.enqueue(jobs, replace=True)
    hset_after, _ = command_calls(r, "hset")
    _, failed_after = command_calls(r, "evalsha")
    assert result == [(EnqueueOutcome.NEW, due + i) for i in range(30)]
    assert hset_after - hset_before == len(jobs)  # each job written exactly once
    assert failed_after - failed_before == len(shards)  # one NOSCRIPT per shard call
    assert store.count() == len(jobs)

    # claim and ack are pipelined too.
    r.script_flush()
    claimed = store.claim(sorted(shards), "beat-1")
    ids = sorted(j.id for res in claimed for j in res.jobs)
    assert ids == sorted(job_id for job_id, _, _ in jobs)
    assert all(j.tries == 1 for res in claimed for j in res.jobs)
    r.script_flush()
    acked = store.ack("beat-1", {res.shard: [j.id for j in res.jobs] for res in claimed})
    assert acked == dict.fromkeys(ids, True)
    assert store.count() == 0


def test_run_pipelined_repeats_only_the_noscript_calls(store: Store, r: redis.Redis) -> None:
    now = server_ms(r)
    store.enqueue([("a", now + 60_000, "env")])
    r.script_flush()
    r.script_load(SCRIPTS["enqueue"].source)  # loaded: runs in the first round trip
    calls = [
        # enqueue in replace mode writes (HSET) every time it runs: a repeat would show.
        ScriptCall(
            SCRIPTS["enqueue"],
            [*store.keys.for_job("b").core, store.keys.for_job("b").shapes],
            ["replace", store.keys.wake_channel, store.keys.shard_of("b"), "at", 0, "b", now, "env-b"],
        ),
        ScriptCall(  # NOSCRIPT first
            SCRIPTS["cancel"],
            store.keys.for_job("a").core,
            ["a", store.keys.wake_channel, store.keys.shard_of("a")],
        ),
    ]
    evalsha_before, failed_before = command_calls(r, "evalsha")
    zrem_before, _ = command_calls(r, "zrem")
    hset_before, _ = command_calls(r, "hset")
    results = run_pipelined(store.client, calls)
    assert [results[0][1:], results[1]] == [[1, now], 1]  # enqueue: new; cancel: it was waiting
    evalsha_after, failed_after = command_calls(r, "evalsha")
    assert (evalsha_after - evalsha_before, failed_after - failed_before) == (3, 1)
    assert command_calls(r, "hset")[0] - hset_before == 1  # enqueue ran once, not again
    assert command_calls(r, "zrem")[0] - zrem_before == 1  # cancel ran once
    assert store.get("a") is None
    assert store.get("b") is not None


def test_run_pipelined_raises_other_errors_after_reading_everything(store: Store, r: redis.Redis) -> None:
    now = server_ms(r)
    [a] = ids_on_shard(store.keys, 0, 1)
    [b] = ids_on_shard(store.keys, 1, 1)
    r.set(store.keys.shard(0).jobs, "not a hash")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        store.enqueue([(a, now, "a"), (b, now, "b")])
    # The healthy shard's call ran.
    assert r.hget(store.keys.shard(1).jobs, b) == "b"
    assert run_pipelined(store.client, []) == []


# -- wake marker ------------------------------------------------------------------------------


def test_enqueue_publishes_wake_only_when_earlier_than_the_marker(
    store: Store, r: redis.Redis, wake: Wake
) -> None:
    shard = 7
    a, b, c, d = ids_on_shard(store.keys, shard, 4)
    keys = store.keys.shard(shard)
    due = server_ms(r) + 60_000

    store.enqueue([(a, due, "a")])  # no marker yet
    assert wake.drain() == [f"{shard}:{due}"]
    assert r.get(keys.wake) == str(due)

    store.enqueue([(b, due + 1000, "b")])  # later than the marker
    assert wake.drain() == []
    assert r.get(keys.wake) == str(due)

    store.enqueue([(a, due - 5000, "x")])  # kept (keep mode): nothing stored, no wake
    assert wake.drain() == []

    store.enqueue([(c, due - 1000, "c"), (d, due - 3000, "d")])  # one message: the earliest
    assert wake.drain() == [f"{shard}:{due - 3000}"]
    assert r.get(keys.wake) == str(due - 3000)


def test_reschedule_earlier_than_the_marker_wakes(store: Store, r: redis.Redis, wake: Wake) -> None:
    a, b = ids_on_shard(store.keys, 3, 2)
    due = server_ms(r) + 60_000
    store.enqueue([(a, due, "a"), (b, due + 10_000, "b")])
    assert wake.drain() == [f"3:{due}"]
    assert store.reschedule(b, due + 5000) == RescheduleOutcome.MOVED
    assert wake.drain() == []
    assert store.reschedule(b, due - 5000) == RescheduleOutcome.MOVED
    assert wake.drain() == [f"3:{due - 5000}"]
    assert r.get(store.keys.shard(3).wake) == str(due - 5000)


def test_claim_sets_the_marker_to_the_next_due(store: Store, r: redis.Redis, wake: Wake) -> None:
    shard = 8
    past_id, future_id, later_id, earlier_id = ids_on_shard(store.keys, shard, 4)
    keys = store.keys.shard(shard)
    now = server_ms(r)
    future = now + 5_000
    store.enqueue([(past_id, now - 1000, "p"), (future_id, future, "f")])
    wake.drain()

    result = claim_one(store, shard, "beat-1")
    assert [j.id for j in result.jobs] == [past_id]
    assert result.next_ms == future  # earlier than the lease expiry (now + 30 s)
    assert r.get(keys.wake) == str(future)

    store.enqueue([(later_id, future + 1000, "l")])
    assert wake.drain() == []
    store.enqueue([(earlier_id, future - 1000, "e")])
    assert wake.drain() == [f"{shard}:{future - 1000}"]

    # A shard left empty by claim gets a far-future marker; the next enqueue wakes.
    store.ack("beat-1", {shard: [past_id]})
    for job_id in (future_id, later_id, earlier_id):
        store.cancel(job_id)
    assert claim_one(store, shard, "beat-1").next_ms is None
    assert r.get(keys.wake) == FAR_FUTURE
    store.enqueue([(later_id, future + 60_000, "l")])
    assert wake.drain() == [f"{shard}:{future + 60_000}"]


# -- keys -------------------------------------------------------------------------------------


def test_all_keys_of_a_shard_share_one_hash_tag(store: Store, r: redis.Redis) -> None:
    slots = set()
    for index, shard in enumerate(store.keys.all_shards()):
        assert shard.tag == f"{{delayq:{index}}}"
        shard_slots = {key_slot(key.encode()) for key in shard.core}
        assert shard_slots == {key_slot(f"delayq:{index}".encode())}
        slots |= shard_slots
    assert len(slots) > 1  # shards spread over slots

    # Every key the scripts actually create belongs to its job's shard's tag.
    past = server_ms(r) - 1
    ids = [f"k{i}" for i in range(20)]
    store.enqueue([(job_id, past, "env") for job_id in ids])
    for job_id in ids:
        assert r.zscore(store.keys.for_job(job_id).due, job_id) == past
    claimed = store.claim(range(store.config.shards), "beat-1")
    first = next(job for result in claimed for job in result.jobs)
    assert store.bury("beat-1", first.id, {"reason": "x"})
    keys = r.keys("delayq:*")
    assert {k.rsplit(":", 1)[1] for k in keys} == {"due", "jobs", "leases", "wake", "dead"}
    for key in keys:
        tag = key[key.index("{") + 1 : key.index("}")]
        assert key_slot(key.encode()) == key_slot(tag.encode())


# -- delayq_wait_replicas ---------------------------------------------------------------------


@pytest.mark.slow
def test_wait_replicas_waits_for_a_replica_and_warns_without_one(
    redis_url: str, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Producer writes are followed by ``WAIT n 1000`` on their connection: at once with a
    replica attached; after the timeout, with a warning, without one (the write is stored)."""
    caplog.set_level("WARNING", logger="celery_delayq.store.scripts")
    store = make_store(redis_url, wait_replicas=1)
    try:
        started = time.monotonic()
        assert store.enqueue([("a", 2_000_000_000_000, "env")]) == [(EnqueueOutcome.NEW, 2_000_000_000_000)]
        assert time.monotonic() - started >= 0.9
        assert "reached 0 of the 1 replica(s)" in caplog.text
        caplog.clear()
        replica_of = ["--replicaof", "127.0.0.1", str(redis_server.port)]
        with EmbeddedRedis(binary=redis_server.binary, extra_args=replica_of) as replica:
            r = redis.Redis(host="127.0.0.1", port=replica.port, decode_responses=True)
            assert wait_for(lambda: r.info("replication").get("master_link_status") == "up", 20, 0.05)
            started = time.monotonic()
            jobs = [(f"j{i}", 2_000_000_000_000 + i, "env") for i in range(50)]
            store.enqueue(jobs)
            assert store.cancel("j1") == CancelOutcome.CANCELLED
            assert store.reschedule("j2", 2_000_000_000_001) == RescheduleOutcome.MOVED
            assert time.monotonic() - started < 5.0  # WAIT never timed out (1 s each)
            assert caplog.text == ""
            assert r.hget(store.keys.for_job("j3").jobs, "j3") == "env"  # on the replica already
            r.close()
    finally:
        store.close()


# -- calls larger than Lua's unpack, and bad input ---------------------------------------------------


@pytest.mark.slow
def test_claim_takes_5000_due_jobs_of_one_shard_in_one_call(store: Store, r: redis.Redis) -> None:
    """The largest batch the settings allow (5000), all due on one shard: each job is leased once,
    with one call (its ZADD of 10,000 values goes in slices that Lua's ``unpack`` can take)."""
    ids = ids_on_shard(store.keys, 0, 5000)
    base = server_ms(r) - 10_000
    store.enqueue([(job_id, base + i, f"env-{job_id}") for i, job_id in enumerate(ids)])
    result = claim_one(store, 0, "beat-1", batch=5000)
    assert [j.id for j in result.jobs] == ids  # due order, each once
    assert all(j.tries == 1 and j.envelope == f"env-{j.id}" for j in result.jobs)
    keys = store.keys.shard(0)
    leases = r.hgetall(keys.leases)
    assert leases == {job_id: f"{base + i}|1|beat-1" for i, job_id in enumerate(ids)}
    expiry = result.now_ms + 30_000
    assert dict(r.zrange(keys.due, 0, -1, withscores=True)) == dict.fromkeys(ids, expiry)
    assert claim_one(store, 0, "beat-2", batch=5000).jobs == []  # all held
    assert set(store.ack("beat-1", {0: ids}).values()) == {True}
    assert r.zcard(keys.due) == r.hlen(keys.jobs) == r.hlen(keys.leases) == 0


def test_enqueue_of_5000_jobs_in_one_script_call(store: Store, r: redis.Redis) -> None:
    """enqueue.lua itself takes more jobs than one ``unpack`` could (the store sends it at most
    ENQUEUE_CHUNK a call; the script does not rely on that)."""
    keys = store.keys.shard(2)
    ids = ids_on_shard(store.keys, 2, 5000)
    args: list[Any] = ["keep", store.keys.wake_channel, 2, "at", 0]
    for i, job_id in enumerate(ids):
        args += [job_id, 2_000_000_000_000 + i, "env"]
    reply = SCRIPTS["enqueue"](r, [*keys.core, keys.shapes], args)
    assert reply[1:] == [x for i in range(5000) for x in (1, 2_000_000_000_000 + i)]  # 1: new
    assert r.zrange(keys.due, 0, -1, withscores=True) == [
        (job_id, 2_000_000_000_000 + i) for i, job_id in enumerate(ids)
    ]
    assert r.hlen(keys.jobs) == 5000


def test_calls_split_into_chunks_answer_each_item_in_its_own_place(store: Store, r: redis.Redis) -> None:
    """The store's one per-shard loop: an enqueue of jobs of two shards split into chunks of
    ENQUEUE_CHUNK, every other job of shard 0 stored already (kept), answers each job in its place
    in the input; an ack of more than ACK_CHUNK ids, every other one not leased, answers each id."""
    due = server_ms(r) - 60_000  # every job due now, so that one claim leases them all
    ids = ids_on_shard(store.keys, 0, 2 * ENQUEUE_CHUNK + 500)
    others = ids_on_shard(store.keys, 1, 300, stem="other")
    kept = set(ids[::2])
    store.enqueue([(job_id, due, "env") for job_id in sorted(kept)])
    jobs = [(job_id, due + n, "env") for n, job_id in enumerate(ids + others)]
    jobs = jobs[::2] + jobs[1::2]  # shards and kept/new interleaved in the input
    out = store.enqueue(jobs)
    assert [outcome for outcome, _ in out] == [
        EnqueueOutcome.KEPT if job_id in kept else EnqueueOutcome.NEW for job_id, _, _ in jobs
    ]
    assert [d for (outcome, d), (_, due_ms, _) in zip(out, jobs, strict=True) if outcome == "new"] == [
        due_ms for job_id, due_ms, _ in jobs if job_id not in kept
    ]
    leased = [job.id for job in claim_one(store, 0, "beat-1", batch=len(ids)).jobs]
    assert sorted(leased) == sorted(ids)
    missing = ids_on_shard(store.keys, 0, ACK_CHUNK - len(ids) + 100, stem="missing")
    pairs = zip(ids, missing[: len(ids)], strict=True)
    asked = [job_id for pair in pairs for job_id in pair] + missing[len(ids) :]
    assert len(asked) > ACK_CHUNK
    held = set(ids)
    assert store.ack("beat-1", {0: asked}) == {job_id: job_id in held for job_id in asked}
    assert r.hlen(store.keys.shard(0).leases) == 0


def _bad_calls(channel: str) -> list[tuple[str, list[Any]]]:
    """``(script, ARGV)`` of writing scripts given bad input (see ``_stored_state``)."""
    due = 2_000_000_000_000
    return [
        ("enqueue", ["keep", channel, 0, "at", 0, "new-1", due, "env", "new-2", "soon", "env"]),
        ("enqueue", ["keep", channel, 0, "at", 3, "s", "shape", "new-1", due, "env"]),  # 3 shapes? 1
        ("enqueue", ["keep", channel, 0, "at", "x", "new-1", due, "env"]),
        ("enqueue", ["replace", channel, 0, "at", 0, "new-1", due, "env", "new-2", "nan", "env"]),
        ("enqueue", ["keep", channel, 0, "at", 0, "new-1", due, "env", "new-2", due]),
        ("enqueue", ["upsert", channel, 0, "at", 0, "new-1", due, "env"]),
        ("enqueue", ["keep", channel, 0, "later", 0, "new-1", due, "env"]),
        ("enqueue", ["keep", channel, 0, "in", 0, "new-1", 5000, "env", "new-2", -1, "env"]),
        ("enqueue", ["keep", channel, 0, "in", 0, "new-1", 5000, "env", "new-2", "1.5", "env"]),
        ("claim", ["beat-1", "many", 30_000]),
        ("claim", ["beat|1", 10, 30_000]),
        ("claim", ["beat-1", 10, 0]),
        ("reschedule", ["waiting", "later", channel, 0]),
        ("requeue", ["dead", "1.5", '{"v":2,"i":"dead",', channel, 0]),
        ("fire", ["beat-1", "point", "sched", due, "task-1", "point-2", "inf", "env", channel, 0]),
        ("fire", ["beat-1", "point", "sched", "", "task-1", "", "", "", channel, 0]),
        ("sched_put", ["sched", "put", '{"new":1}', "point-2", "tomorrow", "env", channel, 0]),
        ("sched_put", ["sched", "upsert", '{"new":1}', "", "", "", channel, 0]),
        ("push_claimed", ["beat-1", "held", "celery"]),
        ("bury", ["beat-1", "held"]),
        ("cancel", ["held"]),
        ("cancel", ["held", channel, "x"]),
        ("renew", ["beat|1", 30_000, "held"]),
        ("renew", ["beat-1", "1.5", "held"]),
    ]


def _stored_state(store: Store, r: redis.Redis) -> None:
    """Shard 0 of the store holds a waiting job, a job leased by "beat-1", a dead letter and a
    schedule "sched" whose current point "point" is leased by "beat-1"."""
    keys = store.keys.shard(0)
    r.zadd(keys.due, {"waiting": 2_000_000_000_000, "held": 1, "point": 1})
    r.hset(keys.jobs, mapping={"waiting": "env", "held": "env", "point": "env"})
    r.hset(keys.leases, mapping={"held": "1|1|beat-1", "point": "1|1|beat-1"})
    r.hset(keys.dead, "dead", json.dumps({"envelope": "env", "reason": "test"}))
    r.hset(keys.schedules, "sched", "{}")
    r.hset(keys.history, "sched", json.dumps({"cur": "point", "next": 1, "runs": 0}))
    r.set(keys.wake, FAR_FUTURE)


@pytest.mark.parametrize("case", range(len(_bad_calls(""))))
def test_a_writing_script_refuses_bad_input_before_writing_anything(
    case: int, store: Store, r: redis.Redis
) -> None:
    name, args = _bad_calls(store.keys.wake_channel)[case]
    _stored_state(store, r)
    keys = [*store.keys.shard(0).core, "celery"]  # the shard's keys, and a queue push_claimed could push to

    def dump() -> list[Any]:
        return [r.dump(key) for key in keys]

    before = dump()
    with pytest.raises(redis.ResponseError, match=f"^delayq {name}: "):
        SCRIPTS[name](r, store.keys.shard(0).core, args)
    assert dump() == before


# -- the loader: includes and headers -----------------------------------------------------------


def _header(name: str) -> str:
    """The opening comment of ``lua/<name>.lua``: what the script documents."""
    text = resources.files("celery_delayq.store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")
    return text[text.index("--[[") : text.index("]]")]


def test_every_include_is_used_by_some_script() -> None:
    assert {name for script in SCRIPTS.values() for name in script.includes} == set(INCLUDES)


#: Scripts whose caller passes keys of their own, not a shard's ``core``: how many.
OWN_KEYS = {
    "start": 2,  # Store.start: the job instance's start record of the one-key form, the dropped count
    "enqueue": 9,  # the shard's core keys, its shapes hash and (mode unique) its unique record
    "shapes_sweep": 8,
    "keyed": 10,  # the shard's core keys, its debounce hash and due set, its throttle set
    "due_counts": 1,  # Store.due_count_series: the shard's due set alone
    "sched_del": 8,  # the shard's core keys and its gate:overlap hash
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_header_lists_each_key_its_caller_passes(name: str) -> None:
    """Every caller passes a shard's ``core`` keys (or those of OWN_KEYS); the header names each
    of them itself."""
    header = _header(name)
    passed = OWN_KEYS.get(name) or len(KeySpace("delayq", 1).shard(0).core)
    listed = sorted(set(re.findall(r"KEYS\[(\d+)\]", header)), key=int)
    assert listed == [str(i) for i in range(1, passed + 1)]
    assert "see sched_put.lua" not in header


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_keeps_its_line_count_and_its_flags_line_first(name: str) -> None:
    text = resources.files("celery_delayq.store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")
    script = SCRIPTS[name]
    assert script.source.count("\n") == script.legacy_source.count("\n") == text.count("\n")
    assert script.source.startswith("#!lua flags=allow-oom\n") == text.startswith("#!")
    assert not re.search(r"^--!include", script.source, re.M)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("--!include nothing\n", "no lua/includes/nothing.lua"),
        ("--!include lease\n--!include lease\n", "lease is included twice"),
        ("--!include lease job\n", "a malformed include"),
    ],
)
def test_expand_refuses_an_unknown_repeated_or_malformed_include(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        expand(text)


@pytest.mark.parametrize("shebang", ["", "#!lua flags=allow-oom\n"], ids=["plain", "flagged"])
def test_an_error_after_includes_reports_the_files_line(shebang: str, r: redis.Redis) -> None:
    """An include takes the one line of its directive: the lines after it keep their numbers
    (in the flagged form and, on Redis 6.2, in the legacy form)."""
    text = shebang + "--[[ probe ]]\n--!include lease\n--!include wake\nlocal x = nil\nreturn x.y\n"
    line = text.count("\n")
    with pytest.raises(redis.ResponseError, match=f"user_script:{line}:"):
        script_from_text("probe", text)(r, KeySpace("probe", 1).shard(0).core, [])
