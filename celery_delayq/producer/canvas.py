"""Schedule any signature or canvas at a moment: :func:`apply_at` and :func:`apply_in`.

``apply_at(sig, eta)`` does, now, what ``sig.apply_async()`` does, with one
difference: where Celery would publish a task message, delayq stores that
message as a job due at ``eta``. Celery's own canvas code runs as usual (a
chain puts its rest in the first task's message, a group freezes its members'
ids under one group id, a chord sets its counter in the result backend), so
ids, results and the chord callback are Celery's. Each task message becomes a
normal delayq job of its task: ``DelayQ.cancel``/``reschedule`` by id and
``AsyncResult(id)`` work on it, and the task need not be a ``DelayedTask``.

What runs at ``eta``, as with ``apply_async`` at that moment:

- a signature: the task, with the signature's options (``.set(queue=...)``);
- a chain: its first task; the rest follow as Celery chains do;
- a group: every member;
- a chord: every header member; the callback runs once, after all of them.

Every message is built and checked before anything is stored, and all of a
canvas's jobs are stored in one round trip: bad input raises at the call and
stores nothing.

>>> from celery import Celery, group
>>> app = Celery("docs", broker="redis://127.0.0.1:6390/0", set_as_current=False)
>>> @app.task(name="docs.add")
... def add(x, y): ...
>>> apply_at(add.s(2, 2), "2030-01-01T00:00:00+00:00", countdown=5)
Traceback (most recent call last):
...
celery_delayq.exceptions.InvalidOptions: option 'countdown' conflicts with the due time given to apply_at
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery.backends.redis import RedisBackend
from celery.canvas import Signature, _chain, _chord, group

from ..config import DelayQConfig
from ..due import due_ms_from_delay, due_ms_from_eta
from ..exceptions import InvalidArguments, InvalidOptions, UnknownTask
from ..flow.gate import GATE_OPTIONS
from ..store.facade import get_store
from .build import build_envelopes, new_task_ids
from .options import TRANSPORT_OPTIONS, check_task_id, clean_options
from .plans import app_state
from .result import ScheduledResult
from .task import scheduled_results

__all__ = ["apply_at", "apply_in"]


def apply_at(sig: Any, eta: Any, **options: Any) -> Any:
    """Schedule signature or canvas ``sig`` to be applied at ``eta``.

    ``eta`` follows the rules of ``DelayedTask.apply_at`` (an aware datetime,
    a UNIX timestamp in seconds, an ISO-8601 string). ``options`` are
    ``sig.apply_async``'s, less ``eta``/``countdown`` and transport objects
    (``producer``, ``connection``, ``publisher``), which are refused;
    ``replace=True`` overwrites waiting jobs with the same ids.

    Returns what ``sig.apply_async()`` returns: a :class:`ScheduledResult` for
    a single task, the last task's ``AsyncResult`` for a chain, a
    ``GroupResult`` for a group, the callback's ``AsyncResult`` for a chord.
    """
    _check_signature(sig)
    return _schedule(sig, due_ms_from_eta(eta, sig.app), options)


def apply_in(sig: Any, delay: Any, **options: Any) -> Any:
    """Schedule ``sig`` to be applied after ``delay`` (seconds, or a ``timedelta``) counted from the
    Redis server's now (not this machine's clock); see :func:`apply_at`."""
    _check_signature(sig)
    due_ms_from_delay(delay, now_ms=0)  # bad input raises before any round trip
    base = None if sig.app.conf.task_always_eager else get_store(sig.app).server_now_ms()
    return _schedule(sig, due_ms_from_delay(delay, now_ms=base), options, base)


def refuse_gate_options(options: dict[str, Any]) -> None:
    """Refuse the gate options here (they would reach the message as unknown properties and
    gate nothing): a canvas's members get ids of Celery's making, not their key's. So are
    ``unique_for``, ``debounce`` and ``throttle`` (they would reach the message unread)."""
    for name in GATE_OPTIONS:
        if options.get(name) is not None:
            raise InvalidOptions(
                f"{name}: celery_delayq.apply_at/apply_in of a signature or canvas take no gate "
                f"options; use task.apply_at(eta, args, kwargs, {name}=...) for one job, or "
                "DelayQ(app).batch([...], eta, concurrency_limit=n) for many"
            )
    if options.get("unique_for") is not None:
        raise InvalidOptions(
            "unique_for: celery_delayq.apply_at/apply_in of a signature or canvas take no uniqueness "
            "window; use task.apply_at(eta, args, kwargs, task_id=..., unique_for=...)"
        )
    for name in ("debounce", "throttle"):
        if options.get(name) is not None:
            raise InvalidOptions(
                f"{name}: celery_delayq.apply_at/apply_in of a signature or canvas take no {name}; "
                f"use task.apply_async(args, kwargs, {name}=(key, ...))"
            )


def _check_signature(sig: Any) -> None:
    if not isinstance(sig, Signature):
        raise InvalidArguments(
            "celery_delayq.apply_at/apply_in take a Celery signature (task.s(...), task.si(...), "
            f"chain, group, chord) as first argument, got {type(sig).__name__}; "
            "for a task and its arguments use task.apply_at(eta, args, kwargs)"
        )


class _Jobs:
    """The delayq jobs a canvas makes: one per task message Celery would have published."""

    def __init__(self, app: Any, due_ms: int) -> None:
        self.app = app
        self.due_ms = due_ms
        self.state = app_state(app)
        self.max_payload = DelayQConfig.from_app(app).max_payload
        self.jobs: list[tuple[str, int, str]] = []
        self.names: list[str] = []
        self.chord = False  # a job is a chord's header member

    def add(self, task: Any, args: Any, kwargs: Any, task_id: Any, options: dict[str, Any]) -> Any:
        refuse_gate_options(options)
        for name in TRANSPORT_OPTIONS:  # Celery's canvas passes its producer to each member
            options.pop(name, None)
        options.pop("replace", None)
        given = options.pop("task_id", None) if task_id is None else task_id
        options.pop("task_id", None)
        job_id = new_task_ids(1)[0] if given is None else check_task_id(given, task.name)
        envelope = build_envelopes(
            self.app, task, [(job_id, self.due_ms, args, kwargs)], options,
            max_payload=self.max_payload, state=self.state,
        )[0]  # fmt: skip
        self.jobs.append((job_id, self.due_ms, envelope))
        self.chord = self.chord or options.get("chord") is not None
        self.names.append(task.name)
        return task.AsyncResult(job_id)


class _Deferred:
    """The task of a signature, as the scheduled canvas sees it: ``apply_async`` stores a job.

    Everything else (``name``, ``AsyncResult``, ...) is the task's own.
    """

    def __init__(self, task: Any, jobs: _Jobs) -> None:
        self._task = task
        self._jobs = jobs
        self.name = task.name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in ("_task", "_jobs"):
            # Not set yet (copy, pickle): no recursion through self._task.
            raise AttributeError(attr)
        return getattr(self._task, attr)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        return self._jobs.add(self._task, args, kwargs, task_id, options)


def _retyped(sig: Any, jobs: _Jobs) -> Any:
    """A clone of ``sig`` whose every task is :class:`_Deferred`: Celery's canvas code, run on
    it, calls ``_Deferred.apply_async`` wherever it would publish a task message."""
    app = jobs.app
    if isinstance(sig, dict) and not isinstance(sig, Signature):
        sig = Signature.from_dict(sig, app=app)
    if isinstance(sig, _chord):
        new = sig.clone()
        header = new.tasks
        if isinstance(header, group):
            new.kwargs["header"] = _retyped(header, jobs)
        else:
            new.kwargs["header"] = [_retyped(member, jobs) for member in header]
        new.kwargs["body"] = _retyped(new.body, jobs)
        return new
    if isinstance(sig, _chain | group):
        new = sig.clone()
        new.kwargs["tasks"] = [_retyped(member, jobs) for member in new.tasks]
        return new
    name = sig.task
    try:
        task = sig.type  # the task object it was made with, else app.tasks[name]
    except KeyError:
        raise UnknownTask(
            f"task {name!r} is not registered in app {app.main!r}: import the module that "
            "defines it before scheduling it"
        ) from None
    if isinstance(task, _Deferred):
        task = task._task
    new = sig.clone()
    # What Signature(task_object) sets, and clones keep; set on the clone to keep its class
    # (celery.map, celery.chunks, ... signatures have their own apply_async).
    new._type = _Deferred(task, jobs)
    return new


def _schedule(sig: Signature, due_ms: int, options: dict[str, Any], base: int | None = None) -> Any:
    """Store the jobs of ``sig`` due at ``due_ms``; with ``base`` (the server's now as estimated),
    the store gets the delay ``due_ms - base``, which the enqueue script adds to its ``TIME``."""
    app = sig.app
    options = dict(options)
    replace = bool(options.pop("replace", False))
    clean_options(options)  # refuses eta/countdown and transport objects given by the caller
    if app.conf.task_always_eager:
        # Celery's eager mode runs tasks at once and ignores eta; do the same.
        return sig.apply_async(**options)
    jobs = _Jobs(app, due_ms)
    # Celery's own apply_async walks the canvas; each task message lands in ``jobs``.
    result = _retyped(sig, jobs).apply_async(**options)
    if not jobs.jobs:
        return result
    if jobs.chord:
        _check_chord_counter_lives(app, due_ms)
    stored = jobs.jobs
    if base is not None:
        stored = [(job_id, due - base, envelope) for job_id, due, envelope in stored]
    statuses = get_store(app).enqueue(stored, replace=replace, relative=base is not None)
    if isinstance(sig, _chain | group | _chord) or len(jobs.jobs) != 1:
        return result
    one: ScheduledResult = scheduled_results(app, jobs.names[0], [jobs.jobs[0][0]], statuses)[0]
    return one


def _check_chord_counter_lives(app: Any, due_ms: int) -> None:
    """Refuse a chord whose counter would expire before its header runs.

    Celery's Redis result backend stores the chord's size when the chord is
    sent, for ``result_chord_expires`` seconds (``result_expires`` when unset,
    one day by default). A header member that finishes after that finds no
    size, and the callback never runs.
    """
    backend = app.backend
    if not isinstance(backend, RedisBackend):
        return
    lifetime = backend.chord_expires
    if not lifetime:
        return
    seconds = lifetime.total_seconds() if isinstance(lifetime, timedelta) else float(lifetime)
    ahead = (due_ms - get_store(app).server_now_ms()) / 1000.0
    if ahead >= seconds:
        raise InvalidOptions(
            f"chord due in {ahead:.0f} s, after result_chord_expires ({seconds:.0f} s): Celery's "
            "Redis result backend would drop the chord's counter before its header runs, and the "
            "callback would never run; raise result_chord_expires above the delay plus the "
            "header's run time"
        )
