"""Bad input at the call: delayq refuses at least what Celery's ``apply_async`` refuses.

One table of inputs goes to Celery's ``apply_async`` (published to a real Redis broker: it
raises at the call or not) and to each delayq entry point: ``apply_at``, ``apply_in``,
``apply_at_many`` and ``celery_delayq.apply_at``/``apply_in`` of a signature (whose
Celery twin is ``sig.apply_async``). Whatever Celery refuses, delayq refuses at the call,
with a ``DelayQError`` naming the option or argument and the task, and stores nothing.
The ``celery`` column is what Celery 5 did when this test was written; the test checks it
still does, so a change in Celery shows here.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery, group

import celery_delayq
from celery_delayq import DelayQ, DelayQError, Schedules
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.exceptions import (
    InvalidArguments,
    InvalidBatch,
    InvalidDueTime,
    InvalidOptions,
    InvalidSchedule,
    InvalidTaskId,
    PayloadTooLarge,
    ScheduleError,
)
from celery_delayq.producer.options import MAX_TASK_ID_LENGTH
from celery_delayq.store.facade import get_store
from tests.support.store import store_raw_job

ETA = 4_000_000_000.0  # 2096: never due during a test


@dataclass(frozen=True)
class Case:
    """One input: ``args``/``kwargs`` and ``options`` of the call."""

    label: str
    celery: bool  # True: Celery's apply_async raises at the call
    options: dict[str, Any] = field(default_factory=dict)
    args: Any = (1, 2)
    kwargs: Any = None
    names: str = ""  # what delayq's message must name ("" : the option's name)


CASES = [
    # Refused by Celery at the call (and stored, then dead-lettered at the due time, by delayq
    # before issue 13).
    Case("args a string", True, args="abc", names="args"),
    Case("args a set", True, args={1, 2}, names="args"),
    Case("args an int", True, args=5, names="args"),
    Case("kwargs a string", True, args=None, kwargs="abc", names="kwargs"),
    Case("kwargs a list", True, args=None, kwargs=[1, 2], names="kwargs"),
    Case("headers a string", True, {"headers": "notadict"}),
    Case("headers a list", True, {"headers": [1]}),
    Case("compression unknown", True, {"compression": "bogus"}),
    Case("queue an int", True, {"queue": 123}),
    Case("delivery_mode unknown", True, {"delivery_mode": "x"}),
    Case("stamped_headers a string", True, {"stamped_headers": "abc"}),
    Case("content_type given", True, {"content_type": "x"}),
    Case("serializer unknown", True, {"serializer": "bogus"}, names="bogus"),
    Case("expires not a date", True, {"expires": "notadate"}),
    Case("headers not JSON", True, {"headers": {"x": object()}}),
    Case("an option not JSON", True, {"bogusopt": object()}),
    # Accepted by Celery at the call, but they cannot work: refused by delayq.
    Case("delivery_mode 5", False, {"delivery_mode": 5}),  # RabbitMQ: PRECONDITION_FAILED
    Case("delivery_mode 0", False, {"delivery_mode": 0}),
    Case("delivery_mode past a byte", False, {"delivery_mode": 10**400}),
    Case("time_limit a string", False, {"time_limit": "x"}),
    Case("soft_time_limit a string", False, {"soft_time_limit": "x"}),
    Case("time_limit negative", False, {"time_limit": -1}),
    Case("time_limit NaN", False, {"soft_time_limit": float("nan")}),
    Case("task_id an int", False, {"task_id": 123}, names="task_id"),
    Case("task_id a lone surrogate", False, {"task_id": "ab\udc80"}, names="task_id"),
    Case("task_id too long", False, {"task_id": "x" * (MAX_TASK_ID_LENGTH + 1)}, names="task_id"),
]

#: Accepted by both: delayq must not be stricter where it has no reason to be.
ACCEPTED = [
    Case("args a list", False, args=[1, 2]),
    Case("args empty, kwargs given", False, args=(), kwargs={"x": 1, "y": 2}),
    Case("args false-ish", False, args="", kwargs={"x": 1, "y": 2}),
    Case("compression gzip", False, {"compression": "gzip"}),
    Case("compression alias zlib", False, {"compression": "zlib"}),
    Case("delivery_mode transient", False, {"delivery_mode": "transient"}),
    Case("delivery_mode 1", False, {"delivery_mode": 1}),
    Case("time limits numbers", False, {"time_limit": 30, "soft_time_limit": 20.5}),
    Case("headers a dict", False, {"headers": {"x": 1}}),
    Case("stamped_headers naming an option", False, {"stamped_headers": ["stamp"], "stamp": "v"}),
    Case("task_id at the length bound", False, {"task_id": "x" * MAX_TASK_ID_LENGTH}),
    Case("task_id not ASCII", False, {"task_id": "tâche-1"}),
]


def _raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # what Celery raises is what is recorded
        return exc
    return None


def _delayq_calls(app: Celery, case: Case) -> dict[str, Callable[[], Any]]:
    add = app.tasks["t.add"]
    options = dict(case.options)
    many_options = {k: v for k, v in options.items() if k != "task_id"}

    def sig() -> Any:
        return add.signature(case.args, case.kwargs)

    return {
        "apply_at": lambda: add.apply_at(ETA, case.args, case.kwargs, **options),
        "apply_in": lambda: add.apply_in(3600, case.args, case.kwargs, **options),
        "apply_at_many": lambda: add.apply_at_many(
            [(ETA, (1, 2), None), (ETA, case.args, case.kwargs)], **many_options
        ),
        "celery_delayq.apply_at": lambda: celery_delayq.apply_at(sig(), ETA, **options),
        "celery_delayq.apply_in": lambda: celery_delayq.apply_in(sig(), 3600, **options),
    }


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_refused_at_the_call_as_by_celery(app: Celery, case: Case) -> None:
    add = app.tasks["t.add"]
    celery_error = _raised(lambda: add.apply_async(case.args, case.kwargs, **case.options))
    assert (celery_error is not None) == case.celery, f"Celery's apply_async now gives {celery_error!r}"
    # A signature's args are tuple()d by Celery's Signature itself ('abc' is ('a', 'b', 'c')):
    # for the argument cases, the canvas entry points must refuse what sig.apply_async refuses
    # (there Celery's canvas code may raise its own error before delayq sees the arguments).
    arguments_case = case.args != (1, 2) or case.kwargs is not None
    sig_error = _raised(lambda: add.signature(case.args, case.kwargs).apply_async(**case.options))
    if not arguments_case:
        assert (sig_error is not None) == case.celery, f"Celery's sig.apply_async now gives {sig_error!r}"
    queue = DelayQ(app)
    for entry, call in _delayq_calls(app, case).items():
        if entry == "apply_at_many" and "task_id" in case.options:
            continue  # apply_at_many refuses any task_id; test_a_canvas_member_id_is_checked
        if entry.startswith("celery_delayq.") and arguments_case:
            error = _raised(call)
            assert (error is None) == (sig_error is None), (entry, error, sig_error)
            assert queue.count() == (0 if error else 1), entry
            if error is None:
                queue.purge()
            continue
        with pytest.raises(DelayQError) as info:
            call()
        message = str(info.value)
        named = case.names or next(iter(case.options))
        assert named in message, (entry, message)
        if not entry.startswith("celery_delayq."):  # (a canvas's own options name no task)
            assert "t.add" in message, (entry, message)
        assert queue.count() == 0, entry


@pytest.mark.parametrize("case", ACCEPTED, ids=[c.label for c in ACCEPTED])
def test_accepted_by_both(app: Celery, case: Case) -> None:
    add = app.tasks["t.add"]
    assert _raised(lambda: add.apply_async(case.args, case.kwargs, **case.options)) is None
    result = add.apply_at(ETA, case.args, case.kwargs, **case.options)
    assert DelayQ(app).get(result.id) is not None


def test_the_error_classes(app: Celery) -> None:
    add = app.tasks["t.add"]
    with pytest.raises(InvalidArguments, match=r"job '.*' of 't\.add': args must be a list or tuple"):
        add.apply_at(ETA, "abc")
    with pytest.raises(TypeError):  # InvalidArguments is also a TypeError, as Celery's own
        add.apply_at(ETA, "abc")
    queue_message = (
        r"option 'queue' must be a queue name or a kombu Queue, got int: 123 \(job '.*' of 't\.add'\)"
    )
    with pytest.raises(InvalidOptions, match=queue_message):
        add.apply_at(ETA, (1, 2), queue=123)
    with pytest.raises(InvalidOptions, match=r"option 'compression' must be .*\(the 2 jobs of 't\.add'\)"):
        add.apply_at_many([(ETA, (1, 2), None)] * 2, compression="bogus")
    with pytest.raises(InvalidTaskId, match="must be a string, got int: 123"):
        add.apply_at(ETA, (1, 2), task_id=123)
    surrogate = r"not UTF-8 text \(surrogates not allowed: '\\udc80' at position 2\)"
    with pytest.raises(InvalidTaskId, match=surrogate):
        add.apply_at(ETA, (1, 2), task_id="ab\udc80")
    with pytest.raises(InvalidTaskId, match=f"is {MAX_TASK_ID_LENGTH + 1} characters, over the limit"):
        add.apply_at(ETA, (1, 2), task_id="x" * (MAX_TASK_ID_LENGTH + 1))
    assert DelayQ(app).count() == 0


def test_a_task_default_is_checked(app: Celery) -> None:
    @app.task(base=celery_delayq.DelayedTask, name="t.limited", shared=False, time_limit="x")
    def limited() -> None: ...

    with pytest.raises(InvalidOptions, match=r"option 'time_limit' \(the task's default\) must be"):
        limited.apply_at(ETA)
    assert DelayQ(app).count() == 0


@pytest.mark.parametrize(
    "items, shown",
    [
        ([(ETA, (1, 2), None), (ETA, (1, 2))], "item 1 must be an (eta, args, kwargs) tuple, got tuple of 2"),
        ([(ETA, (1, 2), None, None, None)], "item 0 must be an (eta, args, kwargs) tuple, got tuple of 5"),
        ([(ETA, (1, 2), None), ETA], "item 1 must be an (eta, args, kwargs) tuple, got float"),
        ([(ETA, (1, 2), None), "abc"], "item 1 must be an (eta, args, kwargs) tuple, got str"),
        ([(ETA, (1, 2), None), (ETA, (1, 2), None), (ETA, "ab", None)], "args must be a list or tuple"),
    ],
)
def test_apply_at_many_item_shape(app: Celery, items: list[Any], shown: str) -> None:
    with pytest.raises(InvalidArguments) as info:
        app.tasks["t.add"].apply_at_many(items)
    assert shown in str(info.value)
    assert DelayQ(app).count() == 0
    # a list is as good as a tuple
    app.tasks["t.add"].apply_at_many([[ETA, [1, 2], {}]])
    assert DelayQ(app).count() == 1


def test_a_canvas_member_id_is_checked(app: Celery) -> None:
    add = app.tasks["t.add"]
    with pytest.raises(InvalidTaskId, match="must be a string"):
        celery_delayq.apply_at(add.s(1, 2).set(task_id=123), ETA)
    with pytest.raises(InvalidTaskId, match="over the limit"):
        celery_delayq.apply_at(group(add.s(1, 2), add.s(1, 3).set(task_id="y" * 600)), ETA)
    assert DelayQ(app).count() == 0


@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("where", ["headers", "kwargs", "args"])
def test_max_payload_covers_headers_and_arguments(app: Celery, many: bool, where: str) -> None:
    app.conf.delayq_max_payload = 4096
    add = app.tasks["t.add"]
    big = "a" * 5000
    args: Any = (1, 2)
    kwargs: Any = None
    options: dict[str, Any] = {}
    if where == "headers":
        options["headers"] = {"note": big}
    elif where == "kwargs":
        args, kwargs = (1,), {"y": big}
    else:
        args = (1, big)
    with pytest.raises(PayloadTooLarge, match=r"over delayq_max_payload \(4096\)"):
        if many:
            add.apply_at_many([(ETA, (1, 2), None), (ETA, args, kwargs)], **options)
        else:
            add.apply_at(ETA, args, kwargs, **options)
    assert DelayQ(app).count() == 0


def test_a_stored_unknown_compression_is_dead_lettered_at_once(
    app: Celery, dispatchers: Callable[..., Dispatcher]
) -> None:
    """docs/errors.md: an unknown compression (a job stored before the call refused it) is kombu's
    KeyError, a fault of the message: dead-lettered at the first attempt, not retried 5 times."""
    add = app.tasks["t.add"]
    result = add.apply_at(0, (1, 2), compression="gzip")
    store = get_store(app)
    stored = store.get(result.id)
    assert stored is not None and '"gzip"' in stored.envelope
    assert store.cancel(result.id)
    store_raw_job(app, result.id, 0, stored.envelope.replace('"gzip"', '"bogus"'))
    dispatchers(app).run_once()
    dead = dict(DelayQ(app).dead())
    assert list(dead) == [result.id]
    assert dead[result.id]["tries"] == 1
    assert dead[result.id]["reason"] == "publish failed: KeyError('bogus')"


# -- every documented check, for every extreme value (issue 24) --------------------------------

FAR = [math.inf, -math.inf, math.nan, 1e300, -1e300, 10**400, -(10**400), 2**63, -(2**63)]
FAR_TIMES = [
    datetime.max.replace(tzinfo=UTC),
    datetime.min.replace(tzinfo=UTC),
    timedelta.max,
    timedelta.min,
    timedelta(days=10**8),
]


def _extreme_calls(app: Celery) -> dict[str, tuple[Callable[[Any], Any], type[DelayQError]]]:
    """Each entry point and option the docs say is checked: ``name -> (call with the value,
    the documented error)``."""
    add = app.tasks["t.add"]
    sch, dq = Schedules(app), DelayQ(app)
    later = time.time() + 3600
    return {
        "apply_at eta": (lambda v: add.apply_at(v, (1, 2)), InvalidDueTime),
        "apply_in delay": (lambda v: add.apply_in(v, (1, 2)), InvalidDueTime),
        "apply_at_many eta": (lambda v: add.apply_at_many([(v, (1, 2), None)]), InvalidDueTime),
        "celery_delayq.apply_at eta": (lambda v: celery_delayq.apply_at(add.s(1, 2), v), InvalidDueTime),
        "celery_delayq.apply_in delay": (lambda v: celery_delayq.apply_in(add.s(1, 2), v), InvalidDueTime),
        "apply_async eta": (lambda v: add.apply_async((1, 2), eta=v), InvalidDueTime),
        "apply_async countdown": (lambda v: add.apply_async((1, 2), countdown=v), InvalidDueTime),
        "apply_in expires": (lambda v: add.apply_in(1, (1, 2), expires=v), InvalidOptions),
        "apply_at expires": (lambda v: add.apply_at(later, (1, 2), expires=v), InvalidOptions),
        "apply_at_many expires": (
            lambda v: add.apply_at_many([(later, (1, 2), None)], expires=v),
            InvalidOptions,
        ),
        "celery_delayq.apply_in expires": (
            lambda v: celery_delayq.apply_in(add.s(1, 2).set(expires=v), 1),
            InvalidOptions,
        ),
        "apply_in time_limit": (lambda v: add.apply_in(1, (1, 2), time_limit=v), InvalidOptions),
        "apply_in soft_time_limit": (lambda v: add.apply_in(1, (1, 2), soft_time_limit=v), InvalidOptions),
        "apply_in concurrency_limit": (
            lambda v: add.apply_in(1, (1, 2), concurrency_limit=v, concurrency_key="k"),
            InvalidOptions,
        ),
        "apply_in rate_limit": (
            lambda v: add.apply_in(1, (1, 2), rate_limit=v, rate_limit_key="k"),
            InvalidOptions,
        ),
        "batch concurrency_limit": (lambda v: dq.batch([add.s(1, 2)], concurrency_limit=v), InvalidOptions),
        "set_limit": (lambda v: dq.set_limit("k", v), InvalidOptions),
        "schedule rule": (lambda v: sch.add("s", "t.add", v, (1, 2)), InvalidSchedule),
        "schedule grace": (lambda v: sch.add("s", "t.add", 60, (1, 2), grace=v), InvalidSchedule),
        "schedule expires": (
            lambda v: sch.add("s", "t.add", 60, (1, 2), options={"expires": v}),
            ScheduleError,
        ),
    }


def _accepted(entry: str, value: Any) -> bool:
    """The extreme values that are valid: a negative or -inf countdown is "at once" (Celery's
    rule), a huge but finite time limit is Celery's to keep."""
    number = isinstance(value, int | float)
    if entry == "apply_async countdown":
        return number and value < 0
    if entry.endswith("time_limit"):
        return number and value in (1e300, 2**63)
    return False


