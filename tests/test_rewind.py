"""A store restored from an older snapshot (issue 24, item 3), against a real Redis.

The store is db 0 of the session server, the broker db 1, Celery's result backend db 2. A
rewind of the store alone is made the way a restore makes it: every key of db 0 is DUMPed at
one moment, and later db 0 is emptied and every key RESTOREd with its remaining TTL, while
the broker and the result backend go on. The worker is played by this process, doing what
a Celery worker and :mod:`celery_delayq.flow.slots` do when a task ends: it pops the message from
the broker, records the task's result in the backend (Celery's ``store_result``) and gives
the slot back (``Store.release``). The beat is a real :class:`Dispatcher`.

What is checked (see docs/guarantees.md, "Redis restored from an older snapshot"):

- a slot held by a job whose message was taken and whose task ended after the snapshot is
  given back at the beat's next look at it (one ``delayq_slot_ttl`` after the release), not
  after ``delayq_start_ttl``, and the job does not run again;
- a batch whose every member runs again after the rewind does not fire ``on_complete`` a
  second time;
- without a result backend nothing outside the store knows what ran: the held job waits for
  its start TTL, as documented.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayQ, Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.flow.gate import GATE_HEADER, Gate, batch_key, batch_of, completion_id, member_id
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.keys import is_point_id, point_id
from tests.support.apps import AppFactory
from tests.support.store import broker_lists, server_ms

Dispatchers = Callable[..., Dispatcher]
Snapshot = list[tuple[bytes, int, bytes]]

SLOT_TTL = 0.5  # the shortest delayq_slot_ttl: a held job's check comes after it


@pytest.fixture
def urls(redis_url: str) -> Iterator[tuple[str, str, str]]:
    base = redis_url.rsplit("/", 1)[0]
    yield base + "/0", base + "/1", base + "/2"


#: ``rewind_app(backend=True)``: an app of the ``app_factory`` on :func:`urls`.
RewindApp = Callable[..., Celery]


@pytest.fixture
def rewind_app(urls: tuple[str, str, str], app_factory: AppFactory) -> RewindApp:
    """``rewind_app(backend=True)``: the tests' app (``t.add``) with the store, the broker and
    (``backend``) the result backend on :func:`urls`, and ``t.done``, a batch's completion task."""
    store, broker, results = urls

    def make(*, backend: bool = True) -> Celery:
        # max_sleep: the safety poll, which finds a held job's check time, every quarter second
        conf: dict[str, Any] = {"delayq_slot_ttl": SLOT_TTL, "delayq_max_sleep": 0.25}
        if backend:
            conf["result_backend"] = results
        app = app_factory(broker, delayq_url=store, task_queues=None, **conf)

        @app.task(name="t.done", shared=False)
        def done(batch_id: str, counts: Any) -> str:
            return batch_id

        return app

    return make


def gate_check(store: Store, key: str) -> str:
    """The gate:check hash of ``key``'s shard (``lua/hold.lua``)."""
    return store.keys.shard(store.keys.shard_of(key)).running(key).replace("gate:run:" + key, "gate:check")


def take_snapshot(client: redis.Redis) -> Snapshot:
    """Every key of the store's database with its remaining TTL and its DUMP, at one moment."""
    out = []
    for key in client.keys("*"):
        dumped = client.dump(key)
        assert dumped is not None
        out.append((key, int(client.pttl(key)), dumped))
    return out


def restore(client: redis.Redis, snapshot: Snapshot) -> None:
    """The store's database as it was at ``snapshot``: what a restore of that snapshot does."""
    client.flushdb()
    for key, ttl, dumped in snapshot:
        client.restore(key, max(ttl, 0), dumped)


