"""Flow control in the beat, in-process: :class:`Dispatcher` passes against real Redis.

Gated jobs are stored the way the producer API stores them: a message carrying the
``delayq_gate`` header (``Gate.header()``) under an id with its key's tag (``gated_id``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.scheduler import serve_metrics
from celery_delayq.devtools.embedded import free_port
from celery_delayq.flow.gate import (
    GATE_HEADER,
    GATE_TOKEN,
    RUN_TOKEN,
    Gate,
    Rate,
    batch_key,
    gated_id,
    member_id,
)
from celery_delayq.store.facade import Store, get_store
from tests.support.clocks import Clock
from tests.support.flow import parked_completion
from tests.support.metrics import scrape, value
from tests.support.polling import wait_for
from tests.support.store import broker_lists, expire_leases, expire_slots, published_ids, server_ms
from tests.support.wire import body_of

AppFactory = Callable[..., Celery]
Dispatchers = Callable[..., Dispatcher]


def store_gated(
    app: Celery, gate: Gate, n: int, *, ids: list[str] | None = None, due: float | None = None,
    headers: dict[str, Any] | None = None,
) -> list[str]:  # fmt: skip
    """``n`` jobs of ``t.add`` gated by ``gate``, due ``due`` (default: a second ago)."""
    add = app.tasks["t.add"]
    out = []
    for i in range(n):
        job_id = ids[i] if ids else gated_id(gate.key, None)
        extra = headers if headers is not None else {GATE_HEADER: gate.header()}
        out.append(add.apply_at(due or time.time() - 1, (i, i), task_id=job_id, headers=extra).id)
    return out


def lease_token(store: Store, job_id: str) -> str | None:
    raw = store.client.hget(store.keys.for_job(job_id).leases, job_id)
    return None if raw is None else str(raw).rsplit("|", 1)[-1]


def states(store: Store, ids: list[str]) -> list[str | None]:
    out = []
    for job_id in ids:
        job = store.get(job_id)
        out.append(None if job is None else job.state)
    return out


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_the_cap_holds_across_two_beats_and_released_jobs_are_held_not_acked(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers, push: bool
) -> None:
    app = app_factory(delayq_push=push)
    gate = Gate("tenant:1", limit=2)
    ids = store_gated(app, gate, 3)
    plain = app.tasks["t.add"].apply_at(time.time() - 1, (9, 9))  # ungated: acked as ever
    one, two = dispatchers(app), dispatchers(app_factory(delayq_push=push))
    one.run_once()
    assert one.stats.gated["released"] == 2 and one.stats.gated["parked"] == 1
    ids += store_gated(app, gate, 2)  # the other beat finds the key full
    two.run_once()
    assert two.stats.claimed == 2 and two.stats.gated["parked"] == 2 and two.stats.published == 0

    published = published_ids(r)
    gated = [i for i in published if i != plain.id]
    assert plain.id in published and len(gated) == 2 and len(set(gated)) == 2
    store = get_store(app)
    state = store.key_state("tenant:1")
    assert (state.running, state.waiting, state.limit) == (2, 3, 2)
    assert sorted(states(store, ids)) == ["gated"] * 3 + ["running"] * 2
    for job_id in gated:  # held for the worker: the "run" lease, not removed
        assert lease_token(store, job_id) == RUN_TOKEN
    assert {lease_token(store, i) for i in ids if i not in gated} == {GATE_TOKEN}
    assert store.get(plain.id) is None
    assert (one.stats.held, one.stats.stale_holds, one.stats.acked) == (2, 0, 1)
    assert one.stats.slot_wait.snapshot().count == 2
    assert one.pushing is push  # the ungated job went the push path; the gated ones never do
    messages = {m["headers"]["id"]: m for m in broker_lists(r)["celery"]}
    assert messages[gated[0]]["headers"][GATE_HEADER] == {"key": "tenant:1", "limit": 2}

    # a slot given back: the other beat releases one parked job, not more
    store.release(gated[0], "tenant:1", "succeeded")
    two.wait(5)
    two.run_once()
    assert len(published_ids(r)) == 4 and two.stats.gated["released"] == 1
    assert (store.key_state("tenant:1").running, store.key_state("tenant:1").waiting) == (2, 2)


def test_a_parked_job_is_released_when_a_slot_is_given_back_and_the_beat_is_woken(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    app = app_factory(delayq_max_sleep=600)  # no safety poll within the test
    first, second = store_gated(app, Gate("tenant:2", limit=1), 2)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert published_ids(r) == [first]
    assert dispatcher.seconds_until_due() > 20  # nothing due soon: it would sleep
    store = get_store(app)
    assert states(store, [first, second]) == ["running", "gated"]

    result = store.release(first, "tenant:2", "succeeded")  # as the worker does when it ends
    assert (result.released, result.promoted) == (True, 1)
    started = time.monotonic()
    dispatcher.wait(30)
    assert time.monotonic() - started < 5  # the wake message, not a poll
    assert dispatcher.stats.wakeups >= 1
    dispatcher.run_once()
    assert published_ids(r) == [first, second]
    assert states(store, [first, second]) == [None, "running"]
    assert store.key_state("tenant:2").running == 1


def test_a_corrupt_gate_header_is_published_ungated_and_counted(
    app: Celery, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    [job] = store_gated(app, Gate("tenant:3"), 1, headers={GATE_HEADER: {"key": "bad{key", "limit": 0}})
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert published_ids(r) == [job]
    assert get_store(app).get(job) is None  # acked: no slot
    assert dispatcher.stats.corrupt["gate"] == 1
    assert dict(dispatcher.stats.gated) == {}
    assert get_store(app).key_states() == []


def test_a_beat_stalled_between_gate_and_hold_past_its_lease(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    """Another beat claims the job once the stalled beat's lease expires; its gate finds the
    id among the key's running ones and releases it again on the same slot (the count is not
    doubled, the parked job stays parked). Both beats published it: the duplicate of a beat
    stalled between publish and ack, as for any job."""
    app = app_factory()
    first, second = store_gated(app, Gate("tenant:4", limit=1), 2)
    stalled, other = dispatchers(app), dispatchers(app_factory())

    def stall_then_hold(step: str, detail: Any) -> None:
        if step == "hold":
            assert sorted(expire_leases(stalled.store)) == sorted([first, second])  # past the lease
            other.run_once()

    stalled.pause = stall_then_hold
    stalled.run_once()
    assert published_ids(r) == [first, first]
    assert other.stats.gated["released"] == 1 and other.stats.held == 1
    # The stalled beat's hold finds the job running (lease "run", slot kept): it cannot tell the
    # other beat's hold from a worker that started the task, and leaves it as it is.
    assert stalled.stats.stale_holds == 0 and stalled.stats.held == 1
    state = get_store(app).key_state("tenant:4")
    assert (state.running, state.waiting) == (1, 1)
    assert states(get_store(app), [first, second]) == ["running", "gated"]


def test_the_pause_seam_is_called_at_each_step_of_a_pass_in_order(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    """``Dispatcher.pause``, where the stall tests stop a beat: after the claim, as each job is
    handed to kombu's batch, as the batch reaches the broker, before the hold."""
    app = app_factory(delayq_push=False)
    [job] = store_gated(app, Gate("tenant:seam", limit=1), 1)
    dispatcher = dispatchers(app)
    steps: list[tuple[str, Any]] = []
    dispatcher.pause = lambda step, detail: steps.append((step, detail))
    dispatcher.run_once()
    assert [step for step, _ in steps] == ["claimed", "handed", "sent", "hold"]
    assert [claimed.id for _, claimed in steps[0][1]] == [job]
    assert (steps[1][1], steps[2][1]) == (job, 1)
    assert [held for pairs in steps[3][1].values() for held, _ in pairs] == [job]
    assert published_ids(r) == [job] and dispatcher.stats.held == 1


