"""The gate in the claim (``lua/includes/gating.lua``, issue 26): ``claim.lua`` and ``push.lua``
give a due capped job of a key with a free slot its slot, and park one of a full key, without
the beat's ``gate.lua``; what they cannot read or decide goes to the beat's gate as before.
And the worker's slot calls queued off the task's path (``SlotKeeper.start_soon`` /
``finish_soon`` / ``send``). Real Redis (each supported server kind), jobs stored as the
producer API stores them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.flow.gate import GATE_HEADER, PARK_MS, Gate, gated_id, parse_rate
from celery_delayq.flow.slots import SlotKeeper
from celery_delayq.store.delivery import ClaimResult
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.jobs import CancelOutcome
from tests.support.server_kinds import redis_server

__all__ = ["redis_server"]  # a fixture, used by name: the gate in the claim is Lua, on every kind

AppFactory = Callable[..., Celery]
Dispatchers = Callable[..., Dispatcher]


def store_gated(
    app: Celery, gate: Gate, n: int, *, due: float | None = None, headers: dict[str, Any] | None = None
) -> list[str]:
    """``n`` jobs of ``t.add`` gated by ``gate`` (its header, or ``headers``), due ``due``
    (default: a second ago), as tests/test_flow_dispatch.py stores them."""
    add = app.tasks["t.add"]
    extra = headers if headers is not None else {GATE_HEADER: gate.header()}
    return [
        add.apply_at(due or time.time() - 1, (i, i), task_id=gated_id(gate.key, None), headers=extra).id
        for i in range(n)
    ]


def put(app: Celery, gate: Gate, n: int) -> list[str]:
    """``n`` jobs of ``gate`` due 10 ms apart, in order, the last a second ago."""
    base = time.time() - 1 - n / 100
    return [job for i in range(n) for job in store_gated(app, gate, 1, due=base + i / 100)]


def claim(store: Store, key: str, gating: bool | None = True, token: str = "beat-a") -> ClaimResult:
    [result] = store.claim([store.keys.shard_of(key)], token, gating=gating)
    return result


def run_ids(store: Store, key: str) -> list[str]:
    return sorted(store.client.zrange(store.keys.for_key(key).running(key), 0, -1))


def wait_ids(store: Store, key: str) -> list[str]:
    return list(store.client.zrange(store.keys.for_key(key).waiting(key), 0, -1))


def lease(store: Store, job_id: str) -> str | None:
    raw = store.client.hget(store.keys.for_job(job_id).leases, job_id)
    return None if raw is None else str(raw)


def test_the_claim_gives_free_slots_and_parks_the_rest(app: Celery, r: redis.Redis) -> None:
    """Limit 2, three jobs due: the claim returns two with their key (each given a slot, leased
    to the beat as any claimed job) and parks the third as gate.lua parks (PARK_MS, lease
    "<due>|0|gate", in the key's waiting list); the key is recorded with the jobs' limit."""
    store = get_store(app)
    ids = put(app, Gate("c1", limit=2), 3)
    result = claim(store, "c1")
    assert [(job.id, job.gate_key, job.tries) for job in result.jobs] == [(i, "c1", 1) for i in ids[:2]]
    assert result.parked == 1
    assert run_ids(store, "c1") == sorted(ids[:2])
    assert all(str(lease(store, i)).endswith("|1|beat-a") for i in ids[:2])
    parked = ids[2]
    assert r.zscore(store.keys.for_job(parked).due, parked) == PARK_MS
    record = store.get(parked)
    assert record is not None and record.state == "gated" and record.tries == 0
    assert lease(store, parked) == f"{record.due_ms}|0|gate"
    assert wait_ids(store, "c1") == [parked]
    assert r.hget(store.keys.for_key("c1").gate_keys, "c1") == "2"
    # nothing else is due: the parked job is not claimed by time
    assert claim(store, "c1", token="beat-b").jobs == []


def test_a_release_promotes_the_parked_job_and_the_next_claim_gives_it_the_slot(
    app: Celery, r: redis.Redis
) -> None:
    store = get_store(app)
    ids = put(app, Gate("c2", limit=1, priority=3), 2)
    first = claim(store, "c2")
    assert [job.id for job in first.jobs] == ids[:1] and first.parked == 1
    assert all(store.hold("beat-a", {store.keys.shard_of("c2"): [(ids[0], "c2")]}, 3_600_000).values())
    released = store.release(ids[0], "c2", "succeeded")
    assert released.released and released.promoted == 1
    second = claim(store, "c2")
    assert [(job.id, job.gate_key, job.tries) for job in second.jobs] == [(ids[1], "c2", 1)]
    assert run_ids(store, "c2") == [ids[1]] and wait_ids(store, "c2") == []


@pytest.mark.parametrize("cancel", ["one", "many"])
def test_a_promoted_job_cancelled_before_its_claim_passes_its_turn_on(
    app: Celery, r: redis.Redis, cancel: str
) -> None:
    """Limit 1, three jobs: the first runs, two are parked; its release promotes the second, which
    is cancelled before a claim gives it the slot. The cancel promotes the key again (the third
    job is due now), so the next claim gives the third the slot: no parked job waits for a
    release that will never come. Cancelling a job still parked promotes nothing."""
    store = get_store(app)
    key = "c-stall" + cancel
    ids = put(app, Gate(key, limit=1), 3)
    first = claim(store, key)
    assert [job.id for job in first.jobs] == ids[:1] and first.parked == 2
    assert all(store.hold("beat-a", {store.keys.shard_of(key): [(ids[0], key)]}, 3_600_000).values())
    assert store.release(ids[0], key, "succeeded").promoted == 1
    due = store.keys.for_job(ids[1]).due
    assert r.zscore(due, ids[1]) != PARK_MS and r.zscore(due, ids[2]) == PARK_MS
    if cancel == "one":
        outcome = store.cancel(ids[1])
    else:
        [outcome] = store.cancel_many(store.keys.shard_of(key), [ids[1]])
    assert outcome == CancelOutcome.CANCELLED  # it waited: never "delivering"
    assert r.zscore(due, ids[2]) != PARK_MS and wait_ids(store, key) == []
    third = claim(store, key)
    assert [(job.id, job.gate_key) for job in third.jobs] == [(ids[2], key)]
    assert run_ids(store, key) == [ids[2]]


def test_cancelling_a_parked_job_promotes_nothing(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    ids = put(app, Gate("c-parked", limit=1), 3)
    assert claim(store, "c-parked").parked == 2
    assert store.cancel(ids[1]) == CancelOutcome.CANCELLED
    due = store.keys.for_job(ids[2]).due
    # (the cancelled id stays in the list until a promotion drops it: it is no longer parked)
    assert r.zscore(due, ids[2]) == PARK_MS and wait_ids(store, "c-parked") == ids[1:]
    assert claim(store, "c-parked").jobs == []


def test_a_paused_key_s_jobs_are_parked_and_a_runtime_limit_wins(app: Celery) -> None:
    store = get_store(app)
    store.pause("c3")
    paused = put(app, Gate("c3", limit=5), 2)
    assert claim(store, "c3").parked == 2 and run_ids(store, "c3") == []
    store.set_limit("c4", 1)
    capped = put(app, Gate("c4", limit=5), 2)
    result = claim(store, "c4")
    assert [job.id for job in result.jobs] == capped[:1] and result.parked == 1
    assert wait_ids(store, "c3") == paused


def test_without_parking_a_full_key_s_job_goes_to_the_beat_s_gate(app: Celery) -> None:
    """``gating=False`` (a beat with a result backend): the claim still gives free slots, and
    hands the job of a full key to the beat ungated (its gate parks it, with its suspects)."""
    store = get_store(app)
    ids = put(app, Gate("c5", limit=1), 2)
    result = claim(store, "c5", gating=False)
    assert [(job.id, job.gate_key) for job in result.jobs] == [(ids[0], "c5"), (ids[1], None)]
    assert result.parked == 0 and run_ids(store, "c5") == [ids[0]]
    decisions = store.gate("beat-a", {store.keys.shard_of("c5"): [(ids[1], Gate("c5", 1))]}, 60_000)
    assert decisions[ids[1]].decision.value == "parked"


@pytest.mark.parametrize(
    "gate, headers, why",
    [
        (Gate("c6", limit=1, rate=parse_rate("10/s")), None, "a rate: the gate books its turn"),
        (Gate("c6", limit=1), {GATE_HEADER: "not a gate"}, "a header that does not read"),
        (Gate("c6", limit=1), {GATE_HEADER: {"key": "c6", "limit": 0}}, "a limit gate.py refuses"),
    ],
)
def test_what_the_claim_cannot_decide_goes_to_the_beat_s_gate_untouched(
    app: Celery, gate: Gate, headers: dict[str, Any] | None, why: str
) -> None:
    store = get_store(app)
    ids = store_gated(app, gate, 2, headers=headers)
    result = claim(store, "c6")
    assert [(job.id, job.gate_key) for job in result.jobs] == [(i, None) for i in ids], why
    assert result.parked == 0 and run_ids(store, "c6") == [] and wait_ids(store, "c6") == []


def test_a_header_whose_key_the_id_does_not_carry_goes_to_the_beat_s_gate(
    app: Celery, r: redis.Redis
) -> None:
    """A stored envelope changed by hand (the producer refuses such a job): its header's key is
    not its id's tag, so the claim does not gate it."""
    store = get_store(app)
    [job_id] = store_gated(app, Gate("c11", limit=1), 1)
    jobs = store.keys.for_job(job_id).jobs
    text = str(r.hget(jobs, job_id))
    assert '"key":"c11"' in text
    r.hset(jobs, job_id, text.replace('"key":"c11"', '"key":"c12"'))
    result = claim(store, "c11")
    assert [(job.id, job.gate_key) for job in result.jobs] == [(job_id, None)]
    assert run_ids(store, "c11") == [] and run_ids(store, "c12") == []


def test_a_job_claimed_before_goes_to_the_beat_s_gate(app: Celery, r: redis.Redis) -> None:
    """A redelivery (its lease expired: tries 1 before this claim) is the gate's to decide: it
    may hold a slot, or have run already (the result backend is asked)."""
    store = get_store(app)
    [job_id] = store_gated(app, Gate("c7", limit=1), 1)
    shard = store.keys.shard_of("c7")
    store.claim([shard], "beat-a")  # claimed without gating, then its lease expires
    r.zadd(store.keys.for_job(job_id).due, {job_id: 1})
    result = claim(store, "c7", token="beat-b")
    assert [(job.id, job.gate_key, job.tries) for job in result.jobs] == [(job_id, None, 2)]
    assert run_ids(store, "c7") == []


def test_bad_gating_arguments_are_refused_before_any_write(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    store_gated(app, Gate("c8", limit=1), 1)
    keys = store.keys.shard(store.keys.shard_of("c8")).core
    from celery_delayq.store.scripts import SCRIPTS

    before = r.zrange(store.keys.for_key("c8").due, 0, -1, withscores=True)
    with pytest.raises(redis.ResponseError, match="gating arguments"):
        SCRIPTS["claim"](r, keys, ["beat-a", 10, 1000, 60_000, "maybe", "ch", 0, GATE_HEADER, "x"])
    assert r.zrange(store.keys.for_key("c8").due, 0, -1, withscores=True) == before


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_a_beat_pass_gates_in_the_claim_and_asks_no_gate(
    app_factory: AppFactory, dispatchers: Dispatchers, push: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass over 3 jobs of limit 2: two published and held, one parked, and the beat's gate
    (Store.gate, lua/gate.lua) never asked."""
    app = app_factory(delayq_push=push)
    store = get_store(app)
    ids = store_gated(app, Gate("c9", limit=2), 3)
    beat = dispatchers(app)
    asked: list[Any] = []
    monkeypatch.setattr(beat.publishing.store, "gate", lambda *a, **k: asked.append(a) or {})
    beat.run_once()
    assert asked == []
    assert beat.stats.gated["released"] == 2 and beat.stats.gated["parked"] == 1
    assert beat.stats.claimed == 3 and beat.stats.held == 2
    states = [None if (j := store.get(i)) is None else j.state for i in ids]
    assert sorted(states) == ["gated", "running", "running"]  # (due in the same ms: any two)


def test_the_worker_s_take_over_and_release_are_sent_by_its_thread(app: Celery) -> None:
    """``start_soon``/``finish_soon`` queue the calls; ``send`` sends them in one round trip, a
    take-over whose release is queued too left out; the slot is then back and the job gone."""
    store = get_store(app)
    gate = Gate("c10", limit=1)
    job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), task_id=gated_id("c10", None),
                                      headers={GATE_HEADER: gate.header()}).id  # fmt: skip
    [result] = store.claim([store.keys.shard_of("c10")], "beat-a", gating=True)
    assert [j.gate_key for j in result.jobs] == ["c10"]
    assert all(store.hold("beat-a", {result.shard: [(job, "c10")]}, 3_600_000).values())
    keeper = SlotKeeper(app)
    try:
        keeper._stop.set()  # no thread: this test sends
        keeper._pid = __import__("os").getpid()
        assert keeper.start_soon(job, gate.header())
        assert keeper._outbox == [("take", job, "c10")]
        assert keeper.send() == 1
        taken = store.get(job)
        assert taken is not None and taken.state == "running"
        assert taken.lease_until_ms is not None and taken.lease_until_ms < time.time() * 1000 + 3_000_000
        assert keeper.start_soon(job, gate.header()) and keeper.finish_soon(job, gate.header(), "succeeded")
        assert keeper.send() == 1  # the release alone
        assert store.get(job) is None and store.key_state("c10").running == 0
        assert not keeper.finish_soon("{c10}x", {"key": "bad{"}, "failed")
        assert keeper.send() == 0
    finally:
        keeper.stop()
