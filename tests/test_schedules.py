"""Recurring schedules end to end in-process: ``Schedules`` API, an in-process ``Dispatcher``,
the Redis broker, and the Lua scripts (``sched_put``, ``sched_del``, ``fire``) on a real server."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule, solar

from celery_delayq import DelayQ, Scheduler, Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.exceptions import (
    InvalidSchedule,
    ScheduleExists,
    ScheduleNotFound,
    SerializationError,
    UnknownTask,
)
from celery_delayq.schedules.api import point_id
from celery_delayq.schedules.rules import CronRule, IntervalRule, parse_rule
from celery_delayq.store.facade import get_store
from celery_delayq.store.schedules import FireOutcome
from tests.support.apps import AppFactory
from tests.support.polling import wait_for
from tests.support.store import expire_leases, rule_due_soon, server_ms, snapshot
from tests.support.wire import body_of

HOUR = 3600.0
HOUR_MS = 3_600_000

# -- fixtures and helpers -----------------------------------------------------------------------


def messages(r: redis.Redis, queue: str = "celery") -> list[dict[str, Any]]:
    """Task messages in ``queue``, oldest first: id, task, args, due (ms)."""
    out = []
    for raw in reversed(r.lrange(queue, 0, -1)):
        message = json.loads(raw)
        headers = message["headers"]
        args, kwargs, _ = json.loads(body_of(message))
        out.append(
            {
                "id": headers["id"],
                "task": headers["task"],
                "args": args,
                "kwargs": kwargs,
                "due": headers["delayq_due"],
            }
        )
    return out


def ids_of(r: redis.Redis, name: str) -> list[str]:
    return [m["id"] for m in messages(r) if m["id"].startswith("{" + name + "}@")]


def pump(*beats: Dispatcher, seconds: float, until: Callable[[], Any] | None = None) -> None:
    """Run the dispatchers' loop (pass, then sleep on the wake channel) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for beat in beats:
            beat.run_once()
        if until is not None and until():
            return
        for beat in beats:
            beat.wait(min(0.02, max(0.0, deadline - time.monotonic())))


def stored_ids(app: Celery, name: str) -> list[str]:
    """Ids of the jobs stored (waiting or leased) for schedule ``name``."""
    return [job.id for job in DelayQ(app).pending() if job.id.startswith("{" + name + "}@")]


def raw_state(r: redis.Redis, app: Celery, name: str) -> tuple[str | None, str | None]:
    keys = get_store(app).keys
    shard = keys.shard(keys.shard_of("{" + name + "}"))
    return r.hget(shard.schedules, name), r.hget(shard.history, name)


def raw_members(r: redis.Redis, app: Celery, name: str) -> list[str]:
    """Every member of the schedule's shard's due set and jobs hash that is one of its points."""
    keys = get_store(app).keys
    shard = keys.shard(keys.shard_of("{" + name + "}"))
    prefix = "{" + name + "}@"
    return [m for m in r.zrange(shard.due, 0, -1) + r.hkeys(shard.jobs) if m.startswith(prefix)]


def ms_of(value: Any) -> int:
    return round(value.timestamp() * 1000)


def make_solar() -> solar:
    """A ``celery.schedules.solar`` (built without ``ephem`` when it is not installed)."""
    try:
        return solar("sunrise", 48.85, 2.35)
    except Exception:  # ImproperlyConfigured: ephem missing
        sun = solar.__new__(solar)
        BaseSchedule.__init__(sun)
        sun.event, sun.lat, sun.lon = "sunrise", 48.85, 2.35
        return sun


# -- add ----------------------------------------------------------------------------------------


def test_add_stores_the_definition_and_the_first_point(app: Celery) -> None:
    schedules = Schedules(app)
    before = int(time.time() * 1000)
    created = schedules.add(
        "nightly",
        app.tasks["t.add"],
        "30 2 * * *",
        (1, 2),
        tz="Europe/Paris",
        options={"queue": "reports"},
        grace=30,
    )
    after = int(time.time() * 1000)
    rule = CronRule("30 2 * * *", "Europe/Paris")
    assert created.name == "nightly" and created.task == "t.add"
    assert created.rule == rule and created.tz == "Europe/Paris"
    assert (created.args, created.kwargs, created.options) == ([1, 2], {}, {"queue": "reports"})
    assert (created.enabled, created.missed, created.max_missed, created.grace) == (True, "once", 10, 30.0)
    assert created.origin == "api" and created.created == created.updated
    assert before <= ms_of(created.created) <= after
    assert (created.run_count, created.last_run, created.last_task_id) == (0, None, None)
    assert created.next_run is not None
    assert ms_of(created.next_run) in {rule.next_after(before), rule.next_after(after)}
    assert schedules.get("nightly") == created
    assert schedules.count() == 1
    json.dumps(created.to_json())

    point = point_id("nightly", ms_of(created.next_run))
    assert stored_ids(app, "nightly") == [point]
    job = DelayQ(app).get(point)
    assert job is not None
    assert (job.state, job.task, job.args, job.queue, job.due) == (
        "waiting",
        "t.add",
        [1, 2],
        "reports",
        created.next_run,
    )
    keys = get_store(app).keys
    assert job.shard == keys.shard_of("nightly")  # the braces put points on the schedule's shard