class Worker:
    """What a worker does with the messages in the broker: run each task (here: record its
    result in the backend as Celery does) and give its slot back as :mod:`.slots` does."""

    def __init__(self, app: Celery, broker: redis.Redis) -> None:
        self.app = app
        self.broker = broker
        self.store: Store = get_store(app)
        self.runs: list[str] = []

    def run_all(self) -> list[str]:
        ran = []
        for message in broker_lists(self.broker).get("celery", []):
            headers = message["headers"]
            job_id = headers["id"]
            self.app.backend.store_result(job_id, None, "SUCCESS")
            gate = Gate.from_header(headers.get(GATE_HEADER))
            if gate is not None:
                self.store.release(job_id, gate.key, "succeeded", gate.batch or batch_of(job_id))
            ran.append(job_id)
        self.broker.delete("celery")
        self.runs.extend(ran)
        return ran


def drain(dispatcher: Dispatcher, worker: Worker, passes: int = 12) -> None:
    """Beat passes and worker runs in turn, until a pass publishes nothing (between two, the
    beat waits for the wake message of what a release made due)."""
    for _ in range(passes):
        dispatcher.run_once()
        if not worker.run_all():
            return
        dispatcher.wait(1.0)
    raise AssertionError(f"still publishing after {passes} passes")


def check_pass(dispatcher: Dispatcher) -> None:
    """A pass once a held job's check is due (one slot TTL) and the safety poll has found it."""
    time.sleep(SLOT_TTL + 0.3)
    dispatcher.run_once()


@pytest.mark.slow
def test_a_held_slot_whose_task_ran_after_the_snapshot_is_given_back_at_the_next_gate(
    urls: tuple[str, str, str], rewind_app: RewindApp, dispatchers: Dispatchers
) -> None:
    app = rewind_app()
    store_db, broker = redis.Redis.from_url(urls[0]), redis.Redis.from_url(urls[1], decode_responses=True)
    batch = DelayQ(app).batch([app.tasks["t.add"].s(i, i) for i in range(3)], concurrency_limit=1)
    beat, worker = dispatchers(app), Worker(app, broker)
    first, second = member_id(batch.id, 0), member_id(batch.id, 1)
    beat.run_once()  # member 0 released, its message in the broker: not started yet
    assert batch.progress()["running"] == 1
    snapshot = take_snapshot(store_db)

    assert worker.run_all() == [first]  # it runs and gives its slot back
    restore(store_db, snapshot)  # the store forgets it: member 0 holds the key's one slot again
    store = get_store(app)
    assert store.key_state(batch_key(batch.id)).running == 1
    assert batch.progress() == {
        "total": 3,
        "waiting": 2,
        "running": 1,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }

    # A held job is looked at every slot TTL (its start TTL, delayq_start_ttl, is an hour).
    check_pass(beat)  # the check: the backend says member 0 ended; its slot is given back
    assert beat.stats.gated["finished"] == 1
    assert store.get(first) is None and batch.progress()["succeeded"] == 1
    beat.wait(1.0)
    beat.run_once()  # member 1, promoted into the free slot, is released
    assert [m["headers"]["id"] for m in broker_lists(broker).get("celery", [])] == [second]
    drain(beat, worker)
    assert worker.runs.count(first) == 1  # member 0 never ran again
    assert batch.progress()["succeeded"] == 3


@pytest.mark.slow
def test_a_held_job_not_started_yet_is_held_again_by_the_check_not_published(
    urls: tuple[str, str, str], rewind_app: RewindApp, dispatchers: Dispatchers
) -> None:
    """The check of a held job whose message still waits (no result): not published again,
    its slot kept with its start TTL, and checked again one slot TTL later."""
    app = rewind_app()
    broker = redis.Redis.from_url(urls[1], decode_responses=True)
    job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 1), concurrency_key="k", concurrency_limit=1)
    beat = dispatchers(app)
    beat.run_once()
    store = get_store(app)
    keys = store.keys.for_job(job.id)
    slot = store.client.zscore(store.keys.shard(store.keys.shard_of("k")).running("k"), job.id)
    for _ in range(2):
        check_pass(beat)
    assert beat.stats.gated["held"] == 2 and beat.stats.gated.get("finished", 0) == 0
    assert len(broker_lists(broker)["celery"]) == 1  # published once
    assert store.client.zscore(store.keys.shard(store.keys.shard_of("k")).running("k"), job.id) == slot
    assert str(store.client.hget(keys.leases, job.id)).endswith("|run")
    assert store.client.hget(gate_check(store, "k"), job.id) is not None  # the next check is booked


