"""Flow control in the worker (:mod:`celery_delayq.flow.slots`): a real ``celery worker`` and
``celery beat`` of ``tests/apps/e2e_app.py``, the gated jobs stored by a producer here.

What the worker's receivers see (found with celery 5.7, solo and prefork pools, and
written down in slots.py's docstring): the ``delayq_gate`` header is on ``task.request``
in ``task_prerun`` and ``task_postrun``, in the process that runs the task; a revoked or
expired message never reaches prerun and gives ``task_revoked`` (in the main process) its
request context, which carries the header too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.devtools.embedded import free_port
from celery_delayq.flow import slots
from celery_delayq.flow.gate import GATE_HEADER, Gate, batch_key, completion_id, gated_id, member_id
from celery_delayq.flow.slots import SlotKeeper
from celery_delayq.store.facade import Store, get_store
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.stack import STARTUP, log_of, runs

SLOT_TTL = 2.0  # seconds: renewed every 0.67 s
LONG = 6.0  # a task that outlives its slot's TTL three times over


def producer(redis_url: str) -> Celery:
    app = make_app(redis_url, redis_url, task_ignore_result=True, delayq_slot_ttl=SLOT_TTL)

    def body(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    for name in ("e2e.record", "e2e.record_late", "e2e.flaky"):
        app.task(base=DelayedTask, bind=True, name=name, shared=False)(body)
    return app


def apply_gated(app: Celery, name: str, gate: Gate, job_id: str | None = None, **kwargs: Any) -> str:
    task = app.tasks[name]
    job_id = job_id or gated_id(gate.key, None)
    return str(
        task.apply_at(time.time(), kwargs=kwargs, task_id=job_id, headers={GATE_HEADER: gate.header()}).id
    )


def start(procs: Procs, redis_url: str, pool: str) -> None:
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps({"delayq_slot_ttl": SLOT_TTL}))
    procs.start("worker", env, pool=pool)
    procs.start("beat", env)
    ready = wait_for(lambda: "ready." in log_of(procs, 0) and "delayq: beat" in log_of(procs, 1), STARTUP)
    assert ready, procs.logs()


def gone(store: Store, ids: list[str]) -> bool:
    return all(store.get(i) is None for i in ids)


@pytest.mark.e2e
@pytest.mark.parametrize("pool", ["solo", "prefork -c 2"], ids=["solo", "prefork"])
def test_the_worker_gives_slots_back_on_success_failure_and_retry_and_renews_a_long_one(
    procs: Procs, redis_url: str, r: redis.Redis, pool: str
) -> None:
    app = producer(redis_url)
    store = get_store(app)
    start(procs, redis_url, pool)
    bid = "wb"
    assert store.open_batch(bid, 3, None, {})
    member = Gate(batch_key(bid), batch=bid)
    ok = apply_gated(app, "e2e.record", member, member_id(bid, 0))
    failing = apply_gated(app, "e2e.record_late", member, member_id(bid, 1), hold="not a number")
    long = apply_gated(app, "e2e.record_late", member, member_id(bid, 2), hold=LONG)
    retried = apply_gated(app, "e2e.flaky", Gate("w", limit=3), fail_times=1, countdown=0.5)

    assert wait_for(lambda: long in runs(r), STARTUP, 0.1), procs.logs()
    started = time.monotonic()
    time.sleep(SLOT_TTL * 1.5)  # past the TTL its beat gave the slot: only renewals keep it
    job = store.get(long)
    assert job is not None and job.state == "running", (job, procs.logs())
    assert store.key_state(batch_key(bid)).running >= 1

    done = lambda: (state := store.batch_state(bid)) is not None and state.done  # noqa: E731
    assert wait_for(done, LONG + 30, 0.1), (store.batch_state(bid), procs.logs())
    assert time.monotonic() - started >= LONG - SLOT_TTL * 1.5 - 0.5
    state = store.batch_state(bid)
    assert state is not None
    assert (state.succeeded, state.failed, state.cancelled, state.running) == (2, 1, 0, 0)
    assert wait_for(lambda: runs(r).get(retried) == 2, 30, 0.1), procs.logs()
    assert wait_for(lambda: gone(store, [ok, failing, long, retried]), 10, 0.1)
    assert (runs(r)[ok], runs(r)[failing], runs(r)[long]) == (1, 1, 1)  # never delivered again
    assert store.key_state("w").running == 0
    assert store.key_state(batch_key(bid)).running == 0


@pytest.mark.e2e
def test_a_killed_worker_s_slot_comes_back_after_the_ttl_and_its_job_runs_again(
    procs: Procs, redis_url: str, r: redis.Redis
) -> None:
    app = producer(redis_url)
    store = get_store(app)
    start(procs, redis_url, "solo")
    gate = Gate("k", limit=1)
    first = apply_gated(app, "e2e.record_late", gate, hold=3)
    assert wait_for(lambda: first in runs(r), STARTUP, 0.05), procs.logs()
    second = apply_gated(app, "e2e.record", gate)
    worker = procs.procs[0][0]
    worker.kill()  # SIGKILL: no postrun, no release, no more renewals
    worker.wait()
    killed = time.monotonic()
    # the slot lasts SLOT_TTL from the last renewal; then the beat delivers the job again
    # (into the broker: no worker runs now), on the same slot
    assert wait_for(
        lambda: first in [json.loads(m)["headers"]["id"] for m in r.lrange("celery", 0, -1)],
        SLOT_TTL + 15,
        0.05,
    ), procs.logs()
    assert time.monotonic() - killed > SLOT_TTL / 3
    state = store.key_state("k")
    assert (state.running, state.waiting) == (1, 1)
    job = store.get(first)
    assert job is not None and job.tries == 2

    procs.start(
        "worker",
        subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=json.dumps({"delayq_slot_ttl": SLOT_TTL})),
        pool="solo",
    )
    assert wait_for(lambda: runs(r).get(second) == 1, STARTUP, 0.1), procs.logs()
    assert runs(r)[first] == 2
    assert wait_for(lambda: gone(store, [first, second]), 10, 0.1)
    assert store.key_state("k").running == 0


def test_a_release_redis_refuses_is_logged_not_raised(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis unreachable when the task ends: the release is logged and given up; the slot
    comes back when it expires (tests/test_flow_dispatch.py shows the job delivered again)."""
    down = make_app(f"redis://127.0.0.1:{free_port()}/0", delayq_slot_ttl=SLOT_TTL)
    keeper = SlotKeeper(down)
    header = Gate("k", limit=1).header()
    assert keeper.started("{k}1", header)
    assert keeper.running == {"{k}1": ("k", None)}
    with caplog.at_level(logging.WARNING, logger="celery_delayq.flow.slots"):
        assert keeper.renew() == 0
        assert keeper.finished("{k}1", header, "succeeded") is False
    assert keeper.running == {}
    assert "cannot renew the slots of 1" in caplog.text
    assert "cannot give back the slot of {k}1" in caplog.text
    keeper.stop()
    get_store(down).close()