def test_every_checked_option_is_checked_for_every_value(app_factory: Callable[..., Celery]) -> None:
    """Infinities, NaN, 1e300, ints past float's range (and past 2**53, what the scripts read
    exactly), datetimes and timedeltas at their limits, given to every due time, delay,
    countdown, ``expires``, time limit, concurrency limit (a job's, a batch's,
    ``set_limit``), rate and schedule rule or ``grace``: each raises the documented
    ``DelayQError`` with a message (never a raw ``OverflowError``/``ValueError``/``TypeError``,
    as ``apply_in(1, expires=1e300)`` did), and nothing is stored; the few valid ones are
    stored."""
    app = app_factory(delayq_intercept_eta=True)
    queue, sch = DelayQ(app), Schedules(app)
    for entry, (call, error) in _extreme_calls(app).items():
        for value in FAR + FAR_TIMES:
            if _accepted(entry, value):
                call(value)
                assert queue.count() == 1, (entry, value)
                queue.purge()
                continue
            try:
                call(value)
            except DelayQError as exc:
                assert isinstance(exc, error), (entry, value, exc)
                assert str(exc), (entry, value)
            except Exception as exc:  # pragma: no cover - what this test is for
                pytest.fail(f"{entry} = {value!r}: raw {type(exc).__name__}: {exc}")
            else:
                pytest.fail(f"{entry} = {value!r} was accepted")
            assert queue.count() == 0 and sch.count() == 0, (entry, value)


