"""``DelayedTask``: a Task base class with ``apply_at``, ``apply_in`` and ``apply_at_many``.

>>> from celery import Celery
>>> app = Celery("docs", broker="redis://127.0.0.1:6390/0")
>>> @app.task(base=DelayedTask)
... def remind(user_id): ...
>>> hasattr(remind, "apply_at")
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from celery import Task, shared_task

from ..config import DelayQConfig, configured, install
from ..due import (
    celery_expires,
    celery_naive_as_utc,
    due_iso,
    due_ms_from_delay,
    due_ms_from_eta,
    ms_to_datetime,
)
from ..exceptions import InvalidDueTime, InvalidOptions
from ..flow.gate import GATE_HEADER, GATE_OPTIONS, Gate, check_key, gated_id, key_tag, pop_gate
from ..store.envelope import DUE_HEADER, KEYED_HEADER
from ..store.facade import get_store
from ..store.jobs import EnqueueOutcome
from ..store.keys import is_point_id
from .build import build_envelopes, new_task_ids
from .options import TRANSPORT_OPTIONS, check_task_id, due_item, keyed_option, short_repr, unique_window_ms
from .plans import app_state
from .result import ScheduledResult

__all__ = [
    "DelayQTaskMixin",
    "DelayedTask",
    "add_gate_header",
    "carried_gate",
    "delayed_task",
    "job_ids",
    "retry_store_id",
    "scheduled_results",
    "take_gate",
]


def scheduled_results(
    app: Any,
    task_name: str,
    ids: list[str],
    statuses: list[tuple[EnqueueOutcome, int]],
    unique: bool = False,
) -> list[ScheduledResult]:
    """The results of jobs ``ids`` of ``task_name`` from ``Store.enqueue``'s ``(outcome, due ms)``;
    with ``unique`` (``unique_for`` was given), each result's :attr:`~ScheduledResult.outcome` is
    set, and a ``TAKEN`` one has no due time (its job is gone)."""
    if len(ids) == 1 and len(statuses) == 1:  # apply_at, apply_in: no comprehension
        ((status, stored_due),) = statuses
        done = [(ids[0], ms_to_datetime(stored_due), status is not EnqueueOutcome.KEPT)]
    else:
        done = [
            (task_id, ms_to_datetime(stored_due), status is not EnqueueOutcome.KEPT)
            for task_id, (status, stored_due) in zip(ids, statuses, strict=True)
        ]
    results = ScheduledResult.many(done, app.backend, task_name, app)
    if unique:
        for result, (status, _) in zip(results, statuses, strict=True):
            result.outcome = status.value
            if status is EnqueueOutcome.TAKEN:
                result.due, result.created = None, False
    return results


def retry_store_id(task_id: Any, options: dict[str, Any]) -> str | None:
    """The id a retry of a schedule's run is stored under: ``<point id>:retry-<n>``, or None
    (any other job is stored under its task id).

    Celery's ``retry()`` sends the task again with the same task id and ``retries=n``. For a
    run of a schedule that id is the point's (``{name}@<time>``): stored under it, the retry
    would take the place of the point while a beat still holds it, and stop the schedule. The
    retry keeps its task id in the message (so ``AsyncResult(point id)`` follows the retries
    to the final result, as in Celery) and is stored under an id of its own.

    >>> retry_store_id("{tick}@2026-01-01T00:00:00.000Z", {"retries": 2})
    '{tick}@2026-01-01T00:00:00.000Z:retry-2'
    >>> retry_store_id("{tick}@2026-01-01T00:00:00.000Z", {}), retry_store_id("abc", {"retries": 1})
    (None, None)
    """
    retries = options.get("retries")
    if is_point_id(task_id) and isinstance(retries, int) and not isinstance(retries, bool) and retries > 0:
        return f"{task_id}:retry-{retries}"
    return None


def take_gate(app: Any, options: MutableMapping[str, Any], *, ask_store: bool = True) -> Gate | None:
    """Take the gate options (``concurrency_key``, ``concurrency_limit``, ``rate_limit_key``,
    ``rate_limit``) out of ``options`` and check them (:func:`~..flow.gate.pop_gate`); None when the
    job is not gated.

    A ``concurrency_key`` without a ``concurrency_limit`` counts against the limit set for the
    key at run time (``DelayQ.set_limit``): the store is asked whether one is set (an explicit
    "no cap", ``set_limit(key, None)``, counts as set), and a key with none is refused.
    Everything else is checked first, so a bad option raises before any round trip.
    ``ask_store=False`` (eager mode) skips that question.
    """
    if all(options.get(name) is None for name in GATE_OPTIONS):
        for name in GATE_OPTIONS:
            options.pop(name, None)
        return None
    has_limit = None
    key = options.get("concurrency_key")
    if ask_store and key is not None and options.get("concurrency_limit") is None:
        pop_gate(dict(options))  # every other check, before the round trip
        has_limit, _ = get_store(app).key_limit(check_key(key))
    return pop_gate(options, has_limit=has_limit)


def carried_gate(options: Mapping[str, Any]) -> Gate | None:
    """The gate of a message header passed on in ``options["headers"]``: a retry
    (``self.retry``) passes its request's headers on, gate header included, so the retry of a
    gated job stays gated (and a batch member's retry counts in its batch once, when it
    ends). None when there is none, or it does not read."""
    headers = options.get("headers")
    if not isinstance(headers, Mapping) or GATE_HEADER not in headers:
        return None
    return Gate.from_header(headers[GATE_HEADER])


def job_ids(given: Sequence[str | None], gate: Gate | None) -> list[str]:
    """Each job's id: its ``given`` one, else a new uuid; under a ``gate``, each begins with the
    gate key's tag (a given id must already: :func:`~..flow.gate.gated_id`)."""
    fresh = iter(new_task_ids(given.count(None)))
    if gate is None:
        return [next(fresh) if job_id is None else job_id for job_id in given]
    tag = key_tag(gate.key)
    return [tag + next(fresh) if job_id is None else gated_id(gate.key, job_id) for job_id in given]


