"""The flow-control scripts (``lua/gate.lua``, ``hold``, ``release``, ``slot_renew``,
``gate_admin``, ``batch_open``, ``batch_cancel``) through :class:`Store`, on a real server: each
test runs on every supported server in turn (Redis 6.2, Valkey, redis-server on PATH).

A gated job goes as a beat takes it: enqueued due now, claimed with a beat's token, gated
(:meth:`Store.gate`), and when released held (:meth:`Store.hold`) as a worker runs it, until
its worker releases it (:meth:`Store.release`)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import StoreFull
from celery_delayq.flow.gate import (
    PARK_MS,
    Gate,
    batch_key,
    completion_id,
    member_id,
    parse_rate,
)
from celery_delayq.store.batches import BatchState
from celery_delayq.store.beats import read_marker
from celery_delayq.store.connection import is_oom
from celery_delayq.store.facade import Store
from celery_delayq.store.flow import GateDecision, GateResult, KeyState, ReleaseResult
from celery_delayq.store.jobs import CancelOutcome, EnqueueOutcome
from celery_delayq.store.lua_formats import batch_message, parse_batch_message, wait_score
from celery_delayq.store.scripts import _NO_FLAGS, SCRIPTS
from tests.support.acl import STORE_PASSWORD, documented_rule, server_kind
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.server_kinds import redis_server
from tests.support.store import expire_leases, expire_slots, make_store, server_ms, snapshot
from tests.support.wake import Wake, wake

__all__ = ["cluster_url", "redis_cluster", "redis_server", "wake"]  # fixtures, used by name

RELEASED, PARKED, DEFERRED, NOT_HELD = (
    GateDecision.RELEASED,
    GateDecision.PARKED,
    GateDecision.DEFERRED,
    GateDecision.NOT_HELD,
)
SLOT_MS = 60_000


def ids_of(key: str, n: int, stem: str = "j") -> list[str]:
    """``n`` ids of gate key ``key`` (``{key}<stem><i>``: on the key's shard)."""
    return ["{" + key + "}" + f"{stem}{i}" for i in range(n)]


def put(store: Store, r: redis.Redis, ids: Sequence[str], ago_ms: int = 1000) -> int:
    """Store ``ids`` due ``ago_ms`` ago (1 ms apart, in order); the first one's due time."""
    first = server_ms(r) - ago_ms
    jobs = [(job_id, first + i, "env-" + job_id) for i, job_id in enumerate(ids)]
    assert [status for status, _ in store.enqueue(jobs)] == [EnqueueOutcome.NEW] * len(ids)
    return first


def claim_and_gate(
    store: Store, token: str, gates: dict[str, Gate], slot_ms: int = SLOT_MS, batch: int | None = None
) -> dict[str, GateResult]:
    """A beat's pass over the shards of ``gates``' jobs: claim (at most ``batch`` a shard) and
    gate the claimed jobs that are in ``gates``."""
    shards = sorted({store.keys.shard_of(job_id) for job_id in gates})
    by_shard: dict[int, list[tuple[str, Gate]]] = {}
    for result in store.claim(shards, token, batch):
        mine = [(job.id, gates[job.id]) for job in result.jobs if job.id in gates]
        if mine:
            by_shard[result.shard] = mine
    return store.gate(token, by_shard, slot_ms) if by_shard else {}


def decisions(results: dict[str, GateResult]) -> dict[str, GateDecision]:
    return {job_id: result.decision for job_id, result in results.items()}


def hold(
    store: Store, token: str, jobs: Sequence[tuple[str, str]], slot_ms: int = SLOT_MS
) -> dict[str, bool]:
    by_shard: dict[int, list[tuple[str, str]]] = {}
    for job_id, key in jobs:
        by_shard.setdefault(store.keys.shard_of(key), []).append((job_id, key))
    return store.hold(token, by_shard, slot_ms)


def run_ids(store: Store, r: redis.Redis, key: str) -> list[str]:
    return list(r.zrange(store.keys.for_key(key).running(key), 0, -1))


def wait_ids(store: Store, r: redis.Redis, key: str) -> list[str]:
    return list(r.zrange(store.keys.for_key(key).waiting(key), 0, -1))


def score(store: Store, r: redis.Redis, job_id: str) -> float | None:
    value: float | None = r.zscore(store.keys.for_job(job_id).due, job_id)
    return value


def lease(store: Store, r: redis.Redis, job_id: str) -> str | None:
    value: str | None = r.hget(store.keys.for_job(job_id).leases, job_id)
    return value


def start(
    store: Store, r: redis.Redis, key: str, n: int, limit: int | None, token: str = "beat-a"
) -> list[str]:
    """``n`` jobs of ``key`` (limit ``limit``) claimed, gated and the released ones held; their ids."""
    ids = ids_of(key, n)
    put(store, r, ids)
    results = claim_and_gate(store, token, {job_id: Gate(key, limit) for job_id in ids})
    released = [job_id for job_id in ids if results[job_id].decision is RELEASED]
    assert all(hold(store, token, [(job_id, key) for job_id in released]).values())
    return ids


# -- gate: the cap ---------------------------------------------------------------------------


def test_the_cap_holds_across_two_beats(store: Store, r: redis.Redis) -> None:
    """Limit 2: a beat claims two jobs and both go; another beat claims three more, all parked
    (PARK_MS, lease "gate" with the tries before this claim, in the key's waiting list)."""
    ids = ids_of("tenant:1", 5)
    first = put(store, r, ids)
    gates = {job_id: Gate("tenant:1", 2) for job_id in ids}
    a = claim_and_gate(store, "beat-a", gates, batch=2)
    assert decisions(a) == {ids[0]: RELEASED, ids[1]: RELEASED}
    b = claim_and_gate(store, "beat-b", gates)
    assert decisions(b) == {job_id: PARKED for job_id in ids[2:]}
    assert sorted(run_ids(store, r, "tenant:1")) == ids[:2]
    assert wait_ids(store, r, "tenant:1") == ids[2:]  # priority 0 each: by due
    for i, job_id in enumerate(ids[2:], start=2):
        assert score(store, r, job_id) == PARK_MS
        assert lease(store, r, job_id) == f"{first + i}|0|gate"
        record = store.get(job_id)
        assert record is not None and (record.state, record.due_ms, record.tries) == ("gated", first + i, 0)
    # The released ones are still the beat's until it holds them; then they run.
    assert lease(store, r, ids[0]) == f"{first}|1|beat-a"
    assert hold(store, "beat-b", [(ids[0], "tenant:1")]) == {ids[0]: False}  # not its lease
    assert hold(store, "beat-a", [(i, "tenant:1") for i in ids[:2]]) == {ids[0]: True, ids[1]: True}
    now = server_ms(r)
    for i, job_id in enumerate(ids[:2]):
        assert lease(store, r, job_id) == f"{first + i}|1|run"
        slot = r.zscore(store.keys.for_key("tenant:1").running("tenant:1"), job_id)
        assert slot == score(store, r, job_id) and now < slot <= now + SLOT_MS
        record = store.get(job_id)
        assert record is not None and (record.state, record.due_ms, record.tries) == ("running", first + i, 1)
    # Parked jobs are listed at their due time (past), running ones at their slot's end (ahead).
    assert [j.state for j in store.scan()] == ["gated", "gated", "gated", "running", "running"]
    assert store.key_state("tenant:1") == KeyState("tenant:1", 2, None, 2, 3, False)
    # A third beat finds nothing due: the parked jobs are not claimed by time.
    [claimed] = store.claim([store.keys.shard_of(ids[0])], "beat-c")
    assert claimed.jobs == []


def test_a_job_not_held_by_the_token_is_left_alone(store: Store, r: redis.Redis) -> None:
    ids = ids_of("k", 2)
    put(store, r, ids)
    shard = store.keys.shard_of(ids[0])
    store.claim([shard], "beat-a")
    before = snapshot(_url(store))
    gates = [(job_id, Gate("k", 1)) for job_id in ids]
    result = store.gate("beat-b", {shard: [*gates, ("{k}missing", Gate("k", 1))]}, SLOT_MS)
    assert decisions(result) == {ids[0]: NOT_HELD, ids[1]: NOT_HELD, "{k}missing": NOT_HELD}
    after = snapshot(_url(store))
    keys = store.keys.for_key("k")
    # Only the key's record changed (every key a gate call sees is recorded).
    assert {k: v for k, v in after.items() if k != keys.gate_keys.encode()} == {
        k: v for k, v in before.items() if k != keys.gate_keys.encode()
    }
    assert r.hget(keys.gate_keys, "k") == "1"


def _url(store: Store) -> str:
    kwargs = store.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db') or 0}"


def test_a_redelivered_running_job_keeps_its_one_slot(store: Store, r: redis.Redis) -> None:
    """The worker dies: the slot (and the job's score) expire, another beat claims the job
    again (tries 2) and the gate releases it into the slot it has, not a second one; a new job
    of the key stays parked meanwhile."""
    [job] = ids_of("k", 1)
    first = put(store, r, [job])
    assert decisions(claim_and_gate(store, "beat-a", {job: Gate("k", 1)}, SLOT_MS)) == {job: RELEASED}
    assert hold(store, "beat-a", [(job, "k")], SLOT_MS) == {job: True}
    [other] = ids_of("k", 1, "other")
    put(store, r, [other])
    assert decisions(claim_and_gate(store, "beat-a", {other: Gate("k", 1)})) == {other: PARKED}
    assert claim_and_gate(store, "beat-b", {job: Gate("k", 1)}) == {}  # not before the slot ends
    # The slot and the job's score run out (on the server: as when SLOT_MS passes).
    assert expire_slots(store, "k") == [job] and expire_leases(store, [job]) == [job]
    results = claim_and_gate(store, "beat-b", {job: Gate("k", 1)})
    assert decisions(results) == {job: RELEASED}
    assert run_ids(store, r, "k") == [job]
    assert lease(store, r, job) == f"{first}|2|beat-b"
    assert hold(store, "beat-b", [(job, "k")]) == {job: True}
    assert lease(store, r, job) == f"{first}|2|run"
    assert wait_ids(store, r, "k") == [other]


# -- parked order and promotion ----------------------------------------------------------------


def test_parked_jobs_go_by_priority_then_due(store: Store, r: redis.Redis) -> None:
    """Limit 1 and one job running; five more parked with priorities 0, 9, 3, 9, 0. Each
    release promotes one: the highest priority first, the earliest due among equals; its score
    is now - priority, so a claim takes higher priorities first."""
    [running] = start(store, r, "k", 1, 1)
    ids = ids_of("k", 5, "p")
    priorities = [0, 9, 3, 9, 0]
    first = put(store, r, ids)
    gates = {job_id: Gate("k", 1, priority=p) for job_id, p in zip(ids, priorities, strict=True)}
    assert decisions(claim_and_gate(store, "beat-a", gates)) == dict.fromkeys(ids, PARKED)
    expected = [ids[1], ids[3], ids[2], ids[0], ids[4]]
    assert wait_ids(store, r, "k") == expected
    scores = dict(r.zrange(store.keys.for_key("k").waiting("k"), 0, -1, withscores=True))
    for i, (job_id, p) in enumerate(zip(ids, priorities, strict=True)):
        assert scores[job_id] == float(wait_score(p, first + i)) == (255 - p) * 10**13 + first + i
    order: list[str] = []
    current = running
    for _ in range(5):
        before = server_ms(r)
        result = store.release(current, "k", "succeeded")
        assert result == ReleaseResult(True, 1, False)
        [promoted] = [j for j in ids if j not in order and (score(store, r, j) or PARK_MS) < PARK_MS]
        p = gates[promoted].priority
        assert before - p <= (score(store, r, promoted) or 0) <= server_ms(r) - p
        order.append(promoted)
        assert decisions(claim_and_gate(store, "beat-a", {promoted: gates[promoted]})) == {promoted: RELEASED}
        assert hold(store, "beat-a", [(promoted, "k")]) == {promoted: True}
        current = promoted
    assert order == expected
    record = store.get(current)  # the last one promoted runs, after one claim (parking gave its try back)
    assert record is not None and (record.state, record.tries) == ("running", 1)


def test_the_claim_takes_higher_priorities_first(store: Store, r: redis.Redis) -> None:
    [running] = start(store, r, "k", 1, 1)
    ids = ids_of("k", 3, "p")
    put(store, r, ids)
    gates = {job_id: Gate("k", 1, priority=p) for job_id, p in zip(ids, [1, 200, 50], strict=True)}
    claim_and_gate(store, "beat-a", gates)
    assert store.set_limit("k", 10) == 3
    [claimed] = store.claim([store.keys.shard_of(running)], "beat-b")
    assert [j.id for j in claimed.jobs] == [ids[1], ids[2], ids[0]]
    assert [j.tries for j in claimed.jobs] == [1, 1, 1]  # parking gave back the claim's try


@pytest.mark.parametrize("how", ["release", "raise-limit", "unlimit", "resume", "clear"])
def test_parked_jobs_are_promoted(how: str, store: Store, r: redis.Redis, wake: Wake) -> None:
    """Limit 1 (paused for "resume", an override of 1 for "clear" with the jobs' own limit 3):
    one job runs, three are parked. The change promotes as many as the free slots and wakes
    the beats."""
    own = 3 if how == "clear" else 1
    if how == "clear":
        store.set_limit("k", 1)
    running = start(store, r, "k", 1, own)
    if how == "resume":
        store.pause("k")
    ids = ids_of("k", 3, "p")
    put(store, r, ids)
    results = claim_and_gate(store, "beat-a", {j: Gate("k", own) for j in ids})
    assert decisions(results) == dict.fromkeys(ids, PARKED)
    wake.drain()
    before = server_ms(r)
    if how == "release":
        assert store.release(running[0], "k", "succeeded") == ReleaseResult(True, 1, False)
        promoted = 1
    elif how == "raise-limit":
        assert store.set_limit("k", 3) == 2
        promoted = 2
    elif how == "unlimit":
        assert store.set_limit("k", None) == 3
        promoted = 3
    elif how == "resume":
        assert store.resume("k") == 0  # limit 1, one running: no free slot
        assert store.key_state("k").paused is False
        store.release(running[0], "k", "succeeded")
        promoted = 1
    else:
        assert store.clear_limit("k") == 2
        promoted = 2
    due = [j for j in ids if (score(store, r, j) or PARK_MS) < PARK_MS]
    assert due == ids[:promoted]
    assert wait_ids(store, r, "k") == ids[promoted:]
    messages = wake.drain()
    assert len(messages) == 1 and int(messages[0].split(":")[1]) <= server_ms(r)
    assert int(messages[0].split(":")[1]) >= before - 255
    state = store.key_state("k")
    assert (state.waiting, state.running) == (3 - promoted, 0 if how in ("release", "resume") else 1)


def test_a_lowered_limit_takes_effect(store: Store, r: redis.Redis) -> None:
    """Limit 4, four running; the limit set to 1: nothing stops, but the releases promote
    nothing until one job runs, and new jobs are parked meanwhile."""
    ids = start(store, r, "k", 4, 4)
    assert run_ids(store, r, "k") == sorted(ids)
    assert store.set_limit("k", 1) == 0
    assert store.key_limit("k") == (True, 1)
    new = ids_of("k", 2, "new")
    put(store, r, new)
    results = claim_and_gate(store, "beat-a", {j: Gate("k", 4) for j in new})
    assert decisions(results) == dict.fromkeys(new, PARKED)
    assert [store.release(j, "k", "succeeded").promoted for j in ids] == [0, 0, 0, 1]
    assert store.key_state("k") == KeyState("k", 1, "1", 0, 1, False)
    assert decisions(claim_and_gate(store, "beat-a", {new[0]: Gate("k", 4)})) == {new[0]: RELEASED}


def test_a_paused_key_parks_everything_until_resumed(store: Store, r: redis.Redis) -> None:
    assert store.pause("k") == 0
    ids = ids_of("k", 3)
    put(store, r, ids)
    results = claim_and_gate(store, "beat-a", {j: Gate("k", None, parse_rate("100/s")) for j in ids})
    assert decisions(results) == dict.fromkeys(ids, PARKED)
    assert store.key_state("k") == KeyState("k", None, None, 0, 3, True)
    assert store.resume("k") == 3  # no cap: all of them
    assert store.key_state("k") == KeyState("k", None, None, 0, 0, False)
    [claimed] = store.claim([store.keys.shard_of(ids[0])], "beat-a")
    assert sorted(j.id for j in claimed.jobs) == ids


def test_key_states_list_every_key(store: Store, r: redis.Redis) -> None:
    start(store, r, "a", 2, 1)
    start(store, r, "b", 1, None)
    store.set_limit("c", 5)
    store.pause("c")
    assert store.key_states() == [
        KeyState("a", 1, None, 1, 1, False),
        KeyState("b", None, None, 1, 0, False),
        KeyState("c", 5, "5", 0, 0, True),
    ]
    assert store.key_limit("a") == (False, None)
    store.set_limit("a", None)
    assert store.key_limit("a") == (True, None)
    assert store.key_state("a").limit is None and store.key_state("a").override == "none"


# -- rate --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rate_spaces_releases_across_two_beats(store: Store, r: redis.Redis, wake: Wake) -> None:
    """2/s: one release every 500 ms (GCRA, no burst), whichever beat gates. A deferred job
    books the next time the rate allows (its score, the reply's until_ms; the wake marker is
    lowered to the first), keeps its tries and is released when claimed then, without being
    deferred again: two jobs deferred at once book times 500 ms apart."""
    ids = ids_of("r", 3)
    first = put(store, r, ids)
    gate = Gate("r", None, parse_rate("2/s"))
    before = server_ms(r)
    a = claim_and_gate(store, "beat-a", {ids[0]: gate}, batch=1)
    assert decisions(a) == {ids[0]: RELEASED}
    wake.drain()
    b = claim_and_gate(store, "beat-b", {j: gate for j in ids[1:]})
    assert decisions(b) == {ids[1]: DEFERRED, ids[2]: DEFERRED}
    until = b[ids[1]].until_ms
    assert until is not None and before + 500 <= until <= server_ms(r) + 500
    assert b[ids[2]].until_ms == until + 500  # booked the next arrival after it
    for i in (1, 2):
        assert score(store, r, ids[i]) == until + (i - 1) * 500
        assert lease(store, r, ids[i]) == f"{first + i}|0|gate"
    keys = store.keys.for_key("r")
    assert int(r.get(keys.wake)) <= until
    assert wake.drain() == [f"{keys.index}:{until}"]
    wait_for(lambda: server_ms(r) >= until, timeout=5)
    c = claim_and_gate(store, "beat-a", {j: gate for j in ids[1:]})
    assert decisions(c) == {ids[1]: RELEASED}  # ids[2] is not due before its booked time
    wait_for(lambda: server_ms(r) >= until + 500, timeout=5)
    d = claim_and_gate(store, "beat-b", {ids[2]: gate})
    assert decisions(d) == {ids[2]: RELEASED}  # its booking used: not deferred again
    assert float(r.hget(keys.gate_rates, "r")) == until + 1000
    assert r.hlen(keys.gate_booked) == 0
    record = store.get(ids[1])
    assert record is not None and record.tries == 1


# -- release -----------------------------------------------------------------------------------


def test_release_is_idempotent(store: Store, r: redis.Redis) -> None:
    ids = start(store, r, "k", 2, 1)
    assert store.release(ids[0], "k", "succeeded") == ReleaseResult(True, 1, False)
    assert store.get(ids[0]) is None
    state = snapshot(_url(store))
    assert store.release(ids[0], "k", "succeeded") == ReleaseResult(False, 0, False)
    assert store.release(ids[0], "k", "failed") == ReleaseResult(False, 0, False)
    assert snapshot(_url(store)) == state


def test_a_release_before_hold_removes_the_job_and_hold_does_nothing(store: Store, r: redis.Redis) -> None:
    """A fast worker: the task ends before the beat holds it. The job still has the beat's
    lease: release removes it, and the hold finds it finished (done, nothing written)."""
    ids = ids_of("k", 1)
    put(store, r, ids)
    claim_and_gate(store, "beat-a", {ids[0]: Gate("k", 1)})
    assert store.release(ids[0], "k", "succeeded") == ReleaseResult(True, 0, False)
    assert store.get(ids[0]) is None
    assert hold(store, "beat-a", [(ids[0], "k")]) == {ids[0]: True}
    assert store.get(ids[0]) is None and run_ids(store, r, "k") == []


def test_hold_gives_the_start_ttl_and_the_worker_takes_the_slot_over(store: Store, r: redis.Redis) -> None:
    """hold.lua: the message may wait for a worker the start TTL (due score and slot expiry
    now + it). slot_renew.lua at the task's start: now + the slot TTL, lease "run". A worker
    that starts the task before the beat's hold takes the beat's lease over; the hold then
    has nothing to do (True) and does not give the start TTL back."""
    ids = ids_of("k", 3)
    first = put(store, r, ids)
    claim_and_gate(store, "beat-a", {job: Gate("k", 3) for job in ids})
    before = server_ms(r)
    assert hold(store, "beat-a", [(ids[0], "k")], slot_ms=3_600_000) == {ids[0]: True}
    for value in (score(store, r, ids[0]), r.zscore(store.keys.for_key("k").running("k"), ids[0])):
        assert value is not None and before + 3_600_000 <= value <= server_ms(r) + 3_600_000
    assert store.renew_slots([(ids[0], "k")], 5_000) == {ids[0]: True}
    assert score(store, r, ids[0]) is not None and score(store, r, ids[0]) <= server_ms(r) + 5_000  # type: ignore[operator]
    # ids[1]: its worker starts it before the beat holds it
    assert lease(store, r, ids[1]) == f"{first + 1}|1|beat-a"
    assert store.renew_slots([(ids[1], "k")], 5_000) == {ids[1]: True}
    assert lease(store, r, ids[1]) == f"{first + 1}|1|run"
    taken = score(store, r, ids[1])
    assert taken is not None and taken <= server_ms(r) + 5_000
    assert hold(store, "beat-a", [(ids[1], "k")], slot_ms=3_600_000) == {ids[1]: True}
    assert score(store, r, ids[1]) == taken and lease(store, r, ids[1]) == f"{first + 1}|1|run"
    # a beat whose lease expired and another beat took: not held, nothing written
    r.hset(store.keys.for_job(ids[2]).leases, ids[2], f"{first + 2}|2|beat-b")
    assert hold(store, "beat-a", [(ids[2], "k")]) == {ids[2]: False}
    assert lease(store, r, ids[2]) == f"{first + 2}|2|beat-b"


def test_a_release_keeps_a_job_stored_again(store: Store, r: redis.Redis) -> None:
    """A retry with a countdown stores the running job again (no lease entry): the worker's
    release ("retry") gives its slot back and keeps the new job."""
    [job] = start(store, r, "k", 1, 1)
    later = server_ms(r) + 60_000
    assert store.enqueue([(job, later, "retry")]) == [(EnqueueOutcome.AFTER_HELD, later)]
    assert store.release(job, "k", "retry") == ReleaseResult(True, 0, False)
    record = store.get(job)
    assert record is not None
    assert (record.state, record.due_ms, record.envelope) == ("waiting", later, "retry")
    assert run_ids(store, r, "k") == []


def test_slot_renew_extends_slots_and_running_scores(store: Store, r: redis.Redis) -> None:
    [running] = start(store, r, "k", 1, 2)
    [released] = ids_of("k", 1, "fresh")
    put(store, r, [released])
    claim_and_gate(store, "beat-a", {released: Gate("k", 2)})  # released, not held yet
    beat_lease = score(store, r, released)
    before = server_ms(r)
    result = store.renew_slots([(running, "k"), (released, "k"), ("{k}gone", "k")], 90_000)
    assert result == {running: True, released: True, "{k}gone": False}
    slots = dict(r.zrange(store.keys.for_key("k").running("k"), 0, -1, withscores=True))
    for job_id in (running, released):
        assert before + 90_000 <= slots[job_id] <= server_ms(r) + 90_000
    assert score(store, r, running) == slots[running]
    # its worker started it before the beat's hold: the slot is the worker's now
    assert score(store, r, released) == slots[released] != beat_lease
    assert (lease(store, r, released) or "").endswith("|run")


def test_an_expired_slot_of_a_cancelled_job_is_purged_by_the_next_gate(store: Store, r: redis.Redis) -> None:
    [job] = start(store, r, "k", 1, 1)
    store.renew_slots([(job, "k")], SLOT_MS)
    assert store.cancel(job) == CancelOutcome.DELIVERING
    [fresh] = ids_of("k", 1, "fresh")
    put(store, r, [fresh])
    assert decisions(claim_and_gate(store, "beat-a", {fresh: Gate("k", 1)})) == {fresh: PARKED}
    assert run_ids(store, r, "k") == [job]  # its slot has not expired yet
    assert expire_slots(store, "k") == [job]  # now it has (on the server)
    [other] = ids_of("k", 1, "other")
    put(store, r, [other])
    assert decisions(claim_and_gate(store, "beat-b", {other: Gate("k", 1)})) == {other: RELEASED}
    assert run_ids(store, r, "k") == [other]
    assert wait_ids(store, r, "k") == [fresh]


def test_an_operator_frees_a_slot_a_cancelled_jobs_dead_worker_kept(store: Store, r: redis.Redis) -> None:
    """No new job of the key comes to be gated: its parked jobs wait for the dead slot. Any
    admin op (here a resume of a key that was not paused) purges it and promotes one."""
    [job] = start(store, r, "k", 1, 1)
    [parked] = ids_of("k", 1, "parked")
    put(store, r, [parked])
    assert decisions(claim_and_gate(store, "beat-a", {parked: Gate("k", 1)})) == {parked: PARKED}
    store.cancel(job)
    assert store.resume("k") == 0  # the slot has not expired: the worker may still run
    store.renew_slots([(job, "k")], SLOT_MS)
    assert store.resume("k") == 0  # renewed: still not
    assert expire_slots(store, "k") == [job]  # the renewals stop: the slot runs out
    assert store.resume("k") == 1
    assert run_ids(store, r, "k") == [] and (score(store, r, parked) or PARK_MS) <= server_ms(r)


def test_an_expired_slot_whose_job_is_stored_is_kept(store: Store, r: redis.Redis) -> None:
    """A dead worker's job is stored (its score passed too): its slot stays for its
    redelivery, and a new job is parked."""
    [job] = start(store, r, "k", 1, 1)
    store.renew_slots([(job, "k")], SLOT_MS)
    # The slot and the job's score run out (on the server: as when SLOT_MS passes).
    assert expire_slots(store, "k") == [job] and expire_leases(store, [job]) == [job]
    [fresh] = ids_of("k", 1, "fresh")
    put(store, r, [fresh])
    results = claim_and_gate(store, "beat-a", {fresh: Gate("k", 1), job: Gate("k", 1)})
    assert decisions(results) == {job: RELEASED, fresh: PARKED}


def test_a_release_moves_the_head_of_the_parked_list_into_its_slot(store: Store, r: redis.Redis) -> None:
    """promote reads the parked list's head once: with one free slot (a release) it is the job
    moved; a head that is no longer parked (cancelled) is dropped and the next one moved; with
    two free slots the list is read again; a key with none parked promotes nothing."""
    a, b = start(store, r, "k", 2, 2)
    parked = ids_of("k", 4, "p")
    put(store, r, parked)
    assert decisions(claim_and_gate(store, "beat-a", {j: Gate("k", 2) for j in parked})) == dict.fromkeys(
        parked, PARKED
    )
    assert store.cancel(parked[0]) is not None
    assert store.release(a, "k", "succeeded") == ReleaseResult(True, 1, False)
    assert (score(store, r, parked[1]) or PARK_MS) <= server_ms(r)
    assert wait_ids(store, r, "k") == parked[2:]
    assert store.key_state("k").running == 1  # the moved job gets its slot when claimed
    assert store.set_limit("k", 3) == 2  # b runs: two free slots, the two left moved
    assert wait_ids(store, r, "k") == []
    assert all((score(store, r, j) or PARK_MS) < PARK_MS for j in parked[2:])
    assert store.release(b, "k", "succeeded") == ReleaseResult(True, 0, False)


def test_hold_and_renew_never_give_back_a_slot_that_is_gone(store: Store, r: redis.Redis) -> None:
    """hold.lua and slot_renew.lua check and extend a slot in one ZADD XX: a job whose slot is
    gone (a release came first, or an operator removed it) is not held or renewed, and gets no
    slot back (the cap would not count it)."""
    a, b = ids_of("k", 2)
    put(store, r, [a, b])
    claim_and_gate(store, "beat-a", {a: Gate("k", 2), b: Gate("k", 2)})
    r.zrem(store.keys.for_key("k").running("k"), a, b)
    assert hold(store, "beat-a", [(a, "k")]) == {a: False}
    assert store.renew_slots([(b, "k")], SLOT_MS) == {b: False}
    assert run_ids(store, r, "k") == []
    assert lease(store, r, a) is not None and lease(store, r, a).endswith("|beat-a")  # type: ignore[union-attr]


def test_a_dead_worker_s_slot_comes_back_after_its_ttl_and_the_waiting_job_starts(
    store: Store, r: redis.Redis
) -> None:
    """Limit 1: the running job's worker takes its slot over (slot TTL 50 ms here) and dies (no
    renewal, no release) while another job waits. Once the TTL has passed the job is claimed
    again and released into its same slot (the cap holds: the waiting job stays parked);
    its second run's release hands the slot to the waiting job."""
    [job] = start(store, r, "k", 1, 1)
    [waiting] = ids_of("k", 1, "w")
    put(store, r, [waiting])
    assert decisions(claim_and_gate(store, "beat-a", {waiting: Gate("k", 1)})) == {waiting: PARKED}
    assert store.renew_slots([(job, "k")], 50) == {job: True}  # the take-over; then it dies
    expiry = score(store, r, job)
    assert expiry is not None
    assert decisions(claim_and_gate(store, "beat-b", {job: Gate("k", 1)})) == {}  # not due yet
    assert wait_for(lambda: server_ms(r) > expiry, 5, 0.01)
    assert decisions(claim_and_gate(store, "beat-b", {job: Gate("k", 1)})) == {job: RELEASED}
    assert run_ids(store, r, "k") == [job] and wait_ids(store, r, "k") == [waiting]
    assert all(hold(store, "beat-b", [(job, "k")]).values())
    assert store.release(job, "k", "succeeded") == ReleaseResult(True, 1, False)
    assert decisions(claim_and_gate(store, "beat-b", {waiting: Gate("k", 1)})) == {waiting: RELEASED}
    assert run_ids(store, r, "k") == [waiting] and store.get(job) is None


# -- batches -----------------------------------------------------------------------------------


def open_batch(store: Store, bid: str, total: int, done_envelope: str | None = "on-complete") -> None:
    completion = None if done_envelope is None else (completion_id(bid), done_envelope)
    assert store.open_batch(bid, total, completion, {"limit": 2}) is True


def test_a_batch_is_opened_once(store: Store, r: redis.Redis) -> None:
    before = server_ms(r)
    open_batch(store, "b1", 3)
    state = snapshot(_url(store))
    assert store.open_batch("b1", 5, None, {}) is False
    assert snapshot(_url(store)) == state
    found = store.batch_state("b1")
    assert found is not None and before <= found.created_ms <= server_ms(r)
    assert found == BatchState("b1", 3, 0, 0, 0, 0, 3, False, found.created_ms)
    assert found.progress() == {
        "total": 3,
        "waiting": 3,
        "running": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    completion = store.get(completion_id("b1"))
    assert completion is not None
    assert (completion.state, completion.envelope, completion.due_ms) == (
        "gated",
        "on-complete",
        found.created_ms,
    )
    keys = store.keys.for_key(batch_key("b1"))
    assert json.loads(r.hget(keys.batch("b1"), "meta")) == {"limit": 2}
    assert r.smembers(keys.batches) == {"b1"}
    assert store.batch_states() == [found]
    assert store.batch_state("nope") is None


def batch_members(
    store: Store, r: redis.Redis, bid: str, n: int, limit: int | None = None
) -> tuple[list[str], dict[str, Gate]]:
    ids = [member_id(bid, i) for i in range(n)]
    put(store, r, ids)
    return ids, {j: Gate(batch_key(bid), limit, batch=bid) for j in ids}


def test_a_batch_completes_exactly_once(store: Store, r: redis.Redis, wake: Wake) -> None:
    """Three members, limit 2: two succeed or fail, the third runs after them; its release
    completes the batch: the completion job is due (now - 256, the wake marker), one message
    on the batch channel; releases after that change no count and publish nothing."""
    batch_wake = Wake(r, store.keys.batch_channel)
    open_batch(store, "b1", 3)
    ids, gates = batch_members(store, r, "b1", 3, 2)
    key = batch_key("b1")
    results = claim_and_gate(store, "beat-a", gates)
    assert decisions(results) == {ids[0]: RELEASED, ids[1]: RELEASED, ids[2]: PARKED}
    hold(store, "beat-a", [(ids[0], key), (ids[1], key)])
    assert store.batch_state("b1").progress() == {  # type: ignore[union-attr]
        "total": 3,
        "waiting": 1,
        "running": 2,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert store.release(ids[0], key, "succeeded", "b1") == ReleaseResult(True, 1, False)
    assert store.release(ids[1], key, "failed", "b1") == ReleaseResult(True, 0, False)
    assert decisions(claim_and_gate(store, "beat-a", gates)) == {ids[2]: RELEASED}
    hold(store, "beat-a", [(ids[2], key)])
    assert store.release(ids[2], key, "retry", "b1") == ReleaseResult(True, 0, False)  # not counted
    # The retry stored it again (as a worker's retry does); it runs and succeeds.
    put(store, r, [ids[2]])
    assert decisions(claim_and_gate(store, "beat-a", {ids[2]: gates[ids[2]]})) == {ids[2]: RELEASED}
    hold(store, "beat-a", [(ids[2], key)])
    wake.drain()
    before = server_ms(r)
    assert store.release(ids[2], key, "succeeded", "b1") == ReleaseResult(True, 0, True)
    state = store.batch_state("b1")
    assert (
        state is not None
        and state.done
        and state.progress()
        == {
            "total": 3,
            "waiting": 0,
            "running": 0,
            "succeeded": 2,
            "failed": 1,
            "cancelled": 0,
        }
    )
    done = score(store, r, completion_id("b1"))
    assert done is not None and before - 256 <= done <= server_ms(r) - 256
    keys = store.keys.for_key(key)
    assert wake.drain() == [f"{keys.index}:{int(done)}"]
    counts = {"total": 3, "succeeded": 2, "failed": 1, "cancelled": 0}
    assert batch_wake.drain() == [batch_message("b1", counts)]
    assert parse_batch_message(batch_message("b1", counts)) == ("b1", counts)
    # Nothing completes it twice: a late duplicate release, a cancel.
    assert store.release(ids[2], key, "succeeded", "b1") == ReleaseResult(False, 0, False)
    assert store.cancel_batch("b1") == 0
    assert batch_wake.drain() == []
    assert store.batch_state("b1") == state
    [claimed] = store.claim([keys.index], "beat-a")
    assert [(j.id, j.envelope, j.tries) for j in claimed.jobs] == [(completion_id("b1"), "on-complete", 1)]
    batch_wake.close()


def test_a_batch_completes_by_its_cancel(store: Store, r: redis.Redis) -> None:
    """Four members, limit 1: one runs, one is parked, two wait unclaimed. Cancelling removes
    the three not released and counts them; the running one's release then completes it."""
    batch_wake = Wake(r, store.keys.batch_channel)
    open_batch(store, "b2", 4, None)
    ids, gates = batch_members(store, r, "b2", 4, 1)
    key = batch_key("b2")
    results = claim_and_gate(store, "beat-a", {j: gates[j] for j in ids[:2]}, batch=2)
    assert decisions(results) == {ids[0]: RELEASED, ids[1]: PARKED}
    hold(store, "beat-a", [(ids[0], key)])
    assert store.cancel_batch("b2") == 3
    assert [store.get(j) is None for j in ids] == [False, True, True, True]
    assert wait_ids(store, r, key) == []
    assert batch_wake.drain() == []
    assert store.cancel_batch("b2") == 0
    assert store.release(ids[0], key, "succeeded", "b2") == ReleaseResult(True, 0, True)
    counts = {"total": 4, "succeeded": 1, "failed": 0, "cancelled": 3}
    assert batch_wake.drain() == [batch_message("b2", counts)]
    batch_wake.close()


def test_a_cancel_of_the_last_members_completes_the_batch(store: Store, r: redis.Redis) -> None:
    batch_wake = Wake(r, store.keys.batch_channel)
    open_batch(store, "b3", 2)
    ids, gates = batch_members(store, r, "b3", 2, None)
    key = batch_key("b3")
    claim_and_gate(store, "beat-a", {ids[0]: gates[ids[0]]}, batch=1)
    hold(store, "beat-a", [(ids[0], key)])
    assert store.release(ids[0], key, "failed", "b3") == ReleaseResult(True, 0, False)
    assert store.cancel_batch("b3", [ids[1], completion_id("b3")]) == 1
    counts = {"total": 2, "succeeded": 0, "failed": 1, "cancelled": 1}
    assert batch_wake.drain() == [batch_message("b3", counts)]
    assert (score(store, r, completion_id("b3")) or PARK_MS) < server_ms(r)
    state = store.batch_state("b3")
    assert state is not None and state.done and state.waiting == 0
    batch_wake.close()


# -- bad input -----------------------------------------------------------------------------------


def _bad_calls(channel: str) -> list[tuple[str, list[Any]]]:
    """``(script, ARGV)`` given bad input; every call would write when its input read."""
    job = ["{k}j0", "k", 1, "", "", 0]
    return [
        ("gate", ["beat|1", 60_000, channel, 0, *job]),
        ("gate", ["beat-1", 0, channel, 0, *job]),
        ("gate", ["beat-1", 60_000, channel, "x", *job]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k", 1, "", ""]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k{", 1, "", "", 0]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k", 0, "", "", 0]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k", 1.5, "", "", 0]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k", 1, 10, "", 0]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "{k}j1", "k", 1, 10, 1000, 256]),
        ("gate", ["beat-1", 60_000, channel, 0, *job, "", "k", 1, "", "", 0]),
        ("hold", ["beat-1", "soon", "{k}j0", "k"]),
        ("hold", ["beat-1", 60_000, 0, "{k}j0"]),
        ("hold", ["beat-1", 60_000, -1, "{k}j0", "k"]),
        ("slot_renew", [0, "{k}j0", "k"]),
        ("release", ["{k}j0", "k", "done", "", "b", channel, 0, ""]),
        ("release", ["{k}j0", "", "succeeded", "", "b", channel, 0, ""]),
        ("release", ["{k}j0", "k", "succeeded", "", "b", channel, "-1", ""]),
        ("release", ["{k}j0", "k", "succeeded", "", "b", channel, 0, "0"]),
        ("release", ["{k}j0", "k", "succeeded", "", "b", channel, 0]),
        ("gate_admin", ["limit", "k", 0, channel, 0]),
        ("gate_admin", ["limit", "k", "many", channel, 0]),
        ("gate_admin", ["stop", "k", "", channel, 0]),
        ("gate_admin", ["pause", "k|x", "", channel, 0]),
        ("batch_open", ["b{1}", 3, "", "", 1, "{}"]),
        ("batch_open", ["b1", -1, "", "", 1, "{}"]),
        ("batch_open", ["b1", 3, "{batch:b1}:complete", "", 1, "{}"]),
        ("batch_open", ["b1", 3, "", "", "now", "{}"]),
        ("batch_open", ["b2", 0, "", "", 1, "{}", "0"]),
        ("batch_open", ["b2", 0, "", "", 1, "{}", "soon"]),
        ("batch_grow", ["b{1}", 1]),
        ("batch_grow", ["b1", 0]),
        ("batch_grow", ["b1", "two"]),
        ("batch_seal", ["b|1", "c", channel, 0, ""]),
        ("batch_seal", ["b1", "c", channel, "zero", ""]),
        ("batch_seal", ["b1", "c", channel, 0, "soon"]),
        ("batch_cancel", ["", "batch:b1", "c", channel, 0, "", "{batch:b1}:0"]),
        ("batch_cancel", ["b1", "batch:b1", "c", channel, "zero", "", "{batch:b1}:0"]),
        ("batch_cancel", ["b1", "batch:b1", "c", channel, 0, "soon", "{batch:b1}:0"]),
        ("batch_delete", ["", "batch:b1", "done"]),
        ("batch_delete", ["b1", "batch:b1", "now"]),
        ("batch_delete", ["b1", "batch:b1"]),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls(""))))