def test_a_slot_not_renewed_comes_back_and_the_job_is_delivered_again(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    """A message no worker starts (lost, or a backlog longer than delayq_start_ttl) renews
    nothing: after delayq_start_ttl the job is claimed again and released again on its one slot."""
    app = app_factory(delayq_start_ttl=30.0)
    first, second = store_gated(app, Gate("tenant:5", limit=1), 2)
    assert first != second
    wall = Clock()
    dispatcher = dispatchers(app, wall=wall)
    before = server_ms(r)
    dispatcher.run_once()
    after = server_ms(r)
    assert published_ids(r) == [first]
    released = get_store(app).get(first)
    assert released is not None and released.lease_until_ms is not None
    assert before + 30_000 <= released.lease_until_ms <= after + 30_000  # held for delayq_start_ttl
    dispatcher.run_once()
    assert published_ids(r) == [first]  # not before
    # delayq_start_ttl passes, on the server and on the beat's clock, with no renewal.
    assert expire_leases(get_store(app), [first]) == [first]
    wall.advance(30.0)
    dispatcher.run_once()
    assert published_ids(r) == [first, first]
    job = get_store(app).get(first)
    assert job is not None and (job.state, job.tries) == ("running", 2)
    state = get_store(app).key_state("tenant:5")
    assert (state.running, state.waiting) == (1, 1)


def test_a_message_waiting_for_a_worker_longer_than_the_slot_ttl_is_not_delivered_again(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    """No worker runs: the released job's message waits in the queue past delayq_slot_ttl,
    within delayq_start_ttl. The beat does not deliver it again, and its slot stays taken."""
    app = app_factory(delayq_slot_ttl=30, delayq_start_ttl=3600)
    first, _ = store_gated(app, Gate("tenant:9", limit=1), 2)
    wall, clock = Clock(), Clock(time.monotonic)
    dispatcher = dispatchers(app, wall=wall, clock=clock)
    dispatcher.run_once()
    assert published_ids(r) == [first]
    for _ in range(4):  # four slot TTLs pass (on the server and on the beat's clocks), passes between
        assert expire_slots(get_store(app), "tenant:9") == [first]
        wall.advance(30.0)
        clock.advance(30.0)
        dispatcher.run_once()
        dispatcher.run_once()
    assert published_ids(r) == [first]
    job = get_store(app).get(first)
    assert job is not None and (job.state, job.tries) == ("running", 1)
    assert get_store(app).key_state("tenant:9").running == 1


@pytest.mark.slow
def test_a_deferred_job_waits_for_its_rate(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers
) -> None:
    app = app_factory(delayq_max_sleep=0.1)
    gate = Gate("tenant:6", rate=Rate(1, 1000))
    ids = store_gated(app, gate, 2)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert len(published_ids(r)) == 1 and dispatcher.stats.gated["deferred"] == 1
    started = time.monotonic()
    assert wait_for(lambda: (dispatcher.run_once(), len(published_ids(r)) == 2)[1], 5, 0.05)
    assert time.monotonic() - started > 0.5  # a second apart (less the time of the first pass)
    assert sorted(published_ids(r)) == sorted(ids)


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_the_completion_job_gets_the_batch_id_and_counts(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Dispatchers, push: bool
) -> None:
    app = app_factory(delayq_push=push)
    bid = "b-1"
    store = get_store(app)
    done_id = parked_completion(app, bid, 3, 7)
    assert store.get(done_id).state == "gated"  # type: ignore[union-attr]
    members = [member_id(bid, i) for i in range(3)]
    store_gated(app, Gate(batch_key(bid), batch=bid), 3, ids=members)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert sorted(published_ids(r)) == sorted(members)
    for job_id, outcome in zip(members, ["succeeded", "failed", "succeeded"], strict=True):
        store.release(job_id, batch_key(bid), outcome, bid)
    dispatcher.wait(5)  # the completion job was made due: the wake message says so
    dispatcher.run_once()
    message = broker_lists(r)["celery"][-1]
    assert message["headers"]["id"] == done_id
    args, kwargs, _ = json.loads(body_of(message))
    assert (args, kwargs) == ([7, bid, {"total": 3, "succeeded": 2, "failed": 1, "cancelled": 0}], {})
    assert message["headers"]["argsrepr"] == repr(
        (7, bid, {"total": 3, "succeeded": 2, "failed": 1, "cancelled": 0})
    )
    assert store.get(done_id) is None  # acked
    assert dispatcher.stats.completions == 1


@pytest.mark.slow
def test_the_metrics_count_gate_decisions_and_show_each_busy_key(
    app: Celery, dispatchers: Dispatchers
) -> None:
    store_gated(app, Gate("tenant:7", limit=1), 3)
    store_gated(app, Gate("tenant:8", limit=5), 1)
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    get_store(app).set_limit("idle", 3)  # a key with nothing running or waiting: no series
    server = serve_metrics(dispatcher, free_port())
    try:
        page = scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.stop()
    assert value(page, "delayq_gated", "delayq_gated_total", decision="released") == 2
    assert value(page, "delayq_gated", "delayq_gated_total", decision="parked") == 2
    assert value(page, "delayq_gate_holds", "delayq_gate_holds_total") == 2
    assert value(page, "delayq_key_running", key="tenant:7") == 1
    assert value(page, "delayq_key_waiting", key="tenant:7") == 2
    assert value(page, "delayq_key_running", key="tenant:8") == 1
    assert value(page, "delayq_key_waiting", key="tenant:8") == 0
    assert not any(dict(labels).get("key") == "idle" for _, labels in page["delayq_key_running"])
    assert value(page, "delayq_gate_keys") == 3
    wait = "delayq_slot_wait_seconds"
    assert value(page, wait, wait + "_count") == 2