def test_a_slot_is_renewed_while_its_task_runs_and_given_back_once(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A terminated prefork task gets its child's postrun and the main process' task_revoked:
    the second release finds the slot gone and does nothing."""
    store = get_store(app)
    gate = Gate("k2", limit=1)
    job = (
        app.tasks["t.add"]
        .apply_at(time.time() - 1, (1, 2), task_id=gated_id("k2", None), headers={GATE_HEADER: gate.header()})
        .id
    )
    dispatchers(app).run_once()
    before = store.get(job)
    assert before is not None and before.state == "running"
    keeper = SlotKeeper(app)
    assert keeper.started(job, gate.header())
    # the start takes the slot over: the start TTL the beat gave becomes the slot TTL
    taken = store.get(job)
    assert taken is not None and taken.lease_until_ms is not None and before.lease_until_ms is not None
    assert taken.lease_until_ms < before.lease_until_ms
    assert not keeper.started("{k2}other", {"key": "bad{"})  # a header that does not read
    time.sleep(0.01)
    assert keeper.renew() == 1
    after = store.get(job)
    assert after is not None and after.lease_until_ms is not None
    assert after.lease_until_ms > taken.lease_until_ms
    assert keeper.finished(job, gate.header(), "failed") is True
    assert keeper.finished(job, gate.header(), "failed") is False
    assert store.get(job) is None and store.key_state("k2").running == 0
    assert keeper.renew() == 0  # nothing runs any more
    keeper.stop()


@pytest.mark.e2e
def test_a_revoked_or_expired_gated_task_gives_its_slot_back_as_failed(
    procs: Procs, redis_url: str, r: redis.Redis
) -> None:
    """Neither reaches task_prerun: the worker's main process gets task_revoked (with
    ``expired`` for the second), whose request carries the header."""
    app = producer(redis_url)
    store = get_store(app)
    start(procs, redis_url, "prefork -c 2")
    bid = "rb"
    assert store.open_batch(bid, 3, None, {})
    member = Gate(batch_key(bid), limit=1, batch=bid)  # one at a time: the others wait parked
    first = apply_gated(app, "e2e.record_late", member, member_id(bid, 0), hold=3)
    assert wait_for(lambda: first in runs(r), STARTUP, 0.05), procs.logs()
    task = app.tasks["e2e.record"]
    header = {GATE_HEADER: member.header()}
    expiring = task.apply_at(time.time(), task_id=member_id(bid, 1), headers=header, expires=1.0).id
    revoked = task.apply_at(time.time(), task_id=member_id(bid, 2), headers=header).id
    app.control.revoke(revoked)
    done = lambda: (state := store.batch_state(bid)) is not None and state.done  # noqa: E731
    assert wait_for(done, 60, 0.1), (store.batch_state(bid), procs.logs())
    state = store.batch_state(bid)
    assert state is not None and (state.succeeded, state.failed, state.running) == (1, 2, 0)
    assert expiring not in runs(r) and revoked not in runs(r)
    log = log_of(procs, 0)
    assert f"Discarding revoked task: e2e.record[{expiring}]" in log
    assert f"Discarding revoked task: e2e.record[{revoked}]" in log
    assert wait_for(lambda: gone(store, [first, expiring, revoked]), 10, 0.1)


@pytest.mark.e2e
def test_a_batch_through_the_producer_api_with_a_member_that_retries(
    procs: Procs, redis_url: str, r: redis.Redis
) -> None:
    """DelayQ.batch, capped at one member at a time; a member retrying itself goes back
    through delayq (its message carries the gate header) and is counted once, when it ends;
    the completion job runs after the last member."""
    app = producer(redis_url)
    start(procs, redis_url, "prefork -c 2")
    record, late, flaky = (app.tasks[n] for n in ("e2e.record", "e2e.record_late", "e2e.flaky"))
    batch = DelayQ(app).batch(
        [flaky.s(fail_times=1, countdown=0.5), record.s(), late.s(hold="not a number")],
        concurrency_limit=1,
        on_complete=record.si(),
    )
    progress = batch.join(timeout=60)
    assert progress == {
        "total": 3,
        "waiting": 0,
        "running": 0,
        "succeeded": 2,
        "failed": 1,
        "cancelled": 0,
    }, procs.logs()
    assert wait_for(lambda: completion_id(batch.id) in runs(r), 30, 0.1), procs.logs()
    members = [member_id(batch.id, i) for i in range(3)]
    assert [runs(r).get(i) for i in members] == [2, 1, 1]
    starts = sorted((s["start"], s["id"]) for s in map(json.loads, r.lrange("e2e:starts", 0, -1)))
    assert [i for _, i in starts][-1] == completion_id(batch.id)
    assert get_store(app).key_state(batch_key(batch.id)).running == 0


def test_a_retry_celery_sends_itself_keeps_the_slot_until_the_retried_run_ends(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A plain task's retry goes straight to the broker (outside the gate): its slot is kept
    and renewed, and the retried run's end gives it back and counts the batch member once. A
    DelayedTask's retry goes through delayq (gated again): its slot is given back at once."""

    @app.task(name="t.plain", shared=False)
    def plain() -> None:
        return None

    store = get_store(app)
    assert store.open_batch("rt", 2, None, {})
    gate = Gate(batch_key("rt"), batch="rt")
    header = {GATE_HEADER: gate.header()}
    ids = [member_id("rt", i) for i in range(2)]
    for job_id in ids:
        app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), task_id=job_id, headers=header)
    dispatchers(app).run_once()
    assert store.key_state(batch_key("rt")).running == 2

    def run(task: Any, job_id: str, *states: str) -> None:
        """What the worker's signals say of ``task`` running as ``job_id``, once per state."""
        for state in states:
            task.push_request(id=job_id, **header)
            try:
                slots._on_prerun(sender=task, task_id=job_id, task=task)
                slots._on_postrun(sender=task, task_id=job_id, task=task, state=state)
            finally:
                task.pop_request()
            keeper = slots.keeper_for(app)
            assert keeper is not None
            keeper.send()  # the signals queue their calls for the keeper's thread: all sent now

    try:
        run(plain, ids[0], "RETRY")
        keeper = slots.keeper_for(app)
        assert keeper is not None and ids[0] in keeper.running
        assert keeper.renew() == 1
        assert store.key_state(batch_key("rt")).running == 2  # still held over the retry
        run(app.tasks["t.add"], ids[1], "RETRY")  # a DelayedTask: given back as "retry"
        assert store.key_state(batch_key("rt")).running == 1
        run(plain, ids[0], "SUCCESS")  # the retried run
        state = store.batch_state("rt")
        assert state is not None and (state.succeeded, state.failed, state.running) == (1, 0, 0)
        assert ids[0] not in keeper.running and store.get(ids[0]) is None
    finally:
        keeper = slots.keeper_for(app)
        if keeper is not None:
            keeper.stop()