def test_a_gate_script_refuses_bad_input_before_writing_anything(
    case: int, store: Store, r: redis.Redis
) -> None:
    name, args = _bad_calls(store.keys.wake_channel)[case]
    # Something for each call to act on: a running job of k (its slot), a parked one, a batch.
    start(store, r, "k", 2, 1)
    open_batch(store, "b1", 1)
    keys = store.keys.for_key("k")
    state = snapshot(_url(store))
    with pytest.raises(redis.ResponseError, match=f"^delayq {name}: "):
        SCRIPTS[name](r, keys.core, args)
    assert snapshot(_url(store)) == state


def test_store_release_refuses_an_unknown_outcome(store: Store) -> None:
    with pytest.raises(ValueError, match="outcome='done'"):
        store.release("{k}j0", "k", "done")


# -- a full Redis --------------------------------------------------------------------------------


@pytest.fixture
def full_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(binary=server_binary[1], extra_args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


@pytest.mark.parametrize("form", ["flags", "legacy"])
def test_a_full_redis_refuses_the_gate_but_releases_and_renews(
    full_server: EmbeddedRedis, server_binary: tuple[str, str], form: str
) -> None:
    """Over maxmemory: gate.lua (and gate_admin, batch_open) are refused before writing (the
    jobs are answered NOT_HELD and keep the beat's lease); hold, slot_renew, release and
    batch_cancel run."""
    if form == "flags" and server_binary[0] == "redis-6.2":
        pytest.skip("Redis 6.2 has no script flags")
    store = make_store(full_server.url + "/0", reclaim_ttl=30.0, shards=4)
    if form == "legacy":
        _NO_FLAGS.add(store.client)
    r = redis.Redis.from_url(full_server.url, decode_responses=True)
    try:
        running = start(store, r, "k", 2, 1)  # one running, one parked
        [published] = ids_of("h", 1)  # released, not held yet
        put(store, r, [published])
        assert decisions(claim_and_gate(store, "beat-h", {published: Gate("h", 1)})) == {published: RELEASED}
        fresh = ids_of("k", 2, "fresh")
        put(store, r, fresh)
        shard = store.keys.shard_of(fresh[0])
        [claimed] = store.claim([shard], "beat-a")
        assert {j.id for j in claimed.jobs} >= set(fresh)
        open_batch(store, "b1", 2)
        put(store, r, [member_id("b1", i) for i in range(2)])  # waiting: a cancel removes them
        limit = int(r.info("memory")["used_memory"]) - 20_000
        r.config_set("maxmemory", limit)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            r.set("probe", "x")
        state = snapshot(full_server.url + "/0")
        result = store.gate("beat-a", {shard: [(j, Gate("k", 1)) for j in fresh]}, SLOT_MS)
        assert decisions(result) == dict.fromkeys(fresh, NOT_HELD)
        for call in (lambda: store.set_limit("k", 5), lambda: store.open_batch("b2", 1, None, {})):
            with pytest.raises(StoreFull) as refused:
                call()
            assert is_oom(refused.value.__cause__)
        assert snapshot(full_server.url + "/0") == state
        assert all((lease(store, r, j) or "").endswith("|1|beat-a") for j in fresh)  # still the beat's
        assert hold(store, "beat-h", [(published, "h")]) == {published: True}
        assert lease(store, r, published) == f"{_due(store, r, published)}|1|run"
        assert store.renew_slots([(running[0], "k")], SLOT_MS) == {running[0]: True}
        assert store.release(running[0], "k", "succeeded") == ReleaseResult(True, 1, False)
        assert store.cancel_batch("b1") == 2
        assert store.batch_state("b1").done  # type: ignore[union-attr]
    finally:
        r.config_set("maxmemory", 0)
        r.close()
        store.close()


def _due(store: Store, r: redis.Redis, job_id: str) -> int:
    record = store.get(job_id)
    assert record is not None
    return record.due_ms


def test_batch_message_reads_only_its_form() -> None:
    counts = {"total": 2, "succeeded": 1, "failed": 0, "cancelled": 1}
    assert parse_batch_message(batch_message("b|x", counts)) == ("b|x", counts)
    assert parse_batch_message("nope") is None
    assert parse_batch_message("b|{bad") is None
    assert parse_batch_message('b|{"total":1}') is None


# -- Redis Cluster ---------------------------------------------------------------------------------


@pytest.mark.cluster
def test_the_gate_scripts_run_on_a_redis_cluster(cluster_url: str) -> None:
    """Every gate script touches only its shard's hash tag: on a cluster (where a script's
    key served by another node is refused) keys spread over the nodes are capped, parked, promoted, renewed,
    listed; a batch is opened, run, cancelled and completed."""
    from redis.cluster import RedisCluster

    store = make_store(cluster_url, cluster=True, reclaim_ttl=30.0)
    r = RedisCluster.from_url(cluster_url, decode_responses=True)
    try:
        keys = [f"tenant:{i}" for i in range(6)]
        nodes = {r.get_node_from_key(store.keys.for_key(k).due).name for k in keys}
        assert len(nodes) > 1
        gates: dict[str, Gate] = {}
        for key in keys:
            ids = ids_of(key, 3)
            put(store, r, ids)  # type: ignore[arg-type]
            gates.update((job_id, Gate(key, 1, priority=i)) for i, job_id in enumerate(ids))
        results = claim_and_gate(store, "beat-a", gates)
        for key in keys:
            ids = ids_of(key, 3)
            assert sorted(results[j].decision for j in ids) == sorted([RELEASED, PARKED, PARKED])
            [running] = [j for j in ids if results[j].decision is RELEASED]
            assert hold(store, "beat-a", [(running, key)]) == {running: True}
            assert store.renew_slots([(running, key)], SLOT_MS) == {running: True}
            assert store.release(running, key, "succeeded") == ReleaseResult(True, 1, False)
            assert store.set_limit(key, 5) == 1
            assert store.pause(key) == 0 and store.resume(key) == 0
        assert [s.key for s in store.key_states()] == keys
        open_batch(store, "cb", 2)
        ids, member_gates = batch_members(store, r, "cb", 2, 1)  # type: ignore[arg-type]
        assert decisions(claim_and_gate(store, "beat-a", member_gates)) == {ids[0]: RELEASED, ids[1]: PARKED}
        hold(store, "beat-a", [(ids[0], batch_key("cb"))])
        assert store.cancel_batch("cb") == 1
        assert store.release(ids[0], batch_key("cb"), "succeeded", "cb") == ReleaseResult(True, 0, True)
        state = store.batch_state("cb")
        assert state is not None and state.done and store.batch_states() == [state]
        assert store.get(completion_id("cb")) is not None
    finally:
        r.close()
        store.close()


def test_corrupt_gate_data_is_read_as_absent(store: Store, r: redis.Redis) -> None:
    """An override, a rate time or batch counts that do not read (written by hand) change no
    answer into an error: the override is ignored (the job's own limit counts), the rate
    starts again, the counts read as 0; a lease entry held by the token that does not read is
    gated with due now and tries 1."""
    keys = store.keys.for_key("k")
    r.hset(keys.gate_keys, "k", "1|lots|")  # own limit 1, override "lots", not paused
    r.hset(keys.gate_rates, "k", "soon")
    ids = ids_of("k", 2)
    put(store, r, ids)
    gates = {j: Gate("k", 1, parse_rate("1/h")) for j in ids}
    assert decisions(claim_and_gate(store, "beat-a", gates)) == {ids[0]: RELEASED, ids[1]: PARKED}
    assert store.key_state("k") == KeyState("k", 1, "lots", 1, 1, False)
    assert float(r.hget(keys.gate_rates, "k")) > server_ms(r) + 3_500_000  # a new arrival time
    [odd] = ids_of("odd", 1)
    put(store, r, [odd])
    store.claim([store.keys.shard_of(odd)], "beat-a")
    r.hset(store.keys.for_job(odd).leases, odd, "garbage|beat-a")
    before = server_ms(r)
    assert decisions(store.gate("beat-a", {store.keys.shard_of(odd): [(odd, Gate("odd", 1))]}, SLOT_MS)) == {
        odd: RELEASED
    }
    assert hold(store, "beat-a", [(odd, "odd")]) == {odd: True}
    entry = lease(store, r, odd) or ""
    assert entry.endswith("|1|run") and before <= int(entry.split("|")[0]) <= server_ms(r)
    open_batch(store, "b1", 1)
    bkeys = store.keys.for_key(batch_key("b1"))
    r.hset(bkeys.batch("b1"), mapping={"succeeded": "many", "failed": "x"})
    assert store.batch_state("b1") == BatchState("b1", 1, 0, 0, 0, 0, 1, False, _created(store, r, "b1"))
    [member] = batch_members(store, r, "b1", 1)[0]
    claim_and_gate(store, "beat-a", {member: Gate(batch_key("b1"), None, batch="b1")})
    assert store.release(member, batch_key("b1"), "succeeded", "b1") == ReleaseResult(True, 0, True)


def _created(store: Store, r: redis.Redis, bid: str) -> int:
    return int(r.hget(store.keys.for_key(batch_key(bid)).batch(bid), "created"))


def test_a_gate_call_of_many_jobs_slices_its_writes(store: Store, r: redis.Redis) -> None:
    """4500 jobs in one call (9000 values for the HSET of gate:keys, more than one Lua unpack
    takes): every one is answered, every key recorded; through the store, 2500 jobs go in
    chunks of GATE_CHUNK."""
    keys = store.keys.shard(0)
    args: list[Any] = ["beat-a", SLOT_MS, store.keys.wake_channel, 0]
    for i in range(4500):
        args += [f"{{k{i}}}j", f"k{i}", 1, "", "", 0]
    assert SCRIPTS["gate"](r, keys.core, args) == [["not-held", 0]] * 4500
    assert r.hlen(keys.gate_keys) == 4500
    jobs = [(f"{{m}}j{i}", Gate("m", 1)) for i in range(2500)]
    result = store.gate("beat-a", {store.keys.shard_of("m"): jobs}, SLOT_MS)
    assert len(result) == 2500 and {g.decision for g in result.values()} == {NOT_HELD}


# -- the documented ACL user ---------------------------------------------------------------------


ACL_ADMIN = ("admin", "admin-pw")


@pytest.fixture
def acl_admin(server_binary: tuple[str, str]) -> Iterator[tuple[EmbeddedRedis, redis.Redis]]:
    """A server whose default user is off, its admin client, and the user of docs/security.md."""
    with EmbeddedRedis(binary=server_binary[1]) as server:
        setup = redis.Redis(host="127.0.0.1", port=server.port)
        setup.execute_command("ACL", "SETUSER", ACL_ADMIN[0], "on", f">{ACL_ADMIN[1]}", "~*", "&*", "+@all")
        setup.execute_command("ACL", "SETUSER", "default", "off")
        setup.close()
        admin = redis.Redis(
            host="127.0.0.1",
            port=server.port,
            username=ACL_ADMIN[0],
            password=ACL_ADMIN[1],
            decode_responses=True,
        )
        admin.execute_command("ACL", "SETUSER", *documented_rule("delayq", server=server_kind(admin)))
        admin.acl_log_reset()
        yield server, admin
        admin.close()


def test_the_documented_acl_user_runs_flow_control(acl_admin: tuple[EmbeddedRedis, redis.Redis]) -> None:
    """Every flow-control script and read of the store, as the user of docs/security.md: all
    work and nothing is refused (the ACL log stays empty), the batch message included."""
    server, admin = acl_admin
    store = make_store(f"redis://delayq:{STORE_PASSWORD}@127.0.0.1:{server.port}/0", reclaim_ttl=30.0)
    r = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        username=ACL_ADMIN[0],
        password=ACL_ADMIN[1],
        decode_responses=True,
    )
    subscription = store.batch_subscription()
    try:
        ids = start(store, r, "k", 3, 1)
        [running] = [j for j in ids if (lease(store, r, j) or "").endswith("|run")]
        assert store.renew_slots([(running, "k")], SLOT_MS) == {running: True}
        assert store.pause("k") == 0 and store.resume("k") == 0
        assert store.set_limit("k", 2) == 1 and store.set_limit("k", None) == 1
        assert store.clear_limit("k") == 0 and store.key_limit("k") == (False, None)
        assert store.release(running, "k", "succeeded").released
        assert [s.key for s in store.key_states()] == ["k"] and store.key_state("k").running == 0
        rated = ids_of("rated", 2)
        put(store, r, rated)
        results = claim_and_gate(store, "beat-a", {j: Gate("rated", None, parse_rate("1/h")) for j in rated})
        assert decisions(results) == {rated[0]: RELEASED, rated[1]: DEFERRED}
        open_batch(store, "b1", 2)
        members, gates = batch_members(store, r, "b1", 2, 1)
        claim_and_gate(store, "beat-a", gates)
        hold(store, "beat-a", [(members[0], batch_key("b1"))])
        assert store.cancel_batch("b1") == 1
        assert store.release(members[0], batch_key("b1"), "failed", "b1") == ReleaseResult(True, 0, True)
        assert [s.batch_id for s in store.batch_states()] == ["b1"]
        message = wait_for(lambda: subscription.get_message(timeout=0.1), timeout=5)
        assert parse_batch_message(message["data"]) == (
            "b1",
            {"total": 2, "succeeded": 0, "failed": 1, "cancelled": 1},
        )
        assert store.batch_state("b1").expires_ms is not None  # type: ignore[union-attr]
        assert store.sweep_batches() == 0 and store.delete_batch("b1") == "deleted"
        assert store.batch_states() == []
        assert admin.acl_log() == []
    finally:
        subscription.close()
        r.close()
        store.close()


