"""A store restored from an older snapshot, end to end (issue 24, item 3): a real ``celery
beat`` and ``celery worker`` of ``tests/apps/flow_app.py``, the store on db 0 of the session's
Redis, the broker on db 1 and Celery's result backend on db 2.

The experiment of the issue, scaled down: a batch of 6 capped at 2 with an ``on_complete``;
the beat alone runs first, so 2 members are released and wait in the broker, not started;
the store's keys are DUMPed then (the snapshot). A worker starts, the batch runs and
completes. Then the store's keys are put back as they were in the snapshot (RESTORE), with
the beat and the worker still running. What the worker's results in the backend let the
beat do: the 2 held slots are given back (their tasks ended) and those 2 members do not run
again, the 4 others (waiting in the snapshot) run again, and ``on_complete`` does not run a
second time (docs/guarantees.md, "Redis restored from an older snapshot").
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import redis

from celery_delayq.flow.gate import batch_key, completion_id, member_id
from tests.support.flow import FLOW_APP, FlowProducer, read_done, read_runs
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import STARTUP, env_for, log_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

Snapshot = list[tuple[bytes, int, bytes]]


def dump_store(r: redis.Redis, prefix: str = "delayq:") -> Snapshot:
    out = []
    for key in r.keys(prefix + "*"):
        dumped = r.dump(key)
        if dumped is not None:
            out.append((key, int(r.pttl(key)), dumped))
    return out


def restore_store(r: redis.Redis, snapshot: Snapshot, prefix: str = "delayq:") -> None:
    """The store's keys as they were at ``snapshot`` (the test's own records, ``flow:*`` in the
    same database, are kept)."""
    with r.pipeline(transaction=True) as pipe:
        keys = r.keys(prefix + "*")
        if keys:
            pipe.delete(*keys)
        for key, ttl, dumped in snapshot:
            pipe.restore(key, max(ttl, 0), dumped, replace=True)
        pipe.execute()


def test_a_rewound_store_gives_held_slots_back_and_fires_on_complete_once(
    redis_url: str, procs: Procs
) -> None:
    base = redis_url.rsplit("/", 1)[0]
    store_url, broker_url, results_url = base + "/0", base + "/1", base + "/2"
    conf = {
        "task_ignore_result": False,
        "result_backend": results_url,
        "delayq_slot_ttl": 1.0,
        "delayq_max_sleep": 0.5,
    }
    r = redis.Redis.from_url(store_url)
    producer = FlowProducer(broker_url, store_url, result_backend=results_url)
    # The message carries the producer's ignore_result (Celery 5): FlowProducer's app ignores
    # results, so its tasks are made again here with results kept.
    for name in ("flow.work", "flow.done"):
        producer.app.tasks[name].ignore_result = False
    env = env_for(broker_url, store_url, conf)
    try:
        procs.start("beat", env, app=FLOW_APP)
        assert wait_for(lambda: "delayq: beat" in log_of(procs, 0), STARTUP, 0.1), procs.logs()
        members = [producer.work.s(0.2) for _ in range(6)]
        batch = producer.dq.batch(members, concurrency_limit=2, on_complete=producer.done.s())
        ids = [member_id(batch.id, i) for i in range(6)]
        held = lambda: producer.dq.key_state(batch_key(batch.id)).running == 2  # noqa: E731
        assert wait_for(held, 30, 0.05), procs.logs()
        snapshot = dump_store(r)  # 2 members released, in the broker, not started; 4 parked

        procs.start("worker", env, app=FLOW_APP, pool="threads -c 2")
        assert wait_for(lambda: len(read_done(r)) == 1, STARTUP + 30, 0.1), procs.logs()
        first = Counter(run.id for run in read_runs(r))
        assert first == Counter(ids), first

        restore_store(r, snapshot)  # the store forgets the whole batch ran
        assert producer.dq.key_state(batch_key(batch.id)).running == 2
        assert wait_for(lambda: batch.done, 60, 0.1), f"{batch.progress()}\n{procs.logs()}"
        time.sleep(3)  # a late rerun or a second on_complete would show up by now
        runs = Counter(run.id for run in read_runs(r))
        rerun = {job_id for job_id, n in runs.items() if n > 1}
        held_ids = {job_id for job_id in ids if runs[job_id] == 1}
        assert len(held_ids) == 2 and len(rerun) == 4 and max(runs.values()) == 2, runs
        assert [d["id"] for d in read_done(r)] == [completion_id(batch.id)], read_done(r)
        assert batch.progress()["succeeded"] == 6
        assert producer.dq.count() == 0
        assert "its slot is given back and it is not run again" in procs.logs()
        assert "is not published again" in procs.logs()
    finally:
        producer.close()
        r.close()