def test_operator_inputs_and_a_gone_batch_raise_delayq_errors(app: Celery) -> None:
    """docs/errors.md: what an operator types (a duration, a time, a cursor) and a batch that is
    no longer stored raise under ``DelayQError``, still catchable as the builtin they refine."""
    from celery_delayq.admin.listing import parse_cursor
    from celery_delayq.admin.timeparse import parse_duration, parse_when
    from celery_delayq.exceptions import BatchNotFound, InvalidInput
    from celery_delayq.flow.batch import BatchResult

    for bad in (
        lambda: parse_duration("5 parsecs"),
        lambda: parse_when("soonish", app),
        lambda: parse_cursor("x"),
    ):
        with pytest.raises(InvalidInput) as raised:
            bad()
        assert isinstance(raised.value, DelayQError) and isinstance(raised.value, ValueError)
    with pytest.raises(BatchNotFound, match="is not stored") as gone:
        BatchResult("no-such-batch", app).state()
    assert isinstance(gone.value, DelayQError) and isinstance(gone.value, LookupError)
    with pytest.raises(InvalidArguments, match="take a Celery signature"):
        celery_delayq.apply_in(60, "not a signature")  # type: ignore[arg-type]


# -- small bad inputs (issue 52): kwargs keys, an empty id, an id with a control character ---------