def test_a_slot_expiry_earlier_than_the_marker_lowers_it(store: Store, r: redis.Redis) -> None:
    """hold.lua and slot_renew.lua move a job's score earlier (a start or slot TTL shorter than
    the time in the marker): the marker follows, so the safety poll claims the shard by then
    if the worker dies."""
    [job] = ids_of("k", 1)
    put(store, r, [job])
    claim_and_gate(store, "beat-a", {job: Gate("k", 1)})
    wake = store.keys.for_job(job).wake
    lease_end = read_marker(r.get(wake))
    assert lease_end is not None and lease_end >= server_ms(r) + 20_000  # the lease (30 s)
    assert hold(store, "beat-a", [(job, "k")], slot_ms=5_000) == {job: True}
    marker = read_marker(r.get(wake))
    assert marker is not None and marker == r.zscore(store.keys.for_job(job).due, job) < lease_end
    # A long start TTL, then the worker's shorter slot TTL.
    r.zadd(store.keys.for_job(job).due, {job: server_ms(r) + 3_600_000})
    r.set(wake, str(server_ms(r) + 3_600_000))
    assert store.renew_slots([(job, "k")], 5_000) == {job: True}
    marker = read_marker(r.get(wake))
    assert marker is not None and marker == r.zscore(store.keys.for_job(job).due, job) <= server_ms(r) + 5_000
    # A later expiry never raises the marker; a missing marker is left for the poll.
    assert store.renew_slots([(job, "k")], 60_000) == {job: True}
    assert read_marker(r.get(wake)) == marker
    r.delete(wake)
    assert store.renew_slots([(job, "k")], 1_000) == {job: True}
    assert r.get(wake) is None