@pytest.mark.slow
def test_on_complete_fires_once_when_a_rewind_runs_the_whole_batch_again(
    urls: tuple[str, str, str], rewind_app: RewindApp, dispatchers: Dispatchers
) -> None:
    app = rewind_app()
    store_db, broker = redis.Redis.from_url(urls[0]), redis.Redis.from_url(urls[1], decode_responses=True)
    snapshot = take_snapshot(store_db)  # before the batch: restored, it is stored anew below
    batch = DelayQ(app).batch(
        [app.tasks["t.add"].s(i, i) for i in range(4)],
        concurrency_limit=2,
        on_complete=app.tasks["t.done"].s(),
        batch_id="b1",
    )
    snapshot = take_snapshot(store_db)  # the batch stored, nothing released yet
    beat, worker = dispatchers(app), Worker(app, broker)
    drain(beat, worker)
    assert worker.runs.count(completion_id(batch.id)) == 1 and batch.done

    restore(store_db, snapshot)  # every member waits again: they all run again
    assert not batch.done
    time.sleep(0.3)  # the beat finds the restored jobs at its next safety poll
    drain(beat, worker)
    members = [member_id(batch.id, i) for i in range(4)]
    assert sorted(worker.runs) == sorted([*members, *members, completion_id(batch.id)])
    assert batch.done and batch.progress()["succeeded"] == 4
    assert get_store(app).get(completion_id(batch.id)) is None  # acked, not published
    assert beat.stats.gated["finished"] == 1 and beat.stats.completions == 1


def test_without_a_result_backend_a_held_job_waits_for_its_start_ttl(
    rewind_app: RewindApp, dispatchers: Dispatchers
) -> None:
    """Nothing outside the store knows what ran: no check is booked, the job is due again
    only when its start TTL is over (docs/guarantees.md)."""
    app = rewind_app(backend=False)
    job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 1), concurrency_key="k", concurrency_limit=1)
    beat = dispatchers(app)
    assert beat.gating.ran.backend is None
    beat.run_once()
    store = get_store(app)
    keys = store.keys.for_job(job.id)
    slot = store.client.zscore(store.keys.shard(store.keys.shard_of("k")).running("k"), job.id)
    assert store.client.zscore(keys.due, job.id) == slot  # due when the start TTL is over
    assert store.client.hget(gate_check(store, "k"), job.id) is None


def test_a_result_older_than_the_jobs_due_time_is_not_taken_for_its_run(rewind_app: RewindApp) -> None:
    """An id used again: the result of the earlier job does not release the new one."""
    from celery_delayq.beat.results import Ran

    app = rewind_app()
    ran = Ran(app)
    app.backend.store_result("{k}x", 3, "SUCCESS")
    now_ms = time.time() * 1000
    assert ran.finished("{k}x", now_ms - 60_000) == "succeeded"
    assert ran.finished("{k}x", now_ms + 60_000) is None
    assert ran.finished("{k}never", 0) is None
    app.backend.store_result("{k}y", ValueError("no"), "FAILURE")
    assert ran.finished("{k}y", 0) == "failed"
    app.backend.store_result("{k}z", None, "STARTED")
    assert ran.finished("{k}z", 0) is None and ran.seen("{k}z", 0)
    app.backend.store_result("{k}r", None, "RETRY")
    assert ran.finished("{k}r", 0) is None and not ran.seen("{k}r", 0)
    assert Ran(rewind_app(backend=False)).finished("{k}x", 0) is None