def test_point_id_is_readable_and_sortable() -> None:
    assert point_id("nightly-report", 1_767_225_600_000) == "{nightly-report}@2026-01-01T00:00:00.000Z"
    assert point_id("x", 1_767_225_600_007) == "{x}@2026-01-01T00:00:00.007Z"
    points = [1_767_225_600_000 + k * 997 for k in range(50)]
    assert sorted(point_id("x", p) for p in points) == [point_id("x", p) for p in points]


Refusal = tuple[Callable[[], Any], type[BaseException] | tuple[type[BaseException], ...], str]


def _refusals(app: Celery) -> list[Refusal]:
    s = Schedules(app)
    return [
        (lambda: s.add("keep", "t.noop", 60), ScheduleExists, "exists; use upsert"),
        (lambda: s.add("x", "t.nope", 60), UnknownTask, "'t.nope' is not registered"),
        (lambda: s.add("x", "t.add", 60, (1,)), TypeError, "missing 1 required positional argument"),
        (lambda: s.add("x", "t.add", 60, (1,), enabled=False), TypeError, "missing 1 required"),
        (lambda: s.add("x", "t.add", 60, (1, 2, 3)), TypeError, "positional argument"),
        (lambda: s.add("x", "t.add", 60, (object(), 2)), (SerializationError, InvalidSchedule), "serializ"),
        (
            lambda: s.add("x", "t.add", 60, kwargs={"x": {1}, "y": 2}),
            (SerializationError, InvalidSchedule),
            "serializ",
        ),
        (lambda: s.add("x", "t.add", "61 * * * *", (1, 2)), InvalidSchedule, "malformed cron"),
        (lambda: s.add("x", "t.add", "0 0 31 2 *", (1, 2)), InvalidSchedule, "never matches"),
        (
            lambda: s.add("x", "t.add", "0 9 * * *", (1, 2), tz="Nowhere/Land"),
            InvalidSchedule,
            "unknown timezone",
        ),
        (lambda: s.add("x", "t.add", 0, (1, 2)), InvalidSchedule, "interval must be"),
        (lambda: s.add("x", "t.add", None, (1, 2)), InvalidSchedule, "cannot make a schedule rule"),
        (
            lambda: s.add("x", "t.add", 60, (1, 2), missed="sometimes"),
            InvalidSchedule,
            "missed must be one of",
        ),
        (lambda: s.add("x", "t.add", 60, (1, 2), max_missed=0), InvalidSchedule, "max_missed"),
        (lambda: s.add("x", "t.add", 60, (1, 2), max_missed=2.5), InvalidSchedule, "max_missed"),  # type: ignore[arg-type]
        (lambda: s.add("x", "t.add", 60, (1, 2), max_missed=True), InvalidSchedule, "max_missed"),
        (lambda: s.add("x", "t.add", 60, (1, 2), grace=-1), InvalidSchedule, "grace"),
        (lambda: s.add("x", "t.add", 60, (1, 2), grace=math.nan), InvalidSchedule, "grace"),
        (lambda: s.add("x", "t.add", 60, (1, 2), grace="60"), InvalidSchedule, "grace"),  # type: ignore[arg-type]
        (lambda: s.add("a{b}", "t.add", 60, (1, 2)), InvalidSchedule, "without braces"),
        (lambda: s.add("{keep}", "t.add", 60, (1, 2)), InvalidSchedule, "without braces"),
        (lambda: s.add("x}", "t.add", 60, (1, 2)), InvalidSchedule, "without braces"),
        (lambda: s.add("n" * 201, "t.add", 60, (1, 2)), InvalidSchedule, "at most 200"),
        (lambda: s.add("", "t.add", 60, (1, 2)), InvalidSchedule, "non-empty"),
        (lambda: s.add("  ", "t.add", 60, (1, 2)), InvalidSchedule, "non-empty"),
        (lambda: s.add(None, "t.add", 60, (1, 2)), InvalidSchedule, "non-empty"),  # type: ignore[arg-type]
        (lambda: s.add("x", None, 60), InvalidSchedule, "task must be"),
        (lambda: s.upsert("keep", "t.add", "61 * * * *", (1, 2)), InvalidSchedule, "malformed cron"),
        (lambda: s.upsert("keep", "t.add", 60, (1,)), TypeError, "missing"),
        (lambda: s.upsert("keep", "t.add", 60, (1,), enabled=False), TypeError, "missing"),
        (lambda: s.upsert("keep", "t.nope", 60), UnknownTask, "not registered"),
    ]


def test_a_refused_add_stores_nothing_and_leaves_existing_schedules_intact(
    app: Celery, redis_url: str
) -> None:
    schedules = Schedules(app)
    schedules.add("keep", "t.add", 3600, (1, 2))
    schedules.add("other", "t.noop", "0 9 * * *", tz="America/New_York")
    before = snapshot(redis_url)
    for i, (call, error, message) in enumerate(_refusals(app)):
        with pytest.raises(error) as info:
            call()
        assert message in str(info.value), (i, str(info.value))
        assert snapshot(redis_url) == before, f"refusal #{i} ({message!r}) changed the store"
    assert schedules.count() == 2
    # ScheduleExists and UnknownTask are KeyErrors, the validation errors ValueErrors.
    assert issubclass(ScheduleExists, KeyError) and issubclass(UnknownTask, KeyError)
    assert issubclass(InvalidSchedule, ValueError)


def test_check_task_false_stores_a_task_this_app_does_not_have(app: Celery) -> None:
    schedules = Schedules(app)
    stored = schedules.add("remote", "other.service.task", 3600, (1,), {"k": "v"}, check_task=False)
    assert stored.task == "other.service.task"
    [point] = stored_ids(app, "remote")
    job = DelayQ(app).get(point)
    assert job is not None and (job.task, job.args, job.kwargs) == ("other.service.task", [1], {"k": "v"})