def _entry_points(app: Celery) -> dict[str, Callable[..., Any]]:
    """Every call that takes one job's kwargs and task_id: ``call(kwargs, **options)``."""
    add = app.tasks["t.add"]
    return {
        "apply_at": lambda kw, **o: add.apply_at(ETA, (1,), kw, **o),
        "apply_in": lambda kw, **o: add.apply_in(3600, (1,), kw, **o),
        "apply_at_many": lambda kw, **o: add.apply_at_many([(ETA, (1,), kw, o.get("task_id"))]),
        "celery_delayq.apply_at": lambda kw, **o: celery_delayq.apply_at(add.signature((1,), kw), ETA, **o),
        "intercepted apply_async": lambda kw, **o: add.apply_async((1,), kw, countdown=3600, **o),
    }


def test_kwargs_keys_that_are_not_strings_are_refused_at_the_call(app_factory: Callable[..., Celery]) -> None:
    """``kwargs={1: 2}``: one InvalidArguments line naming the key (was: a bare TypeError,
    ``keywords must be strings``, or with ``typing=False`` the key stored as ``"1"``)."""
    app = app_factory(delayq_intercept_eta=True)
    for entry, call in _entry_points(app).items():
        for kwargs in ({1: 2}, {"y": 2, (1, 2): 3}):
            with pytest.raises(InvalidArguments) as info:
                call(kwargs)
            message = str(info.value)
            assert "of 't.add': kwargs keys must be strings (argument names), got " in message, entry
            assert "\n" not in message
    for typing in (True, False):  # a later job of many (built the fast way), with and without typing
        app.tasks["t.add"].typing = typing
        with pytest.raises(
            InvalidArguments, match=r"kwargs keys must be strings \(argument names\), got int: 1"
        ):
            app.tasks["t.add"].apply_at_many([(ETA, (1,), {"y": 2}), (ETA, (1,), {1: 2})])
    assert DelayQ(app).count() == 0
    app.tasks["t.add"].apply_at(ETA, (1,), {"y": 2})  # string keys, as ever
    assert DelayQ(app).count() == 1


