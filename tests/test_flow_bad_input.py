"""Flow control's bad input (issue 15): every refusal is raised at the call, names what to
give instead, and leaves Redis as it was (no job, no batch, no gate key).

Each gate option goes through every entry point that takes it: ``apply_at``, ``apply_in``,
``apply_at_many``, the intercepted ``apply_async`` and, for the limit, ``DelayQ.batch`` and
``DelayQ.set_limit``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain, group

import celery_delayq
from celery_delayq import DelayQ
from celery_delayq.exceptions import (
    BatchExists,
    InvalidBatch,
    InvalidOptions,
    SerializationError,
    UnknownTask,
)
from celery_delayq.flow.gate import member_id

ETA = 4_000_000_000.0  # 2096: never due during a test


@pytest.fixture
def untouched(app: Celery, r: redis.Redis) -> Iterator[None]:
    """The test's refusals leave the database as it was (compared at the end)."""
    before = {key: r.type(key) for key in r.scan_iter()}
    yield
    after = {key: r.type(key) for key in r.scan_iter()}
    assert after == before
    assert DelayQ(app).count() == 0


def gated_calls(app: Celery, **gate: Any) -> dict[str, Callable[[], Any]]:
    """Each producer entry point, called with the gate options ``gate``."""
    add = app.tasks["t.add"]
    return {
        "apply_at": lambda: add.apply_at(ETA, (1, 2), **gate),
        "apply_in": lambda: add.apply_in(60, (1, 2), **gate),
        "apply_at_many": lambda: add.apply_at_many([(ETA, (1, 2), None)] * 2, **gate),
        "apply_async": lambda: add.apply_async((1, 2), **gate),
        "apply_async countdown": lambda: add.apply_async((1, 2), countdown=5, **gate),
    }


BAD_LIMITS = [0, -1, "3", 2.0, 1.5, True]


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_a_limit_that_is_not_a_whole_number_from_1(app: Celery, untouched: None, limit: Any) -> None:
    for entry, call in gated_calls(app, concurrency_key="k", concurrency_limit=limit).items():
        with pytest.raises(InvalidOptions, match=r"concurrency_limit=.*: a concurrency limit is a whole"):
            call()
        assert entry
    add = app.tasks["t.add"]
    with pytest.raises(InvalidOptions, match="a concurrency limit is a whole number >= 1"):
        DelayQ(app).batch([add.s(1, 2)], concurrency_limit=limit)
    with pytest.raises(InvalidOptions, match="a concurrency limit is a whole number >= 1"):
        DelayQ(app).set_limit("k", limit)


def test_a_key_without_a_limit_when_none_is_set(app: Celery, r: redis.Redis) -> None:
    before = {key: r.type(key) for key in r.scan_iter()}
    for entry, call in gated_calls(app, concurrency_key="tenant:7").items():
        with pytest.raises(InvalidOptions) as info:
            call()
        text = str(info.value)
        assert "concurrency_key='tenant:7' has no concurrency_limit" in text, entry
        assert "concurrency_limit=<n>" in text and "set_limit(key, n, new=True)" in text, entry
    assert {key: r.type(key) for key in r.scan_iter()} == before
    # a limit given, or one set for the key, and it is accepted
    DelayQ(app).set_limit("tenant:7", 3, new=True)
    for call in gated_calls(app, concurrency_key="tenant:7").values():
        call()
    assert DelayQ(app).count() == 6


@pytest.mark.parametrize("rate", ["fast", "0/s", "10/d", "1.5/s", 1.5, 0, True, "/s"], ids=repr)
def test_a_bad_rate(app: Celery, untouched: None, rate: Any) -> None:
    for entry, call in gated_calls(app, rate_limit_key="api", rate_limit=rate).items():
        with pytest.raises(InvalidOptions, match=r"rate_limit=.*: give \"<n>/s\", \"<n>/m\" or \"<n>/h\""):
            call()
        assert entry