def add_gate_header(gate: Gate, options: dict[str, Any]) -> None:
    """Add ``gate``'s header to ``options``' ``headers`` (a header value that is not a mapping is
    left for the option check to refuse)."""
    headers = options.get("headers")
    if headers is None or isinstance(headers, Mapping):
        options["headers"] = {**(headers or {}), GATE_HEADER: gate.header()}


class DelayQTaskMixin:
    """The scheduling methods; mix into your own Task base: ``class Base(DelayQTaskMixin, MyTask)``."""

    name: str

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery's hook when the task is bound to ``app``: attach delayq's worker side to
        the app (:func:`celery_delayq.install`), so that a worker of the app gives gated
        tasks' slots back, records lateness and checks starts."""
        install(app)
        parent = getattr(super(), "on_bound", None)
        if parent is not None:
            parent(app)

    def _delayq_app(self) -> Any:
        return self._get_app()  # type: ignore[attr-defined]

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Celery's hook before each run: a message a beat published (it carries the
        ``delayq_due`` header) and has no ``eta`` gets ``self.request.eta`` = its due time
        (ISO-8601 UTC, to the millisecond, as ``delayq_publish_eta`` would write it), so the
        task reads what plain Celery's ``eta``/``countdown`` gives it; the message itself has no
        ``eta``, so the worker runs it at once, whatever its own clock says."""
        request = getattr(self, "request", None)
        due = getattr(request, DUE_HEADER, None)
        if request is not None and due is not None and getattr(request, "eta", None) is None:
            # a header that is not a number of ms leaves eta None
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                request.eta = due_iso(round(float(due)))
        super().before_start(task_id, args, kwargs)  # type: ignore[misc]

    def apply_at(self, eta: Any, args: Any = None, kwargs: Any = None, **options: Any) -> ScheduledResult:
        """Schedule the task to run at ``eta``: an aware datetime or a UNIX timestamp in seconds.

        ``options`` are ``apply_async``'s (queue, routing_key, priority, headers,
        expires, task_id, ...), and the gate's: ``concurrency_key`` with
        ``concurrency_limit`` (at most that many jobs of the key run at once, over every
        worker), ``rate_limit_key`` with ``rate_limit`` (``"100/s"``: releases of the key
        spaced over every beat); see docs/flow-control.md. A gated job's id begins with
        its key's tag, ``{<key>}``. The message is built and serialized now, so bad
        arguments or options raise here and nothing is stored. An ``eta`` in the
        past is delivered at once. ``expires`` in seconds counts from ``eta``.

        With ``task_id`` given, scheduling is idempotent: if a job with that id
        is still waiting, it is kept unchanged (its due time is not moved) and
        the result has ``created=False``; pass ``replace=True`` to overwrite it.
        """
        app = self._delayq_app()
        due_ms = due_ms_from_eta(eta, app)
        if "throttle" in options or "debounce" in options:
            _refuse_debounce(options, self.name, "apply_at")
            return self._delayq_keyed(args, kwargs, options, due_ms, relative=False)
        return self._delayq_schedule([(due_ms, args, kwargs)], options, app=app)[0]

    def apply_in(self, delay: Any, args: Any = None, kwargs: Any = None, **options: Any) -> ScheduledResult:
        """Schedule the task to run after ``delay`` (seconds, or a ``timedelta``), counted from the
        Redis server's now (not this machine's clock)."""
        app = self._delayq_app()
        delay_ms = due_ms_from_delay(delay, now_ms=0)  # bad input raises before any round trip
        if "throttle" in options or "debounce" in options:
            _refuse_debounce(options, self.name, "apply_in")
            return self._delayq_keyed(args, kwargs, options, delay_ms, relative=True)
        base = None if app_state(app).always_eager else get_store(app).server_now_ms()
        due_ms = due_ms_from_delay(delay, now_ms=base)
        return self._delayq_schedule([(due_ms, args, kwargs)], options, base)[0]

    def apply_at_many(self, items: Iterable[Any], **options: Any) -> list[ScheduledResult]:
        """Schedule many jobs in few round trips: ``items`` are ``(eta, args, kwargs)``, or
        ``(eta, args, kwargs, task_id)`` for a job with an id of its own (``None``: generated).

        Every item is validated and serialized before anything is written; one
        bad item raises and stores nothing. ``options`` apply to every job
        (a ``task_id`` option is refused here: give each item's id in the item).
        With ``unique_for``, every item must carry its id.
        """
        if options.get("task_id") is not None:
            raise InvalidOptions(
                "apply_at_many takes no task_id option: give each job's id as its item's fourth "
                "element, (eta, args, kwargs, task_id), or leave it out and one is generated"
            )
        for name in ("debounce", "throttle"):
            if options.get(name) is not None:
                raise InvalidOptions(
                    f"apply_at_many takes no {name} (one job a key at a time): call "
                    f"task.apply_async(args, kwargs, {name}=(key, ...)) for each job"
                )
        app = self._delayq_app()
        prepared: list[tuple[int, Any, Any]] = []
        given: list[str | None] = []
        for index, item in enumerate(items):
            job_id: Any = None
            if (type(item) is tuple or type(item) is list) and len(item) == 4:
                job_id = item[3]
                if job_id is not None:
                    check_task_id(job_id, self.name)
                item = item[:3]
            prepared.append(due_item(item, index, app))
            given.append(job_id)
        if options.get("unique_for") is not None and None in given:
            raise InvalidOptions(
                f"unique_for needs every job's own id: item {given.index(None)} of apply_at_many has "
                "none; give each item as (eta, args, kwargs, task_id)"
            )
        given_ids = given if any(job_id is not None for job_id in given) else None
        return self._delayq_schedule(prepared, options, given_ids=given_ids)

    def _delayq_schedule(
        self,
        items: list[tuple[int, Any, Any]],
        options: dict[str, Any],
        base: int | None = None,
        store_id: str | None = None,
        app: Any = None,
        given_ids: list[str | None] | None = None,
    ) -> list[ScheduledResult]:
        """Store ``items``: ``(due ms, args, kwargs)``. With ``base`` (the server's now as
        ``Store.server_now_ms`` estimates it), each due is ``base`` plus a delay, and the enqueue
        script stores the delay added to its own ``TIME``: the due time counts from the server's
        clock, and the envelope (an expiry counted from the due time) agrees with it to the
        estimate's error (milliseconds). With ``store_id`` (one item: a retry of a schedule's
        run, :func:`retry_store_id`), the job is stored under that id; its message keeps its
        task id. ``app``: the task's app, when the caller has it at hand. ``given_ids``
        (``apply_at_many``): an id or None (generated) per item."""
        if app is None:
            app = self._delayq_app()
        state = app_state(app)
        if options:
            options = dict(options)
            replace = bool(options.pop("replace", False))
            given_id = options.pop("task_id", None)
            if given_id is not None:  # ("" too: refused, where Celery would make one in silence)
                check_task_id(given_id, self.name)
            unique_for = options.pop("unique_for", None)
            unique_ms = None
            if unique_for is not None:
                has_id = given_id if given_ids is None else given_ids[0]
                unique_ms = unique_window_ms(unique_for, has_id, replace, self.name)
            gate = take_gate(app, options, ask_store=not state.always_eager) or carried_gate(options)
        else:  # no option: no gate (what take_gate and carried_gate find in an empty dict)
            options, replace, given_id, gate, unique_ms = {}, False, None, None, None
        if state.always_eager:
            # Celery's eager mode runs tasks at once and ignores eta; do the same.
            eager_ids = given_ids or [given_id] * len(items)
            return [
                self.apply_async(args, kwargs, task_id=job_id, **options)
                for job_id, (_, args, kwargs) in zip(eager_ids, items, strict=True)
            ]
        store = get_store(app)  # (its config is the app's: DelayQConfig.from_app)
        max_payload = store.config.max_payload
        if gate is not None:
            add_gate_header(gate, options)
        ids = job_ids([given_id] * len(items) if given_ids is None else given_ids, gate)
        shift = base or 0
        if len(items) == 1:  # one job (apply_at, apply_in): the same steps, without the lists
            ((due_ms, args, kwargs),) = items
            task_id = ids[0]
            one = [(task_id, due_ms, args, kwargs)]
            envelopes = build_envelopes(app, self, one, options, max_payload=max_payload, state=state)
            jobs = [(store_id or task_id, due_ms - shift, envelopes[0])]
        else:
            to_build = [(job_id, due, a, k) for job_id, (due, a, k) in zip(ids, items, strict=True)]
            envelopes = build_envelopes(app, self, to_build, options, max_payload=max_payload, state=state)
            jobs = [
                (store_id or task_id, due_ms - shift, envelope)
                for task_id, (due_ms, _, _), envelope in zip(ids, items, envelopes, strict=True)
            ]
        statuses = store.enqueue(jobs, replace=replace, relative=base is not None, unique_ms=unique_ms)
        return scheduled_results(app, self.name, ids, statuses, unique=unique_ms is not None)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """``Task.apply_async``; with ``delayq_intercept_eta`` on, eta/countdown go through delayq.

        Intercepted calls replace a waiting job with the same id (a retry
        reuses its task's id), and return a :class:`ScheduledResult`. A retry of a
        schedule's run is stored under an id of its own (:func:`retry_store_id`).

        A call with gate options (``concurrency_key``, ``rate_limit_key``, ...: see
        :meth:`apply_at`), or with a gated job's header (the retry of a gated job:
        :func:`carried_gate`), always goes through delayq, whatever ``delayq_intercept_eta``
        says (the gate is delayq's): without eta or countdown it is due at once.
        """
        if options.get("debounce") is not None or options.get("throttle") is not None:
            return self._delayq_keyed_async(args, kwargs, task_id, options)
        if options.get("unique_for") is not None:  # Celery would carry it off unread
            raise InvalidOptions(
                "unique_for is an option of apply_at and apply_in: apply_async with eta or countdown "
                "replaces a waiting job with the same id (a retry reuses its task's id), and one without "
                "them is sent to the broker at once"
            )
        eta = options.get("eta")
        countdown = options.get("countdown")
        app = self._delayq_app()
        if app.conf.task_always_eager:
            take_gate(app, options, ask_store=False)  # checked, then dropped: eager runs at once
        else:
            gated = any(options.get(name) is not None for name in GATE_OPTIONS) or carried_gate(options)
            timed = eta is not None or bool(countdown)
            if gated or (timed and _intercepts(app)):
                return self._delayq_intercept(args, kwargs, task_id, options)
        return super().apply_async(args, kwargs, task_id=task_id, **options)  # type: ignore[misc]

    def _delayq_intercept(self, args: Any, kwargs: Any, task_id: str | None, options: dict[str, Any]) -> Any:
        """Store what ``apply_async`` was given (:meth:`apply_async`)."""
        app = self._delayq_app()
        eta = options.pop("eta", None)
        countdown = options.pop("countdown", None)
        expires = options.get("expires")
        if expires is not None:  # seconds count from the call: the server's now
            now = ms_to_datetime(get_store(app).server_now_ms())
            options["expires"] = celery_expires(expires, now=now)
        # As in Celery (as_task_v2), a non-zero countdown wins over eta, and a countdown
        # <= 0 (or an eta in the past) means "run at once". (Clamp with a comparison, not
        # max(): max(0.0, nan) is 0.0, and NaN must be refused.) Neither: at once (gated).
        base = None
        if countdown or eta is None:  # counted from the server's now (by the enqueue script)
            seconds = _countdown_seconds(countdown)
            base = get_store(app).server_now_ms()
            due_ms = due_ms_from_delay(0.0 if seconds < 0 else seconds, now_ms=base)
        else:
            # A naive eta is UTC, as Celery's worker reads it.
            due_ms = due_ms_from_eta(celery_naive_as_utc(eta), app)
        # Celery's canvas (group, chord) passes its own producer to every member: the
        # job is published later by the beat's, so transport objects are dropped here.
        # (apply_at still refuses them: there the caller passed them on purpose.)
        for name in TRANSPORT_OPTIONS:
            options.pop(name, None)
        options["replace"] = True
        options["task_id"] = task_id
        store_id = retry_store_id(task_id, options)
        headers = options.get("headers")
        if store_id is not None and isinstance(headers, Mapping) and GATE_HEADER in headers:
            # A run of a schedule with an overlap policy held the schedule's slot (given back
            # as "retry" when this run ends). Its retry is stored under an id its message does
            # not carry, so its worker could not give back a slot taken under that id: it runs
            # outside the slot (docs/schedules.md, "Overlapping runs").
            options["headers"] = {name: value for name, value in headers.items() if name != GATE_HEADER}
        return self._delayq_schedule([(due_ms, args, kwargs)], options, base, store_id)[0]

    def _delayq_keyed_async(self, args: Any, kwargs: Any, task_id: Any, options: dict[str, Any]) -> Any:
        """``apply_async(..., debounce=...)`` or ``throttle=...``: due after ``countdown`` (or at
        ``eta``, or at once; debounce: after its wait)."""
        if task_id is not None:
            options["task_id"] = task_id  # (refused by _delayq_keyed, naming the option)
        options = dict(options)
        eta, countdown = options.pop("eta", None), options.pop("countdown", None)
        for name in TRANSPORT_OPTIONS:  # (Celery's canvas passes its producer: the beat publishes)
            options.pop(name, None)
        if "debounce" in options and (eta is not None or countdown is not None):
            raise InvalidOptions(
                f"debounce of {self.name!r} sets the due time itself (its wait after each call): "
                "give no eta or countdown"
            )
        if countdown or eta is None:
            seconds = _countdown_seconds(countdown)
            return self._delayq_keyed(args, kwargs, options, round(max(seconds, 0.0) * 1000), relative=True)
        due_ms = due_ms_from_eta(celery_naive_as_utc(eta), self._delayq_app())
        return self._delayq_keyed(args, kwargs, options, due_ms, relative=False)

    def _delayq_keyed(
        self, args: Any, kwargs: Any, options: dict[str, Any], due_ms: int, relative: bool
    ) -> ScheduledResult:
        """Store one job debounced or throttled by a key (``lua/keyed.lua``; see
        docs/one-off.md, "Debounce and throttle"). ``due_ms``: the job's due time, or its delay
        with ``relative`` (throttle; a debounced job is due after its wait)."""
        app = self._delayq_app()
        options = dict(options)
        keyed = keyed_option(options, self.name)
        assert keyed is not None
        mode, key, first_ms, second_ms = keyed
        for name in ("task_id", "replace", "unique_for", *GATE_OPTIONS):
            if options.get(name) is not None and options.get(name) is not False:
                raise InvalidOptions(
                    f"{mode} of {self.name!r} takes no {name}: a {mode}d job's id is made from its "
                    f"key, and it is neither gated nor kept by a uniqueness window"
                )
        state = app_state(app)
        if state.always_eager:  # Celery's eager mode runs tasks at once and ignores eta
            return self.apply_async(args, kwargs, **options)  # type: ignore[no-any-return]
        headers = options.get("headers")
        if headers is None or isinstance(headers, Mapping):
            # the mode alone (the key is the id's tag): the same options for every key, so the
            # message plan made for the first call serves the others (producer/plans.py)
            options["headers"] = {**(headers or {}), KEYED_HEADER: mode}
        store = get_store(app)
        job_id = key_tag(key) + new_task_ids(1)[0]
        # debounce: due its wait after the call; throttle: due_ms (a delay with ``relative``)
        first, relative = (first_ms, True) if mode == "debounce" else (due_ms, relative)
        estimate = store.server_now_ms() + first if relative else first  # (what expires counts from)
        envelope = build_envelopes(
            app,
            self,
            [(job_id, estimate, args, kwargs)],
            options,
            max_payload=store.config.max_payload,
            state=state,
        )[0]
        outcome, stored_due, replaced = store.enqueue_keyed(
            mode, key, job_id, envelope, first, second_ms, relative
        )
        (result,) = scheduled_results(app, self.name, [job_id], [(outcome, stored_due)])
        result.outcome, result.replaced = outcome.value, replaced
        if outcome is EnqueueOutcome.THROTTLED:
            result.due, result.created = None, False
        return result


def _intercepts(app: Any) -> bool:
    """Whether ``app`` sends its mixin tasks' ``apply_async(eta=/countdown=)`` through delayq.

    An app without a store (no ``delayq_url``, a broker that is not Redis: a test app, or a
    second app a shared task binds to as well) is plain Celery: False, unless it asks for
    the interception, which then raises the settings' ``ConfigurationError`` (no store)."""
    if configured(app):
        return DelayQConfig.from_app(app).intercept_eta
    if app.conf.get("delayq_intercept_eta"):
        DelayQConfig.from_app(app)  # raises: delayq_url is not set and the broker is not Redis
    return False


def _refuse_debounce(options: Mapping[str, Any], name: str, method: str) -> None:
    """``debounce`` given to ``apply_at``/``apply_in``: it sets the due time itself."""
    if options.get("debounce") is not None:
        raise InvalidOptions(
            f"debounce of {name!r} sets the due time itself (each call: now + its wait), so it is an "
            f"option of apply_async, not {method}: task.apply_async(args, kwargs, debounce=(key, wait))"
        )


def _countdown_seconds(countdown: Any) -> float:
    """An intercepted ``countdown`` as seconds; one that is not a number of seconds, or is
    past float's range, is :class:`InvalidDueTime` (Celery's ``as_task_v2`` fails on it too)."""
    if countdown is None or countdown is False:
        return 0.0
    if isinstance(countdown, bool) or not isinstance(countdown, int | float):
        raise InvalidDueTime(f"countdown must be a number of seconds, got {type(countdown).__name__}")
    try:
        return float(countdown)
    except OverflowError as exc:  # an int past float's range: at once when negative
        if countdown < 0:
            return 0.0
        raise InvalidDueTime(f"countdown is past year 9999: {short_repr(countdown)} s") from exc


class DelayedTask(DelayQTaskMixin, Task):  # type: ignore[misc]
    """Task base class with ``apply_at``/``apply_in``/``apply_at_many``: ``@app.task(base=DelayedTask)``."""

    abstract = True


def delayed_task(*args: Any, **options: Any) -> Any:
    """A task decorator with ``DelayedTask`` as base.

    ``@delayed_task(app)`` registers with ``app``; ``@delayed_task`` or
    ``@delayed_task(name=...)`` makes a shared task (like ``shared_task``).
    Other keyword arguments are the usual ``@app.task`` options.

    >>> from celery import Celery
    >>> app = Celery("docs", broker="redis://127.0.0.1:6390/0")
    >>> @delayed_task(app, name="docs.ping")
    ... def ping(): ...
    >>> isinstance(ping, DelayedTask)
    True
    """
    base = options.setdefault("base", DelayedTask)
    if not (isinstance(base, type) and issubclass(base, DelayQTaskMixin)):
        raise InvalidOptions(
            f"delayed_task(base={base!r}): the base must derive from DelayQTaskMixin (as DelayedTask "
            "does), or the task would have no apply_at; use class MyBase(DelayQTaskMixin, YourBase)"
        )
    if len(args) == 1 and callable(args[0]) and not hasattr(args[0], "conf"):
        return shared_task(**options)(args[0])
    if args and hasattr(args[0], "conf"):
        app = args[0]
        decorate: Callable[..., Any] = app.task(*args[1:], **options)
        return decorate
    return shared_task(*args, **options)