def test_an_empty_or_control_character_task_id_is_refused_at_the_call(
    app_factory: Callable[..., Celery],
) -> None:
    """``task_id=""`` was replaced by a generated id in silence (as Celery's apply_async does);
    an id with a newline or a tab was stored and printed raw. Both are InvalidTaskId now, at
    every call that takes an id, with a one-line message; a batch refuses them as its own ids."""
    app = app_factory(delayq_intercept_eta=True)
    add = app.tasks["t.add"]
    queue = DelayQ(app)
    for entry, call in _entry_points(app).items():
        with pytest.raises(InvalidTaskId, match=r"task_id of 't\.add' must not be empty \(leave task_id out"):
            call(None, task_id="")
        for bad, char in (("a\nb", r"'\\n' at position 1"), ("tab\there", r"'\\t' at position 3"),
                          ("nul\x00", r"'\\x00' at position 3"), ("del\x7f", r"'\\x7f'")):  # fmt: skip
            with pytest.raises(InvalidTaskId) as info:
                call(None, task_id=bad)
            message = str(info.value)
            assert re.search(rf"task_id '.*' of 't\.add' holds a control character \({char}", message), (
                entry,
                message,
            )
            assert "\n" not in message and "\t" not in message
    with pytest.raises(InvalidBatch, match=r"sets task_id=''"):
        queue.batch([add.s(1).set(task_id="")], ETA)
    with pytest.raises(InvalidBatch, match=r"^batch member 0 sets task_id='a\\nb': "):
        queue.batch([add.s(1).set(task_id="a\nb")], ETA)
    for batch_id in ("", "a\nb"):
        with pytest.raises(InvalidBatch, match="or a control character"):
            queue.batch([add.s(1)], ETA, batch_id=batch_id)
        with pytest.raises(InvalidBatch, match="or a control character"):
            queue.open_batch(batch_id=batch_id)
    assert queue.count() == 0
    for fine in ("tâche-1", "a b", "ü\u00a0x"):  # not ASCII, a space, a no-break space: kept
        assert add.apply_at(ETA, (1,), task_id=fine).id == fine