#: Loaded by every Python process whose PYTHONPATH starts with its folder: a beat run with
#: FLOW_STOP_BEFORE_HOLD stops itself (SIGSTOP) at its first hold, after it published.
STOP_BEFORE_HOLD = """
import json, os
if os.environ.get("FLOW_STOP_BEFORE_HOLD"):
    import signal
    import redis
    from celery_delayq.beat import dispatch
    _stopped = []
    def _stop_then_hold(step, holds):
        if step == "hold" and not _stopped:
            _stopped.append(True)
            ids = [job_id for pairs in holds.values() for job_id, _ in pairs]
            redis.Redis.from_url(os.environ["DELAYQ_TEST_STORE"]).set("e2e:stopped", json.dumps(ids))
            os.kill(os.getpid(), signal.SIGSTOP)
    dispatch.Dispatcher.pause = staticmethod(_stop_then_hold)
"""


@pytest.mark.e2e
def test_a_beat_stopped_between_gate_and_hold_past_its_lease(
    procs: Procs, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Beat A releases and publishes a capped job, then is SIGSTOPped before its hold, past
    its lease. The worker starts the task meanwhile and takes its slot over (lease "run",
    slot TTL): beat B, running all along, does not claim it again when A's lease would have
    expired, so it runs once (before the take-over, any job of a beat stalled between
    publish and ack ran twice). The key's count stays 1, the parked job stays parked; A,
    resumed, finds the task started at its hold and leaves it as it is."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(STOP_BEFORE_HOLD)
    conf = json.dumps({"delayq_reclaim_ttl": 2, "delayq_slot_ttl": 30, "delayq_max_sleep": 1})
    env = subprocess_env(redis_url, redis_url, DELAYQ_TEST_CONF=conf)
    procs.start("worker", env)
    beat_a = procs.start(
        "beat", {**env, "FLOW_STOP_BEFORE_HOLD": "1", "PYTHONPATH": f"{hooks}{os.pathsep}{env['PYTHONPATH']}"}
    )
    assert wait_for(lambda: "ready." in log_of(procs, 0) and "delayq: beat" in log_of(procs, 1), STARTUP)
    app = producer(redis_url)
    store = get_store(app)
    gate = Gate("s", limit=1)
    first = apply_gated(app, "e2e.record_late", gate, hold=6)
    second = apply_gated(app, "e2e.record", gate)
    try:
        assert wait_for(lambda: r.get("e2e:stopped"), STARTUP, 0.05), procs.logs()
        assert json.loads(r.get("e2e:stopped")) == [first]
        procs.start("beat", env)  # beat B
        counts = []
        deadline = time.monotonic() + 8  # A's lease (2 s) is long over
        while time.monotonic() < deadline:
            state = store.key_state("s")
            counts.append((state.running, state.waiting))
            time.sleep(0.05)
        assert all(running <= 1 for running, _ in counts), counts  # one slot, not two
        assert (1, 1) in counts
    finally:
        os.kill(beat_a.pid, signal.SIGCONT)
    assert wait_for(lambda: runs(r).get(second) == 1, 30, 0.1), procs.logs()
    assert wait_for(lambda: gone(store, [first, second]), 30, 0.1), procs.logs()
    assert runs(r).get(first) == 1, procs.logs()
    assert "no longer leased to this beat when held" not in log_of(procs, 1)
    assert store.key_state("s").running == 0