@pytest.mark.parametrize(
    "gate, shown",
    [
        (
            {"concurrency_key": "a", "concurrency_limit": 1, "rate_limit_key": "b", "rate_limit": "1/s"},
            "rate_limit_key='b' differs from concurrency_key='a': a job has one gate key",
        ),
        ({"rate_limit_key": "a"}, "rate_limit_key='a' needs a rate_limit"),
        ({"rate_limit": "5/s"}, "rate_limit='5/s' needs a rate_limit_key"),
        ({"concurrency_limit": 2}, "concurrency_limit=2 needs a concurrency_key"),
        ({"concurrency_key": "a{b}", "concurrency_limit": 1}, "concurrency_key='a{b}': a key is a non-empty"),
        ({"concurrency_key": "", "concurrency_limit": 1}, "concurrency_key='': a key is a non-empty"),
        ({"concurrency_key": 5, "concurrency_limit": 1}, "concurrency_key=5: a key is a non-empty"),
        ({"rate_limit_key": "x" * 201, "rate_limit": 1}, "at most 200 characters"),
        ({"concurrency_key": "a", "concurrency_limit": 1, "priority": 256}, "priority=256: a priority is"),
    ],
)
def test_inconsistent_gate_options(app: Celery, untouched: None, gate: dict[str, Any], shown: str) -> None:
    for entry, call in gated_calls(app, **gate).items():
        with pytest.raises(InvalidOptions) as info:
            call()
        assert shown in str(info.value), entry


def test_a_given_task_id_without_the_keys_tag(app: Celery, untouched: None) -> None:
    add = app.tasks["t.add"]
    cap = {"concurrency_key": "k", "concurrency_limit": 1}
    calls = {
        "apply_at": lambda: add.apply_at(ETA, (1, 2), task_id="inv-1", **cap),
        "apply_in": lambda: add.apply_in(5, (1, 2), task_id="{j}inv-1", **cap),
        "apply_async": lambda: add.apply_async((1, 2), task_id="inv-1", rate_limit_key="k", rate_limit="1/s"),
    }
    for entry, call in calls.items():
        with pytest.raises(InvalidOptions) as info:
            call()
        text = str(info.value)
        assert "its id must begin with '{k}'" in text and "or leave task_id out" in text, entry


def test_a_signature_or_canvas_takes_no_gate_options(app: Celery, untouched: None) -> None:
    add = app.tasks["t.add"]
    calls = [
        lambda: celery_delayq.apply_at(add.s(1, 2), ETA, concurrency_key="k", concurrency_limit=1),
        lambda: celery_delayq.apply_in(add.s(1, 2), 60, rate_limit_key="k", rate_limit="1/s"),
        lambda: celery_delayq.apply_at(group(add.s(1, 2), add.s(3, 4).set(concurrency_key="k")), ETA),
    ]
    for call in calls:
        with pytest.raises(InvalidOptions, match=r"take no gate options; use task\.apply_at"):
            call()


# -- batches ---------------------------------------------------------------------------------


def test_an_empty_batch(app: Celery, untouched: None) -> None:
    for empty in ([], (), iter([])):
        with pytest.raises(InvalidBatch, match=r"a batch needs at least one member: give a list of"):
            DelayQ(app).batch(empty)


def test_members_that_are_not_a_list_of_signatures(app: Celery, untouched: None) -> None:
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    with pytest.raises(InvalidBatch, match="the members of a batch are a list of signatures, got Signature"):
        dq.batch(add.s(1, 2))
    with pytest.raises(InvalidBatch, match="the members of a batch are a list of signatures, got str"):
        dq.batch("t.add")
    with pytest.raises(InvalidBatch, match=r"batch member 2 is a str \('t.add'\): give one task's signature"):
        dq.batch([add.s(1, 2), add.s(2, 3), "t.add"])
    with pytest.raises(InvalidBatch, match=r"batch member 1 is a _chain .*a chain, group or chord is not"):
        dq.batch([add.s(1, 2), chain(add.s(1, 2), add.s(3))])
    with pytest.raises(InvalidBatch, match="batch member 0 sets concurrency_key: a batch's members count"):
        dq.batch([add.s(1, 2).set(concurrency_key="k")])
    with pytest.raises(InvalidBatch, match=r"batch member 0 sets task_id='x': the ids of a batch's jobs"):
        dq.batch([add.s(1, 2).set(task_id="x")])
    with pytest.raises(InvalidOptions, match=r"batch member 1 \('t.add'\): priority=300: a priority is"):
        dq.batch([add.s(1, 2), add.s(1, 2).set(priority=300)], priority=3)
    with pytest.raises(UnknownTask, match="batch member 1: task 'nope' is not registered"):
        dq.batch([add.s(1, 2), app.signature("nope")])


def test_a_member_that_cannot_be_serialized(app: Celery, r: redis.Redis, untouched: None) -> None:
    add = app.tasks["t.add"]
    members = [add.s(i, i) for i in range(1000)]
    members[637] = add.s(1, object())
    with pytest.raises(SerializationError) as info:
        DelayQ(app).batch(members, batch_id="bad")
    assert str(info.value).startswith("batch member 637 ('t.add'): cannot serialize the arguments of 't.add'")
    assert not [key for key in r.scan_iter() if "batch:bad" in key]
    assert DelayQ(app).batches() == [] and DelayQ(app).batch_result("bad") is None
    with pytest.raises(TypeError, match=r"batch member 2 \('t.add'\): .*argument"):
        DelayQ(app).batch([add.s(1, 2), add.s(1, 2), add.s(1, 2, 3)])


