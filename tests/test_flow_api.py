"""Flow control, the producer side (issue 15), against a real Redis: what ``apply_at``/
``apply_in``/``apply_at_many``/the intercepted ``apply_async`` store for a gated job (its id
on its key's shard, the gate header in its message), ``DelayQ.batch`` (member ids, headers,
priorities, the completion job) and the :class:`BatchResult` handle (progress after the
store's own release calls, ``join`` woken by the completion notification, ``cancel``,
``restore`` in another app), and the key administration calls.

The beat and worker sides (publishing through the gate, slots taken and given back by real
tasks) are tested in the end-to-end tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
import redis.connection
from celery import Celery

from celery_delayq import BatchResult, DelayQ
from celery_delayq.exceptions import InvalidOptions
from celery_delayq.flow.gate import (
    BATCH_DONE_HEADER,
    GATE_HEADER,
    batch_key,
    completion_id,
    key_tag,
    member_id,
)
from celery_delayq.store.facade import get_store
from celery_delayq.store.flow import KeyState
from tests.support.gate import message, run_members
from tests.support.store import server_ms

ETA = datetime(2031, 1, 1, tzinfo=UTC)
ETA_MS = int(ETA.timestamp() * 1000)


# -- gated jobs ------------------------------------------------------------------------------


def test_apply_at_with_a_cap_stores_the_job_on_its_keys_shard_with_the_gate_header(app: Celery) -> None:
    add = app.tasks["t.add"]
    result = add.apply_at(ETA, (1, 2), concurrency_key="tenant:42", concurrency_limit=3, priority=7)
    assert result.id.startswith("{tenant:42}") and len(result.id) == len("{tenant:42}") + 36
    store = get_store(app)
    assert store.keys.shard_of(result.id) == store.keys.shard_of(key_tag("tenant:42"))
    headers, priority, due, state = message(app, result.id)
    assert headers[GATE_HEADER] == {"key": "tenant:42", "limit": 3, "priority": 7}
    assert (priority, due, state) == (7, ETA_MS, "waiting")
    # the gate options are not Celery's: none of them reaches the message elsewhere
    raw = store.get(result.id).envelope  # type: ignore[union-attr]
    assert raw.count("concurrency_") == 0 and raw.count("tenant:42") == 2  # the id and the header


def test_apply_in_with_a_rate_and_apply_at_many_with_a_cap(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    before = server_ms(r)
    one = add.apply_in(60, (1, 2), rate_limit_key="api", rate_limit="100/s")
    headers, _, due, _ = message(app, one.id)
    assert one.id.startswith("{api}")
    assert headers[GATE_HEADER] == {"key": "api", "rate": [100, 1000]}
    assert before + 60_000 <= due <= server_ms(r) + 60_000

    items = [(ETA, (i, i), None) for i in range(5)]
    many = add.apply_at_many(items, concurrency_key="t:1", concurrency_limit=2, rate_limit="10/m")
    assert len({job.id for job in many}) == 5
    for job in many:
        assert job.id.startswith("{t:1}")
        headers, _, due, _ = message(app, job.id)
        assert headers[GATE_HEADER] == {"key": "t:1", "limit": 2, "rate": [10, 60_000]}
        assert due == ETA_MS


def test_a_given_id_with_the_tag_is_kept_and_idempotent(app: Celery) -> None:
    add = app.tasks["t.add"]
    first = add.apply_at(ETA, (1, 2), task_id="{k}invoice-1", concurrency_key="k", concurrency_limit=1)
    again = add.apply_at(
        ETA.replace(year=2032), (1, 2), task_id="{k}invoice-1", concurrency_key="k", concurrency_limit=1
    )
    assert (first.id, first.created, again.created) == ("{k}invoice-1", True, False)
    assert DelayQ(app).count() == 1


def test_a_key_with_a_run_time_limit_needs_no_limit_on_the_job(app: Celery) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    dq.set_limit("shared", 2, new=True)
    result = add.apply_at(ETA, (1, 2), concurrency_key="shared")
    assert message(app, result.id)[0][GATE_HEADER] == {"key": "shared"}
    dq.set_limit("open", None, new=True)  # an explicit "no cap" is a limit set too
    assert add.apply_at(ETA, (1, 2), concurrency_key="open").id.startswith("{open}")


def test_apply_async_with_gate_options_goes_through_delayq_at_once(app: Celery, r: redis.Redis) -> None:
    assert app.conf.get("delayq_intercept_eta", False) is False  # the default: gate options win anyway
    add = app.tasks["t.add"]
    before = server_ms(r)
    now = add.apply_async((1, 2), concurrency_key="k", concurrency_limit=1)
    headers, _, due, state = message(app, now.id)
    assert now.id.startswith("{k}") and state == "waiting"
    assert headers[GATE_HEADER] == {"key": "k", "limit": 1}
    assert before <= due <= server_ms(r)
    later = add.apply_async((1, 2), countdown=30, rate_limit_key="k", rate_limit=5)
    _, _, due, _ = message(app, later.id)
    assert before + 30_000 <= due <= server_ms(r) + 30_000
    assert r.llen("celery") == 0  # nothing went to the broker
    plain = add.apply_async((1, 2))  # no gate option: Celery's own apply_async, as before
    assert get_store(app).get(plain.id) is None and r.llen("celery") == 1


def test_a_retry_of_a_gated_job_stays_gated(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    first = add.apply_at(ETA, (1, 2), concurrency_key="k", concurrency_limit=2)
    carried = message(app, first.id)[0][GATE_HEADER]
    # what self.retry(countdown=30) sends, delayq_intercept_eta off: the request's headers (the
    # gate's and the due time's), the same id, retries + 1
    before = server_ms(r)
    again = add.apply_async(
        (1, 2), task_id=first.id, countdown=30, retries=1, headers={GATE_HEADER: carried, "delayq_due": 1.0}
    )
    headers, _, due, _ = message(app, first.id)
    assert again.id == first.id and r.llen("celery") == 0
    assert headers[GATE_HEADER] == {"key": "k", "limit": 2} and headers["retries"] == 1
    assert "delayq_due" not in headers and before + 30_000 <= due <= server_ms(r) + 30_000
    assert DelayQ(app).count() == 1


def test_gated_jobs_share_a_kept_route_that_does_not_follow_the_callers_headers(app: Celery) -> None:
    """A gated job's options hold a dict (its headers), and the route made for them is kept
    like any other (else each apply_at would make it again): kept from a copy, so a plan made
    later from it (another thread: another reply_to) has the headers as they were given."""
    add = app.tasks["t.add"]
    cap = {"concurrency_key": "k", "concurrency_limit": 1}
    given = {"note": {"a": 1}}
    first = add.apply_at(ETA, (1, 2), headers=given, **cap)
    given["note"]["a"] = 2  # the caller's dict changes after the call
    later: list[Any] = []
    thread = threading.Thread(
        target=lambda: later.append(add.apply_at(ETA, (1, 2), headers={"note": {"a": 1}}, **cap))
    )
    thread.start()
    thread.join()
    assert message(app, first.id)[0]["note"] == {"a": 1}
    assert message(app, later[0].id)[0]["note"] == {"a": 1}
    assert message(app, add.apply_at(ETA, (1, 2), headers=given, **cap).id)[0]["note"] == {"a": 2}


def test_eager_mode_checks_the_gate_options_and_runs_at_once(app: Celery) -> None:
    app.conf.task_always_eager = True
    add = app.tasks["t.add"]
    assert add.apply_at(ETA, (1, 2), concurrency_key="k", concurrency_limit=1).get() == 3
    assert add.apply_async((1, 2), concurrency_key="k", concurrency_limit=1).get() == 3
    with pytest.raises(InvalidOptions, match="concurrency_limit=0"):
        add.apply_async((1, 2), concurrency_key="k", concurrency_limit=0)


# -- batches ---------------------------------------------------------------------------------


def test_a_batch_stores_its_members_with_ids_headers_and_priorities(app: Celery, r: redis.Redis) -> None:
    add, noop = app.tasks["t.add"], app.tasks["t.noop"]
    signatures = [add.s(i, i) for i in range(3)] + [noop.s(), add.s(9, 9).set(priority=9, queue="q2")]
    result = DelayQ(app).batch(
        signatures, ETA, concurrency_limit=2, priority=5, on_complete=add.s(), batch_id="b1"
    )
    assert isinstance(result, BatchResult) and result.id == "b1"
    key = batch_key("b1")
    for i in range(5):
        headers, priority, due, state = message(app, member_id("b1", i))
        own = 9 if i == 4 else 5
        assert headers[GATE_HEADER] == {"key": key, "limit": 2, "priority": own, "batch": "b1"}
        assert (priority, due, state) == (own, ETA_MS, "waiting")
    job = DelayQ(app).get(member_id("b1", 4))
    assert job is not None and (job.task, job.args, job.queue) == ("t.add", [9, 9], "q2")
    assert DelayQ(app).get(member_id("b1", 3)).task == "t.noop"  # type: ignore[union-attr]
    headers, _, _, state = message(app, completion_id("b1"))
    assert headers[BATCH_DONE_HEADER] == "b1" and GATE_HEADER not in headers
    assert state == "gated"  # parked until the batch completes
    completion = DelayQ(app).get(completion_id("b1"))
    assert completion is not None and (completion.task, completion.args) == ("t.add", [])
    assert (completion.state, completion.lease_until) == ("gated", None)  # parked: no time
    assert completion_id("b1") in [job.id for job in DelayQ(app).pending()]
    assert result.progress() == {
        "total": 5,
        "waiting": 5,
        "running": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    store = get_store(app)
    shards = {store.keys.shard_of(member_id("b1", i)) for i in range(5)}
    assert shards == {store.keys.shard_of(completion_id("b1"))}
    assert [b.batch_id for b in DelayQ(app).batches()] == ["b1"]


def test_members_of_one_task_and_options_share_one_build(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    import celery_delayq.flow.batch as batch_module

    calls: list[int] = []
    real = batch_module.build_envelopes

    def counted(app_: Any, task: Any, jobs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(jobs))
        return real(app_, task, jobs, *args, **kwargs)

    monkeypatch.setattr(batch_module, "build_envelopes", counted)
    add, noop = app.tasks["t.add"], app.tasks["t.noop"]
    signatures = [add.s(i, 1) for i in range(50)] + [noop.s()] * 20 + [add.s(0, 0).set(queue="q")] * 5
    DelayQ(app).batch(signatures, ETA)
    assert sorted(calls) == [5, 20, 50]


def test_progress_follows_the_stores_releases(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    result = DelayQ(app).batch([add.s(i, i) for i in range(4)], batch_id="p")  # due now
    ids = [member_id("p", i) for i in range(4)]
    run_members(app, ids[:3])
    running = DelayQ(app).get(ids[0])
    assert running is not None and running.state == "running" and running.lease_until is not None
    assert 0 < running.lease_until.timestamp() * 1000 - server_ms(r) <= 60_000
    assert result.progress() == {
        "total": 4,
        "waiting": 1,
        "running": 3,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    store = get_store(app)
    key = batch_key("p")
    assert store.release(ids[0], key, "succeeded", "p").released
    assert store.release(ids[1], key, "failed", "p").released
    assert not store.release(ids[1], key, "failed", "p").released  # a double release counts once
    assert result.progress() == {
        "total": 4,
        "waiting": 1,
        "running": 1,
        "succeeded": 1,
        "failed": 1,
        "cancelled": 0,
    }
    assert not result.done


def test_join_is_woken_by_the_completion_notification(app: Celery) -> None:
    add = app.tasks["t.add"]
    result = DelayQ(app).batch([add.s(i, i) for i in range(3)], batch_id="j")
    ids = [member_id("j", i) for i in range(3)]
    run_members(app, ids)
    store = get_store(app)
    for job_id in ids[:2]:
        store.release(job_id, batch_key("j"), "succeeded", "j")
    with pytest.raises(TimeoutError, match=r"'j' not complete after 0\.1 s"):
        result.join(timeout=0.1)

    def last() -> None:
        time.sleep(0.15)
        store.release(ids[2], batch_key("j"), "failed", "j")

    thread = threading.Thread(target=last)
    started = time.monotonic()
    thread.start()
    progress = result.join(timeout=30)
    waited = time.monotonic() - started
    thread.join()
    assert progress == {"total": 3, "waiting": 0, "running": 0, "succeeded": 2, "failed": 1, "cancelled": 0}
    # join re-reads the batch on a notification (or after a minute of silence): woken by it
    assert 0.15 <= waited < 5, waited
    assert result.done and result.join(timeout=0) == progress  # a done batch returns at once


def test_cancel_removes_the_waiting_members_and_completes_the_batch(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    result = DelayQ(app).batch([add.s(i, i) for i in range(5)], batch_id="c", on_complete=add.s())
    run_members(app, [member_id("c", 0)])
    assert result.cancel() == 4
    assert result.progress() == {
        "total": 5,
        "waiting": 0,
        "running": 1,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 4,
    }
    assert not result.done and result.cancel() == 0
    assert [DelayQ(app).get(member_id("c", i)) is None for i in range(5)] == [False] + [True] * 4
    get_store(app).release(member_id("c", 0), batch_key("c"), "succeeded", "c")
    assert result.done
    # the completion job was promoted: due now (it was parked)
    assert message(app, completion_id("c"))[2] <= server_ms(r)


def test_dq_cancel_of_a_member_counts_in_its_batch(app: Celery) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    result = dq.batch([add.s(i, i) for i in range(3)], ETA, batch_id="m")
    assert dq.cancel(member_id("m", 1)) == "cancelled"
    assert dq.cancel(member_id("m", 1)) == "missing"
    assert result.progress()["cancelled"] == 1 and result.progress()["waiting"] == 2
    assert dq.count() == 2


def test_restore_in_another_app(app: Celery, app_factory: Callable[..., Celery]) -> None:
    add = app.tasks["t.add"]
    made = DelayQ(app).batch([add.s(1, 1), add.s(2, 2)], ETA, concurrency_limit=1)
    other = app_factory()
    restored = DelayQ(other).batch_result(made.id)
    assert restored is not None and restored.id == made.id and restored.app is other
    assert restored.progress() == made.progress()
    assert BatchResult.restore(made.id, other) is not None
    assert DelayQ(other).batch_result("nope") is None


def test_key_administration(app: Celery) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    job = add.apply_at(0, (1, 2), concurrency_key="k1", concurrency_limit=4)
    run_members(app, [job.id])  # the gate saw the key: it is listed, with the job's own limit
    assert dq.key_state("k1") == KeyState("k1", 4, None, 1, 0, False)
    assert dq.set_limit("k1", 1) == 0
    assert dq.pause("k1") == 0
    assert dq.key_state("k1") == KeyState("k1", 1, "1", 1, 0, True)
    dq.resume("k1")
    dq.set_limit("k1", None)
    assert dq.key_state("k1") == KeyState("k1", None, "none", 1, 0, False)
    dq.clear_limit("k1")
    assert dq.keys() == [KeyState("k1", 4, None, 1, 0, False)]


@pytest.mark.slow
def test_a_batch_of_100000_members_is_stored_in_few_round_trips(
    app: Celery, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    dq.batch([add.s(0, 0)], ETA, batch_id="warm")  # scripts loaded, route planned
    writes = 0
    real = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        nonlocal writes
        writes += 1
        real(self, command, check_health)

    signatures = [add.s(i, i) for i in range(100_000)]
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    started = time.perf_counter()
    result = dq.batch(signatures, ETA, concurrency_limit=10, priority=3)
    took = time.perf_counter() - started
    monkeypatch.undo()
    print(f"100,000 members: {took:.2f} s, {writes} round trips")
    assert writes <= 3, writes  # open_batch, one pipeline (and a TIME when the clock is old)
    assert result.progress()["total"] == 100_000
    assert dq.count() == 100_001  # and the warm-up batch's member