# -- upsert, get, list --------------------------------------------------------------------------


def test_upsert_keeps_history_and_created(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    schedules = Schedules(app)
    first = schedules.add("u", "t.add", 0.05, (1, 1))
    beat = dispatchers(app)
    pump(beat, seconds=5, until=lambda: schedules.get("u").run_count >= 2)  # type: ignore[union-attr]
    ran = schedules.get("u")
    assert ran is not None and ran.run_count >= 2 and ran.last_run is not None
    old_points = stored_ids(app, "u")

    time.sleep(0.01)
    replaced = schedules.upsert("u", "t.add", 3600, (2, 2), missed="skip")
    assert replaced.created == first.created
    assert replaced.updated > first.updated
    assert (replaced.run_count, replaced.last_run, replaced.last_task_id) == (
        ran.run_count,
        ran.last_run,
        ran.last_task_id,
    )
    assert (replaced.args, replaced.missed) == ([2, 2], "skip")
    assert replaced.rule == IntervalRule(HOUR_MS, ms_of(first.created))
    assert replaced.next_run is not None
    new_point = point_id("u", ms_of(replaced.next_run))
    assert stored_ids(app, "u") == [new_point]
    assert not set(old_points) & {new_point}
    job = DelayQ(app).get(new_point)
    assert job is not None and job.args == [2, 2]
    # upsert of a new name creates it
    fresh = schedules.upsert("v", "t.noop", "0 9 * * *")
    assert fresh.created == fresh.updated and schedules.count() == 2


def test_get_and_list_filter_and_page_across_shards(app_factory: AppFactory) -> None:
    app = app_factory(delayq_shards=3)
    schedules = Schedules(app)
    n = 420  # over 128 a shard: the shard hashes are real hash tables, HSCAN pages them
    for i in range(n):
        schedules.add(
            f"s{i:03d}",
            "t.add" if i % 3 == 0 else "t.noop",
            IntervalRule(HOUR_MS, anchor_ms=i),
            (i, i) if i % 3 == 0 else None,
            enabled=i % 5 != 0,
            check_task=True,
        )
    keys = get_store(app).keys
    per_shard = [keys.shard_of(f"s{i:03d}") for i in range(n)]
    assert min(per_shard.count(s) for s in range(3)) > 128
    assert schedules.count() == n

    everything = list(schedules.list(page_size=25))
    names = [s.name for s in everything]
    assert len(names) == n and set(names) == {f"s{i:03d}" for i in range(n)}
    assert {s.name for s in schedules.list(task="t.add", page_size=25)} == {
        f"s{i:03d}" for i in range(0, n, 3)
    }
    assert {s.name for s in schedules.list(enabled=False)} == {f"s{i:03d}" for i in range(0, n, 5)}
    assert {s.name for s in schedules.list(task="t.add", enabled=True, page_size=7)} == {
        f"s{i:03d}" for i in range(n) if i % 3 == 0 and i % 5 != 0
    }
    assert list(schedules.list(task="t.missing")) == []
    by_name = {s.name: s for s in everything}
    assert schedules.get("s003") == by_name["s003"]
    assert by_name["s003"].args == [3, 3] and by_name["s005"].next_run is None
    assert schedules.get("nope") is None
    with pytest.raises(InvalidSchedule):
        schedules.get("bad{name}")


# -- update, pause, resume, delete, run_now -----------------------------------------------------


@pytest.mark.slow
def test_update_takes_effect_at_the_next_point_and_removes_the_old_one(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    schedules = Schedules(app)
    first = schedules.add("up", "t.add", 3600, (1, 2))
    assert first.next_run is not None
    old_point = point_id("up", ms_of(first.next_run))
    assert stored_ids(app, "up") == [old_point]

    time.sleep(0.01)
    changed = schedules.update("up", rule=0.25, args=(3, 4))
    assert changed.created == first.created and changed.updated > first.updated
    assert changed.rule == IntervalRule(250, ms_of(first.created))
    assert changed.args == [3, 4]
    assert DelayQ(app).get(old_point) is None  # the old waiting point is gone
    assert old_point not in raw_members(r, app, "up")
    assert changed.next_run is not None and changed.next_run < first.next_run
    assert stored_ids(app, "up") == [point_id("up", ms_of(changed.next_run))]

    beat = dispatchers(app)
    pump(beat, seconds=5, until=lambda: len(ids_of(r, "up")) >= 3)
    sent = [m for m in messages(r) if m["id"].startswith("{up}@")]
    assert len(sent) >= 3
    assert old_point not in [m["id"] for m in sent]
    assert all(m["args"] == [3, 4] for m in sent)
    assert sent[0]["due"] == ms_of(changed.next_run)
    assert all((m["due"] - ms_of(first.created)) % 250 == 0 for m in sent)

    with pytest.raises(InvalidSchedule, match="cannot update"):
        schedules.update("up", colour="blue")
    with pytest.raises(ScheduleNotFound):
        schedules.update("missing", args=(1, 2))
    assert issubclass(ScheduleNotFound, LookupError)
    state = raw_state(r, app, "up")
    with pytest.raises(UnknownTask):
        schedules.update("up", task="t.nope")
    with pytest.raises(TypeError):
        schedules.update("up", args=(1,))
    assert raw_state(r, app, "up")[0] == state[0]


def test_update_tz_of_a_cron_schedule(app: Celery) -> None:
    schedules = Schedules(app)
    paris = schedules.add("tz", "t.noop", "0 9 * * *", tz="Europe/Paris")
    before = int(time.time() * 1000)
    moved = schedules.update("tz", tz="Asia/Tokyo")
    after = int(time.time() * 1000)
    assert moved.rule == CronRule("0 9 * * *", "Asia/Tokyo") and moved.tz == "Asia/Tokyo"
    assert moved.next_run is not None
    assert ms_of(moved.next_run) in {moved.rule.next_after(before), moved.rule.next_after(after)}
    assert stored_ids(app, "tz") == [point_id("tz", ms_of(moved.next_run))]
    assert paris.next_run != moved.next_run  # 09:00 in Tokyo is never 09:00 in Paris


@pytest.mark.slow
def test_pause_and_resume(app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]) -> None:
    schedules = Schedules(app)
    schedules.add("p", "t.noop", 0.2)
    paused = schedules.pause("p")
    assert (paused.enabled, paused.next_run) == (False, None)
    assert stored_ids(app, "p") == [] and raw_members(r, app, "p") == []
    beat = dispatchers(app)
    pump(beat, seconds=0.8)
    assert ids_of(r, "p") == []
    assert schedules.get("p").run_count == 0  # type: ignore[union-attr]

    resumed_at = int(time.time() * 1000)
    resumed = schedules.resume("p")
    back = int(time.time() * 1000)
    assert resumed.enabled and resumed.next_run is not None
    assert resumed_at < ms_of(resumed.next_run) <= back + 200
    pump(beat, seconds=5, until=lambda: len(ids_of(r, "p")) >= 2)
    sent = [m for m in messages(r) if m["id"].startswith("{p}@")]
    assert len(sent) >= 2
    assert all(m["due"] > resumed_at for m in sent)  # from now: nothing owed for the pause
    assert sent[0]["due"] == ms_of(resumed.next_run)


@pytest.mark.slow
def test_delete(app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]) -> None:
    schedules = Schedules(app)
    schedules.add("d", "t.noop", 0.2)
    schedules.add("stays", "t.noop", 3600)
    assert len(raw_members(r, app, "d")) == 2  # its point: in the due set and the jobs hash
    assert schedules.delete("d") is True
    assert schedules.get("d") is None
    assert stored_ids(app, "d") == [] and raw_members(r, app, "d") == []
    assert raw_state(r, app, "d") == (None, None)
    beat = dispatchers(app)
    pump(beat, seconds=0.7)
    assert ids_of(r, "d") == []
    assert schedules.delete("d") is False
    assert schedules.delete("never-existed") is False
    assert schedules.count() == 1 and len(stored_ids(app, "stays")) == 1