@pytest.mark.parametrize(
    "on_complete, shown",
    [
        ("t.noop", "on_complete must be a signature (task.s(...)), got str: 't.noop'"),
        (print, "on_complete must be a signature (task.s(...)), got builtin_function_or_method"),
        ({"task": "t.noop"}, "on_complete must be a signature (task.s(...)), got dict"),
    ],
)
def test_on_complete_not_a_signature(app: Celery, untouched: None, on_complete: Any, shown: str) -> None:
    with pytest.raises(InvalidBatch) as info:
        DelayQ(app).batch([app.tasks["t.add"].s(1, 2)], on_complete=on_complete)
    assert shown in str(info.value)


def test_on_complete_that_cannot_take_the_counts(app: Celery, untouched: None) -> None:
    add, noop = app.tasks["t.add"], app.tasks["t.noop"]
    dq = DelayQ(app)
    with pytest.raises(InvalidBatch, match=r"on_complete is a _chain .*give one task's signature"):
        dq.batch([add.s(1, 2)], on_complete=chain(noop.si(), noop.si()))
    with pytest.raises(InvalidBatch, match=r"sent as application/x-python-serialize: .*serializer='json'"):
        dq.batch([add.s(1, 2)], on_complete=add.s().set(serializer="pickle"))
    with pytest.raises(InvalidBatch, match=r"on_complete sets task_id='x'"):
        dq.batch([add.s(1, 2)], on_complete=add.s().set(task_id="x"))
    # It is called with (*its args, batch id, counts): a task that cannot take them is refused.
    with pytest.raises(TypeError, match=r"on_complete: noop\(\) takes 0 positional arguments but 2 were"):
        dq.batch([add.s(1, 2)], on_complete=noop.si())
    with pytest.raises(TypeError, match=r"on_complete: add\(\) takes 2 positional arguments but 3 were"):
        dq.batch([add.s(1, 2)], on_complete=add.s(1))


@pytest.mark.parametrize(
    "kwargs, error, shown",
    [
        ({"priority": 256}, InvalidOptions, "priority=256: a priority is a whole number from 0 to 255"),
        ({"priority": "high"}, InvalidOptions, "priority='high': a priority is a whole number"),
        ({"batch_id": "a|b"}, InvalidBatch, "batch_id='a|b': a batch id is a non-empty string"),
        ({"batch_id": ""}, InvalidBatch, "batch_id='': a batch id is a non-empty string"),
        ({"batch_id": 7}, InvalidBatch, "batch_id=7: a batch id is a non-empty string"),
        ({"eta": "soon"}, ValueError, "soon"),
    ],
)
def test_bad_batch_arguments(
    app: Celery, untouched: None, kwargs: dict[str, Any], error: type, shown: str
) -> None:
    with pytest.raises(error) as info:
        DelayQ(app).batch([app.tasks["t.add"].s(1, 2)], **kwargs)
    assert shown in str(info.value)


def test_a_taken_batch_id(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    DelayQ(app).batch([add.s(1, 2)], ETA, batch_id="same")
    before = {key: r.type(key) for key in r.scan_iter()}
    stored = r.hgetall(next(key for key in r.scan_iter() if key.endswith("batch:same")))
    with pytest.raises(BatchExists, match="batch 'same' is stored already: give another batch_id"):
        DelayQ(app).batch([add.s(3, 4), add.s(5, 6)], ETA, batch_id="same")
    assert {key: r.type(key) for key in r.scan_iter()} == before
    assert r.hgetall(next(key for key in r.scan_iter() if key.endswith("batch:same"))) == stored
    assert DelayQ(app).count() == 1 and DelayQ(app).get(member_id("same", 1)) is None


@pytest.mark.parametrize("key", ["", "a{b", "x|y", 5, "k" * 201], ids=repr)
def test_bad_keys_for_the_key_calls(app: Celery, untouched: None, key: Any) -> None:
    dq = DelayQ(app)
    for call in (
        lambda: dq.set_limit(key, 1),
        lambda: dq.clear_limit(key),
        lambda: dq.pause(key),
        lambda: dq.resume(key),
        lambda: dq.key_state(key),
    ):
        with pytest.raises(InvalidOptions, match="a key is a non-empty string of at most 200 characters"):
            call()
