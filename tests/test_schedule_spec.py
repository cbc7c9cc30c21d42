"""``ScheduleSpec``: a schedule as a frozen, keyword-only value, checked when it is built, that
``Schedules.add``/``upsert`` take as it is or build from their fields."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import Schedules, ScheduleSpec
from celery_delayq.exceptions import InvalidSchedule, UnknownTask
from celery_delayq.store.facade import get_store


def spec(**fields: Any) -> ScheduleSpec:
    """A valid spec with ``fields`` in place of its own."""
    return ScheduleSpec(**{"name": "nightly", "task": "t.add", "rule": "0 3 * * *", "args": (1, 2), **fields})


def stored_definition(r: redis.Redis, app: Celery, name: str) -> dict[str, Any]:
    """The definition of ``name`` as stored, without its times (they differ from call to call)."""
    keys = get_store(app).keys
    raw = r.hget(keys.shard(keys.shard_of("{" + name + "}")).schedules, name)
    assert raw is not None, name
    definition: dict[str, Any] = json.loads(raw)
    del definition["created"], definition["updated"]
    return definition


def test_the_defaults_are_written_once_and_the_containers_are_copied() -> None:
    args, kwargs = [1, 2], {"k": "v"}
    made = ScheduleSpec(name="n", task="t.add", rule=60, args=args, kwargs=kwargs)
    args.append(3)
    kwargs["k"] = "changed"
    assert made.args == (1, 2) and made.kwargs == {"k": "v"}  # not the caller's list and dict
    assert (made.tz, made.enabled, made.missed, made.max_missed, made.grace) == (None, True, "once", 10, 60.0)
    assert (made.options, made.origin) == ({}, "api")
    assert ScheduleSpec(name="n", task="t.add", rule=60, args=None, kwargs=None).args == ()


def test_a_spec_is_frozen_and_keyword_only() -> None:
    made = spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.grace = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional"):
        ScheduleSpec("nightly", "t.add", "0 3 * * *")  # type: ignore[misc]
    assert spec() == spec() and spec(grace=5) != spec()


def test_a_task_object_is_kept_as_its_name(app: Celery) -> None:
    assert spec(task=app.tasks["t.add"]).task == "t.add"


# The messages are those of docs/schedules.md's Errors table (and add()'s, below).
BAD_FIELDS = [
    ({"missed": "never"}, "missed must be one of ('once', 'skip', 'all'), got 'never'"),
    ({"max_missed": 0}, "max_missed must be a whole number >= 1, got 0"),
    ({"max_missed": True}, "max_missed must be a whole number >= 1, got True"),
    ({"grace": -1}, "grace must be a finite number of seconds >= 0, got -1"),
    ({"name": ""}, "schedule name must be a non-empty string, got ''"),
    ({"name": "a{b}"}, "schedule name must be at most 200 characters without braces, got 'a{b}'"),
    ({"task": None}, "task must be a task or a task name, got None"),
    ({"rule": "0 9 * *"}, "cron expression must have 5 fields (or 6 with seconds last), got '0 9 * *'"),
    ({"rule": "61 * * * *"}, "malformed cron expression '61 * * * *'"),
    ({"rule": 0}, "interval must be a positive, finite number of seconds, got 0.0"),
    ({"rule": True}, "cannot make a schedule rule from bool True: "),
    ({"tz": "Mars/Base"}, "unknown timezone 'Mars/Base' (IANA names, e.g. 'America/New_York')"),
    ({"args": 5}, "schedule 'nightly': args must be a list or tuple, got 5"),
    ({"kwargs": [("k", 1)]}, "schedule 'nightly': kwargs must be a dict, got [('k', 1)]"),
    (
        {"args": (datetime(2030, 1, 1, tzinfo=UTC),)},
        "schedule 'nightly': args, kwargs and options must be JSON-serializable: "
        "Object of type datetime is not JSON serializable",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_FIELDS, ids=[str(bad) for bad, _ in BAD_FIELDS])
def test_a_bad_field_is_refused_when_the_spec_is_built_as_add_refuses_it(
    app: Celery, bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSchedule) as built:
        spec(**bad)
    assert str(built.value).startswith(message)
    fields = {"name": "nightly", "task": "t.add", "rule": "0 3 * * *", "args": (1, 2), **bad}
    with pytest.raises(InvalidSchedule) as added:
        Schedules(app).add(**fields)
    assert str(added.value) == str(built.value)
    assert Schedules(app).count() == 0


def test_replace_checks_the_copy_again() -> None:
    made = spec()
    assert dataclasses.replace(made, grace=5).grace == 5.0
    with pytest.raises(InvalidSchedule, match="missed must be one of"):
        dataclasses.replace(made, missed="sometimes")


def test_add_with_a_spec_and_with_its_fields_store_the_same_thing(app: Celery, r: redis.Redis) -> None:
    schedules = Schedules(app)
    fields: dict[str, Any] = {
        "tz": "Europe/Paris",
        "missed": "all",
        "max_missed": 3,
        "grace": 30,
        "options": {"queue": "reports"},
    }
    by_spec = schedules.add(ScheduleSpec(name="n", task="t.add", rule="0 9 * * 1-5", args=(4, 5), **fields))
    from_spec = stored_definition(r, app, "n")
    assert schedules.delete("n")
    by_position = schedules.add("n", app.tasks["t.add"], "0 9 * * 1-5", [4, 5], **fields)
    assert stored_definition(r, app, "n") == from_spec
    assert schedules.delete("n")
    by_keyword = schedules.add(name="n", task="t.add", rule="0 9 * * 1-5", args=(4, 5), **fields)
    assert stored_definition(r, app, "n") == from_spec
    assert by_spec.next_run == by_position.next_run == by_keyword.next_run
    assert from_spec["args"] == [4, 5] and from_spec["grace"] == 30.0 and from_spec["tz"] == "Europe/Paris"

    schedules.upsert(by_keyword.to_spec(grace=45))
    assert stored_definition(r, app, "n") == {**from_spec, "grace": 45.0}
    assert schedules.get("n").to_spec() == ScheduleSpec(  # type: ignore[union-attr]
        name="n", task="t.add", rule=by_spec.rule, args=(4, 5), **{**fields, "grace": 45}
    )


def test_add_refuses_a_spec_with_fields_and_fields_it_does_not_know(app: Celery) -> None:
    schedules = Schedules(app)
    with pytest.raises(TypeError, match=r"takes a ScheduleSpec or its fields, not both"):
        schedules.add(spec(), grace=5)
    with pytest.raises(TypeError, match=r"^Schedules.add\(\) got an unexpected keyword argument 'arg'$"):
        schedules.add("n", "t.add", 60, arg=(1, 2))
    with pytest.raises(TypeError, match=r"^Schedules.upsert\(\) got multiple values for argument 'task'$"):
        schedules.upsert("n", "t.add", 60, task="t.noop")
    with pytest.raises(TypeError, match=r"at most 5 positional arguments"):
        schedules.add("n", "t.add", 60, (1, 2), {}, "Europe/Paris")
    with pytest.raises(TypeError, match="rule"):
        schedules.add("n", "t.add")
    assert schedules.count() == 0


def test_the_app_checks_stay_with_add(app: Celery) -> None:
    """A spec knows no app: whether its task is registered is add()'s check (``check_task``)."""
    remote = ScheduleSpec(name="remote", task="other.service.task", rule=3600)
    with pytest.raises(UnknownTask, match=r"'other\.service\.task' is not registered"):
        Schedules(app).add(remote)
    assert Schedules(app).add(remote, check_task=False).task == "other.service.task"