def test_a_held_slot_whose_job_is_gone_and_whose_task_ran_is_given_back_at_the_next_gate(
    urls: tuple[str, str, str], rewind_app: RewindApp, dispatchers: Dispatchers
) -> None:
    """A job cancelled while its message waited keeps its slot until its worker gives it back;
    restored from a snapshot taken then, after the worker did, the slot is back with no job.
    The next job of the key that the gate parks brings it to light: the result backend says
    its task ended, and it is given back then, not after its start TTL."""
    app = rewind_app()
    store_db = redis.Redis.from_url(urls[0])
    broker = redis.Redis.from_url(urls[1], decode_responses=True)
    add = app.tasks["t.add"]
    first = add.apply_at(time.time() - 1, (1, 1), concurrency_key="k", concurrency_limit=1)
    beat, worker = dispatchers(app), Worker(app, broker)
    beat.run_once()  # released, its message waits for a worker
    first.cancel()  # gone from the store; its slot stays (its message may still run)
    assert get_store(app).get(first.id) is None
    snapshot = take_snapshot(store_db)
    assert worker.run_all() == [first.id]  # it runs all the same and gives the slot back
    restore(store_db, snapshot)
    store = get_store(app)
    assert store.get(first.id) is None and store.key_state("k").running == 1

    second = add.apply_at(time.time() - 1, (2, 2), concurrency_key="k", concurrency_limit=1)
    beat.wait(1.0)
    beat.run_once()  # the gate parks it; the slot of the gone job is given back, it is promoted
    assert beat.stats.gated["parked"] == 1 and beat.stats.gated["finished"] == 1
    beat.wait(1.0)
    beat.run_once()
    assert worker.run_all() == [second.id]
    assert worker.runs.count(first.id) == 1


def _points_published(broker: redis.Redis, name: str) -> list[str]:
    """The ids of schedule ``name``'s points in the broker, oldest first; the broker emptied."""
    ids = [m["headers"]["id"] for m in broker_lists(broker).get("celery", [])]
    broker.delete("celery")
    return sorted(i for i in ids if is_point_id(i) and i.startswith("{" + name + "}@"))


def _point_ms(job_id: str) -> int:
    return round(datetime.fromisoformat(job_id.split("@", 1)[1].replace("Z", "+00:00")).timestamp() * 1000)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("grace", "missed", "replays"),
    [(60.0, "once", "every point"), (0.5, "once", "the oldest"), (0.5, "skip", "none")],
)
def test_a_rewind_replays_every_schedule_point_within_grace(
    rewind_app: RewindApp, urls: tuple[str, str, str], dispatchers: Dispatchers, grace: float,
    missed: str, replays: str,
) -> None:  # fmt: skip
    """docs/guarantees.md, "schedules and their points": the restored store holds the point that
    was waiting in the snapshot, at its old time. Rewound by ``grace`` or less, it and every
    point after it up to the restore run again, one after the other, under the same ids (here a
    0.2 s schedule rewound by 2 s: 10 or 11 points); rewound by more, the missed-run policy
    decides: ``once``, the oldest point, once; ``skip``, none."""
    app = rewind_app(backend=False)
    client, broker = redis.Redis.from_url(urls[0]), redis.Redis.from_url(urls[1], decode_responses=True)
    Schedules(app).add("tick", "t.add", 0.2, (1,), grace=grace, missed=missed)
    beat = dispatchers(app)
    snapshot = take_snapshot(client)  # the first point waiting
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        beat.run_once()
        beat.wait(0.05)
    fired = _points_published(broker, "tick")
    assert len(fired) >= 5, fired
    restore(client, snapshot)
    rewound_ms = server_ms(client)
    # every point of the rule from the snapshot's waiting one to the restore (the last one or
    # two may have come due after the beat's last pass)
    points = [point_id("tick", ms) for ms in range(_point_ms(fired[0]), rewound_ms + 1, 200)]
    assert points[: len(fired)] == fired
    again: list[str] = []
    for _ in range(200):  # until a point after the rewind runs: the schedule caught up
        beat.run_once()
        published = _points_published(broker, "tick")
        replayed = [i for i in published if _point_ms(i) <= rewound_ms]
        again += replayed
        if len(replayed) < len(published):
            break
        beat.wait(0.05)
    else:
        raise AssertionError(f"the schedule did not catch up: {again}")
    expected = {"every point": points, "the oldest": points[:1], "none": []}[replays]
    assert again == expected, (again, expected)