@pytest.mark.slow
def test_run_now_publishes_once_and_leaves_the_schedule_alone(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    schedules = Schedules(app)
    schedules.add("n", "t.add", 3600, (5, 6), options={"queue": "now-q"})
    before = schedules.get("n")
    points_before = stored_ids(app, "n")
    result = schedules.run_now("n")
    assert result.id.startswith("{n}@run-now-")
    beat = dispatchers(app)
    pump(beat, seconds=0.5)
    sent = messages(r, "now-q")
    assert [(m["id"], m["task"], m["args"]) for m in sent] == [(result.id, "t.add", [5, 6])]
    assert schedules.get("n") == before
    assert stored_ids(app, "n") == points_before
    with pytest.raises(ScheduleNotFound):
        schedules.run_now("missing")


@pytest.mark.slow
def test_points_have_deterministic_ids_and_update_the_run_history(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    schedules = Schedules(app)
    anchor = int(time.time() * 1000)
    added = schedules.add("h", "t.add", IntervalRule(300, anchor), (1, 2))
    assert added.next_run is not None
    first = ms_of(added.next_run)  # the first grid point after add()'s own "now"
    assert first > anchor and (first - anchor) % 300 == 0
    # Two beats take turns: every point goes out once, under the same id whichever beat sends it.
    beats = [dispatchers(app), dispatchers(app)]
    pump(*beats, seconds=6, until=lambda: len(ids_of(r, "h")) >= 4)
    sent = [m for m in messages(r) if m["id"].startswith("{h}@")]
    assert len(sent) >= 4
    dues = [m["due"] for m in sent]
    assert [m["id"] for m in sent] == [point_id("h", d) for d in dues]
    assert len(set(dues)) == len(dues)
    assert dues == [first + 300 * k for k in range(len(dues))]  # no gap, no repeat
    history = schedules.get("h")
    assert history is not None
    assert history.run_count == len(sent)
    assert history.last_task_id == sent[-1]["id"]
    assert history.last_run is not None and ms_of(history.last_run) == dues[-1]
    assert history.next_run is not None and ms_of(history.next_run) == dues[-1] + 300
    assert stored_ids(app, "h") == [point_id("h", dues[-1] + 300)]
    assert sum(b.stats.stale_acks for b in beats) == 0


# -- fire.lua edges -------------------------------------------------------------------------------


def _fire(app: Celery, token: str, name: str, at_ms: int, published: str, next_ms: int | None) -> FireOutcome:
    schedules = Schedules(app)
    store = get_store(app)
    keys = store.keys
    shard = keys.shard_of("{" + name + "}")
    definition = json.loads(raw_state(store.client, app, name)[0] or "{}")
    next_id, envelope = schedules.envelope_for(definition, next_ms) if next_ms else ("", "")
    args = [point_id(name, at_ms), name, at_ms, published, next_id, next_ms or 0, envelope]
    [outcome] = store.fire(token, [(shard, args)])
    return outcome


def _due_point(app: Celery, r: redis.Redis, name: str) -> int:
    """Wait until the schedule's stored point is due; its time in ms."""
    stored = Schedules(app).get(name)
    assert stored is not None and stored.next_run is not None
    at = ms_of(stored.next_run)
    assert wait_for(lambda: server_ms(r) > at + 5, 5, 0.01)
    return at


def test_a_stale_holder_cannot_advance_the_schedule(app_factory: AppFactory, r: redis.Redis) -> None:
    app = app_factory()
    schedules = Schedules(app)
    store = get_store(app)
    schedules.add("st", "t.noop", rule_due_soon(schedules.store))
    at = _due_point(app, r, "st")
    pid = point_id("st", at)
    shard = store.keys.shard_of(pid)
    [first] = store.claim([shard], "beat-A")
    assert [j.id for j in first.jobs] == [pid]
    assert expire_leases(store, [pid]) == [pid]  # A's lease expired
    [second] = store.claim([shard], "beat-B")
    assert [(j.id, j.tries) for j in second.jobs] == [(pid, 2)]
    before = raw_state(r, app, "st")

    assert _fire(app, "beat-A", "st", at, pid, at + 1000) is FireOutcome.STALE  # A no longer holds it
    assert raw_state(r, app, "st") == before
    job = DelayQ(app).get(pid)
    assert job is not None and job.state == "leased"
    assert stored_ids(app, "st") == [pid]

    assert _fire(app, "beat-B", "st", at, pid, at + 1000) is FireOutcome.FIRED
    after = schedules.get("st")
    assert after is not None
    assert (after.run_count, after.last_task_id) == (1, pid)
    assert after.next_run is not None and ms_of(after.next_run) == at + 1000
    assert stored_ids(app, "st") == [point_id("st", at + 1000)]
    assert _fire(app, "beat-B", "st", at, pid, at + 1000) is FireOutcome.STALE  # acked: nothing to do twice


def test_a_point_held_while_its_schedule_is_deleted_is_acked_without_advancing(
    app_factory: AppFactory, r: redis.Redis
) -> None:
    app = app_factory()
    schedules = Schedules(app)
    store = get_store(app)
    schedules.add("gone", "t.noop", rule_due_soon(schedules.store))
    at = _due_point(app, r, "gone")
    pid = point_id("gone", at)
    [claimed] = store.claim([store.keys.shard_of(pid)], "beat-A")
    assert [j.id for j in claimed.jobs] == [pid]
    assert schedules.delete("gone") is True  # the held point is left to its beat
    assert _fire(app, "beat-A", "gone", at, pid, None) is FireOutcome.STOPPED
    assert DelayQ(app).get(pid) is None and store.count() == 0


@pytest.mark.parametrize("change", ["delete", "pause", "update"])
def test_a_schedule_changed_while_its_point_is_leased(
    change: str, app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    schedules = Schedules(app)
    schedules.add("c", "t.add", rule_due_soon(schedules.store), (1, 2))
    at = _due_point(app, r, "c")
    pid = point_id("c", at)
    seen: list[list[str]] = []

    def hook(step: str, claimed: Any) -> None:
        """Between the claim and the publish (``Dispatcher.pause``): the change, once."""
        if step != "claimed":
            return
        beat.pause = None
        seen.append([job.id for _, job in claimed])
        if change == "delete":
            assert schedules.delete("c") is True
        elif change == "pause":
            schedules.pause("c")
        else:
            schedules.update("c", rule=3600, args=(7, 8))

    beat = dispatchers(app)
    beat.pause = hook
    beat.run_once()
    assert seen == [[pid]]
    assert DelayQ(app).get(pid) is None  # acked
    assert beat.stats.stale_acks == 0
    sent = [(m["id"], m["args"]) for m in messages(r)]
    current = schedules.get("c")
    if change == "delete":
        assert sent == []
        assert current is None and stored_ids(app, "c") == [] and DelayQ(app).count() == 0
    elif change == "pause":
        assert sent == []
        assert current is not None and not current.enabled
        assert (current.next_run, current.run_count, current.last_run) == (None, 0, None)
        assert stored_ids(app, "c") == []
    else:
        assert sent == [(pid, [1, 2])]  # the point as it was claimed
        assert current is not None and current.args == [7, 8]
        assert (current.run_count, current.last_run) == (0, None)  # not advanced by the old point
        assert current.next_run is not None and current.next_run.timestamp() > time.time() + HOUR - 60
        assert stored_ids(app, "c") == [point_id("c", ms_of(current.next_run))]
    pump(beat, seconds=0.05)  # later passes publish nothing more
    assert [(m["id"], m["args"]) for m in messages(r)] == sent


class Crash(BaseException):
    """The beat process dies (not an error the dispatcher could handle)."""


@pytest.mark.slow
def test_a_crash_between_claim_and_fire_gives_one_extra_run_and_skips_nothing(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    app = app_factory(delayq_reclaim_ttl=0.3)
    schedules = Schedules(app)
    schedules.add("cr", "t.noop", IntervalRule(1500, int(time.time() * 1000) - 1400))
    at = _due_point(app, r, "cr")
    pid = point_id("cr", at)

    class DiesAfterPublish(Dispatcher):
        """The beat process dies once its publishes reached the broker, before ack/fire."""

        def _settle(self, result: Any) -> None:
            raise Crash

    beat_a = dispatchers(app, cls=DiesAfterPublish)
    with pytest.raises(Crash):
        beat_a.run_once()  # claimed, published, died before its fire
    beat_a.close()
    assert ids_of(r, "cr") == [pid]
    job = DelayQ(app).get(pid)
    assert job is not None and job.state == "leased"
    assert schedules.get("cr").run_count == 0  # type: ignore[union-attr]

    assert job.lease_until is not None
    assert wait_for(lambda: server_ms(r) > ms_of(job.lease_until) + 5, timeout=5)
    beat_b = dispatchers(app)
    beat_b.run_once()
    assert ids_of(r, "cr") == [pid, pid]  # one extra publish of that point
    after = schedules.get("cr")
    assert after is not None and after.run_count == 1 and after.last_task_id == pid
    assert after.next_run is not None and ms_of(after.next_run) == at + 1500  # the next, not skipped
    pump(beat_b, seconds=5, until=lambda: len(ids_of(r, "cr")) >= 3)
    assert ids_of(r, "cr") == [pid, pid, point_id("cr", at + 1500)]


# -- missed-run policies ------------------------------------------------------------------------


@pytest.mark.slow
def test_missed_run_policies_after_downtime(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """Every 1 s, grace 2 s, no beat for ~10 s. Points are indexed k = 1, 2, ... on the grid
    anchor + 1000 k; the beat comes back mid-way between two points, so no point changes from
    'within grace' to 'missed' (or from future to due) while it catches up (500 ms of slack
    each side: a loaded machine's catch-up and sleep overshoot fit in it)."""
    schedules = Schedules(app)
    every, grace, max_missed = 1000, 2000, 3
    anchor = server_ms(r) - 500  # the first point is anchor + 1000 (k = 1)
    for policy in ("once", "skip", "all"):
        schedules.add(
            policy,
            "t.noop",
            IntervalRule(every, anchor),
            missed=policy,
            max_missed=max_missed,
            grace=grace / 1000,
        )
    for policy in ("once", "skip", "all"):
        assert ms_of(schedules.get(policy).next_run) == anchor + every  # type: ignore[union-attr]

    back = anchor + 10_500  # T - anchor = 500 (mod 1000): 500 ms from every boundary
    assert wait_for(lambda: server_ms(r) >= back, timeout=10, interval=0.002)
    t = server_ms(r)
    beat = dispatchers(app)

    def caught_up() -> bool:
        return all(ms_of(schedules.get(p).next_run) > t for p in ("once", "skip", "all"))  # type: ignore[union-attr]

    pump(beat, seconds=5, until=caught_up)
    assert caught_up()
    done = server_ms(r)
    # No point crossed a boundary (due, or missed) while the beat caught up: the expectations
    # below, computed at t, held for every decision it made.
    for boundary in (0, grace):
        assert (t - boundary - anchor) // every == (done - boundary - anchor) // every, (
            "the catch-up took too long (or the sleep overshot) for exact expectations"
        )
    pump(beat, seconds=4.0)

    def index(point: int) -> int:
        assert (point - anchor) % every == 0
        return (point - anchor) // every

    missed = {k for k in range(1, 40) if anchor + every * k < t - grace}
    within = {k for k in range(1, 40) if t - grace <= anchor + every * k <= t}
    assert len(missed) >= 8 and len(within) == 2
    first_future = max(within) + 1
    runs = {}
    for policy in ("once", "skip", "all"):
        sent = [m["due"] for m in messages(r) if m["id"].startswith("{" + policy + "}@")]
        ks = [index(d) for d in sent]
        assert len(set(ks)) == len(ks) and ks == sorted(ks), (policy, ks)
        future = [k for k in ks if k >= first_future]
        # Then it continues: every future point, on the grid, from the first one after the return.
        assert future == list(range(first_future, first_future + len(future))), (policy, ks)
        assert len(future) >= 3, (policy, ks)
        stored = schedules.get(policy)
        assert stored is not None and stored.run_count == len(ks)
        runs[policy] = [k for k in ks if k < first_future]

    assert runs["once"] == [1], runs  # one run for everything missed (the point that was stored)
    assert runs["skip"] == [], runs  # none of the missed points, nor the late ones
    # The max_missed most recent missed points, then the ones still within grace.
    assert runs["all"] == sorted(missed)[-max_missed:] + sorted(within), runs


# -- beat_schedule (sync_config) ------------------------------------------------------------------


def test_sync_config(app: Celery, r: redis.Redis) -> None:
    schedules = Schedules(app)
    entries: dict[str, Any] = {
        "every-30s": {"task": "t.noop", "schedule": 30.0},
        "cron": {"task": "t.add", "schedule": crontab(minute="*/5"), "args": (1, 2)},
        "delta": {"task": "t.noop", "schedule": schedule(timedelta(minutes=10)), "options": {"queue": "q"}},
    }
    report = sync_config(schedules, entries)
    assert report == {
        "added": ["every-30s", "cron", "delta"],
        "updated": [],
        "removed": [],
        "kept_by_api": [],
    }
    every = schedules.get("every-30s")
    assert every is not None and every.origin == "config"
    assert every.rule == IntervalRule(30_000, 0)  # anchored at the epoch: every beat agrees
    cron = schedules.get("cron")
    assert cron is not None and cron.rule == CronRule("*/5 * * * *", "UTC") and cron.args == [1, 2]
    delta = schedules.get("delta")
    assert delta is not None and delta.options == {"queue": "q"} and delta.rule == IntervalRule(600_000, 0)
    assert DelayQ(app).count() == 3
    raw = {name: raw_state(r, app, name) for name in entries}

    time.sleep(0.01)
    assert sync_config(schedules, entries) == {"added": [], "updated": [], "removed": [], "kept_by_api": []}
    assert {name: raw_state(r, app, name) for name in entries} == raw  # not even re-stored
    for name in entries:
        assert json.loads(raw[name][1] or "{}")["cur"] == stored_ids(app, name)[0]

    # Changed and removed entries.
    entries["cron"] = {"task": "t.add", "schedule": crontab(minute="*/5"), "args": (3, 4)}
    del entries["delta"]
    report = sync_config(schedules, entries)
    assert report == {"added": [], "updated": ["cron"], "removed": ["delta"], "kept_by_api": []}
    changed = schedules.get("cron")
    assert changed is not None and changed.args == [3, 4] and changed.created == cron.created
    assert changed.origin == "config"
    [point] = stored_ids(app, "cron")
    assert DelayQ(app).get(point).args == [3, 4]  # type: ignore[union-attr]
    assert schedules.get("delta") is None and stored_ids(app, "delta") == []
    assert raw_state(r, app, "every-30s") == raw["every-30s"]

    # A schedule made through the API with a config entry's name is never touched.
    schedules.add("mine", "t.add", 3600, (9, 9))
    mine = raw_state(r, app, "mine")
    entries["mine"] = {"task": "t.noop", "schedule": 60.0}
    report = sync_config(schedules, entries)
    assert report == {"added": [], "updated": [], "removed": [], "kept_by_api": ["mine"]}
    assert raw_state(r, app, "mine") == mine
    del entries["mine"]
    assert sync_config(schedules, entries)["removed"] == []
    assert raw_state(r, app, "mine") == mine
    assert schedules.count() == 3


def test_solar_is_not_storable(app: Celery, redis_url: str) -> None:
    sun = make_solar()
    assert isinstance(sun, solar)
    with pytest.raises(InvalidSchedule, match="cannot make a schedule rule from solar"):
        parse_rule(sun)
    before = snapshot(redis_url)
    with pytest.raises(InvalidSchedule):
        sync_config(Schedules(app), {"sun": {"task": "t.noop", "schedule": sun}})
    assert snapshot(redis_url) == before


def test_beat_scheduler_stores_beat_schedule_and_keeps_solar_in_memory(app: Celery) -> None:
    app.conf.beat_schedule = {
        "sun": {"task": "t.noop", "schedule": make_solar()},
        "five": {"task": "t.add", "schedule": crontab(minute="*/5"), "args": (1, 2)},
    }
    beat = Scheduler(app)
    try:
        assert "sun" in beat.schedule and "five" not in beat.schedule
        stored = Schedules(app).get("five")
        assert stored is not None and stored.origin == "config" and stored.args == [1, 2]
        assert Schedules(app).get("sun") is None
        time.sleep(0.01)
        second = Scheduler(app)  # another beat starting changes nothing
        try:
            assert Schedules(app).get("five") == stored
            assert "sun" in second.schedule
        finally:
            second.close()
    finally:
        beat.close()


# -- tick cost ----------------------------------------------------------------------------------


def _commandstats(client: redis.Redis) -> dict[str, int]:
    return {name: int(stats["calls"]) for name, stats in client.info("commandstats").items()}


@pytest.mark.slow
def test_a_pass_costs_the_same_with_10_or_2000_schedules_not_due(
    app_factory: AppFactory, r: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    passes = 20
    figures: dict[int, tuple[dict[str, float], float]] = {}
    for size in (10, 2_000):  # 2,000: a hundred times more, stored one by one as users do
        r.flushall()
        app = app_factory(delayq_max_sleep=0.01)  # every pass claims every shard
        schedules = Schedules(app)
        far = int(time.time() * 1000) + 2 * HOUR_MS
        for i in range(size):
            rule: Any = IntervalRule(6 * HOUR_MS, far + i) if i % 10 else "0 0 1 1 *"
            schedules.add(f"far-{i}", "t.noop", rule)
        assert schedules.count() == size and DelayQ(app).count() == size
        beat = Dispatcher(app)
        try:
            beat.run_once()  # subscribes, loads the scripts, writes its first heartbeat
            beat.beat.due_at = float("inf")  # no heartbeat (every 5 s) inside the measured passes
            before = _commandstats(r)
            elapsed = 0.0
            for _ in range(passes):
                time.sleep(0.012)
                # every shard claimed: no shard's marker read (the safety poll would skip them all,
                # their points being far off)
                beat.wake.next = [None] * beat.config.shards
                started = time.perf_counter()
                beat.run_once()
                elapsed += time.perf_counter() - started
            after = _commandstats(r)
        finally:
            beat.close()
        assert beat.stats.claimed == 0
        delta = {
            name[len("cmdstat_") :]: (after[name] - before.get(name, 0)) / passes
            for name in after
            if name != "cmdstat_info" and after[name] != before.get(name, 0)
        }
        assert delta["evalsha"] == get_store(app).config.shards  # every shard claimed, every pass
        figures[size] = (delta, elapsed / passes * 1000)
    (small, small_ms), (big, big_ms) = figures[10], figures[2_000]
    assert big == small, f"commands per pass grew with schedules not due: {small} -> {big}"
    with capsys.disabled():
        print(
            f"\n[tick cost] Dispatcher.run_once(), all 16 shards claimed, nothing due: "
            f"10 schedules: {sum(small.values()):g} Redis commands/pass ({_fmt(small)}), "
            f"{small_ms:.2f} ms/pass; 2,000 schedules: {sum(big.values()):g} commands/pass "
            f"({_fmt(big)}), {big_ms:.2f} ms/pass"
        )


def _fmt(delta: dict[str, float]) -> str:
    return ", ".join(f"{name} {count:g}" for name, count in sorted(delta.items()))


# -- fixes after review -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_dead_lettered_point_does_not_stop_its_schedule(
    app_factory: AppFactory, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A point whose publish keeps failing goes to the dead letters after PUBLISH_ATTEMPTS, and
    the schedule goes on with a fresh next point instead of stopping silently."""
    from kombu import compression

    def failing(body: bytes) -> bytes:
        raise RuntimeError("codec unavailable")

    compression.register(failing, lambda b: b, "application/x-delayq-failing-2", aliases=["failing2"])
    app = app_factory(delayq_reclaim_ttl=0.05)
    schedules = Schedules(app)
    schedules.add("doomed", "t.noop", 0.2, options={"compression": "failing2"})
    beat = dispatchers(app)
    pump(beat, seconds=20.0, until=lambda: sum(1 for i, _ in DelayQ(app).dead() if "{doomed}" in i) >= 2)
    dead = {job_id: rec for job_id, rec in DelayQ(app).dead() if job_id.startswith("{doomed}@")}
    assert len(dead) >= 2, dead  # a second point reached the beat: the schedule was re-armed
    assert all("publish failed 5 times" in rec["reason"] for rec in dead.values())
    current = schedules.get("doomed")
    assert current is not None and current.next_run is not None
    assert ms_of(current.next_run) > max(ms_of_point(d) for d in dead)


def ms_of_point(job_id: str) -> int:
    from datetime import datetime

    return round(datetime.fromisoformat(job_id.split("@", 1)[1].replace("Z", "+00:00")).timestamp() * 1000)


def test_cancel_or_reschedule_of_a_schedule_point_by_id_is_refused(app: Celery) -> None:
    schedules = Schedules(app)
    schedules.add("guarded", "t.noop", HOUR)
    (point,) = stored_ids(app, "guarded")
    dq = DelayQ(app)
    with pytest.raises(InvalidSchedule, match="next run of schedule 'guarded'"):
        dq.cancel(point)
    with pytest.raises(InvalidSchedule, match="Schedules"):
        dq.reschedule(point, time.time() + 60)
    assert stored_ids(app, "guarded") == [point]
    # An ordinary job whose id merely looks like one is not affected.
    job = app.tasks["t.noop"].apply_in(HOUR, task_id="{guarded}@not-a-point")
    assert dq.cancel(job.id) == "cancelled"


def test_run_now_id_with_at_sign_in_the_name(app: Celery) -> None:
    schedules = Schedules(app)
    schedules.add("a@b", "t.noop", HOUR)
    result = schedules.run_now("a@b")
    assert result.id.startswith("{a@b}@run-now-") and result.id.count("}") == 1


def test_nested_tuples_in_a_config_entry_do_not_look_changed(app: Celery) -> None:
    schedules = Schedules(app)
    entry = {"task": "t.add", "schedule": 60.0, "args": ((1, 2), (3,))}
    first = sync_config(schedules, {"tuples": entry})
    assert first["added"] == ["tuples"]
    before = stored_ids(app, "tuples")
    second = sync_config(schedules, {"tuples": entry})
    assert second["updated"] == [] and stored_ids(app, "tuples") == before


def test_custom_schedule_classes_are_not_stored(app: Celery) -> None:
    class Every(schedule):  # type: ignore[misc]
        pass

    class MyCron(crontab):  # type: ignore[misc]
        pass

    for spec in (Every(timedelta(seconds=5)), MyCron(minute="*/5")):
        with pytest.raises(InvalidSchedule, match="custom schedule class"):
            parse_rule(spec)


@pytest.mark.parametrize("args", ["ab", 5, {"x": 1}])
def test_args_must_be_a_list_or_tuple(app: Celery, args: Any) -> None:
    with pytest.raises(InvalidSchedule, match="args must be a list or tuple"):
        Schedules(app).add("bad-args", "t.noop", HOUR, args=args)
    assert Schedules(app).get("bad-args") is None


def test_a_one_shot_in_the_past_is_refused(app: Celery) -> None:
    from datetime import UTC, datetime

    with pytest.raises(InvalidSchedule, match="in the past"):
        Schedules(app).add("late", "t.noop", datetime.now(UTC) - timedelta(minutes=1))
    assert Schedules(app).get("late") is None
    future = Schedules(app).add("soon", "t.noop", datetime.now(UTC) + timedelta(minutes=1))
    assert future.next_run is not None


def test_a_cron_rule_object_runs_in_its_own_zone(app: Celery) -> None:
    stored = Schedules(app).add("tokyo", "t.noop", CronRule("0 9 * * *", "Asia/Tokyo"))
    assert stored.tz == "Asia/Tokyo"
    assert stored.next_run is not None
    from zoneinfo import ZoneInfo

    assert stored.next_run.astimezone(ZoneInfo("Asia/Tokyo")).hour == 9
