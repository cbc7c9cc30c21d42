"""Worker side: how late delayq messages start (``delayq_record_lateness``).

With ``delayq_record_lateness = True`` in the worker's app, every task whose message carries
the ``delayq_due`` header (every message a beat publishes) adds ``start - due`` to an
in-memory :class:`~celery_delayq.store.lateness.Histogram`. A background thread of each worker
process adds those counts to ``<prefix>:lateness:start`` at most every ``FLUSH_EVERY``
seconds, in one pipeline (nothing is sent while no such task ran). Messages without the
header (plain Celery tasks) and broker ETA messages (``request.eta`` set to another time
than the due time: a retry Celery sent with a countdown carries the headers of the message
it retries) are ignored. A message whose ``eta`` is its due time
(``delayq_publish_eta``) is counted.

How it is switched on: an app with delayq has the :class:`DelayQWorker` bootstep in its
worker steps (:func:`celery_delayq.install` adds it; a ``DelayedTask`` bound to the app does
so). When a worker of that app is built, the step reads the app's settings and, when
``delayq_record_lateness`` is on, calls :func:`install`. Importing :mod:`celery_delayq`
connects nothing. The ``task_prerun`` receiver, connected for that app's tasks only, then
runs in the thread or process that runs the task: pool threads share one histogram (it has a
lock), and each prefork child starts its own flusher thread at its first recorded task. On
shutdown (``worker_process_shutdown`` in a prefork child, ``worker_shutdown`` otherwise) what
is left is flushed. ``celery_delayq.worker.lateness.install(app)`` records whatever the setting says.

>>> from celery import Celery
>>> app = Celery(broker="redis://127.0.0.1:6390/0", set_as_current=False)
>>> recorder = install(app)
>>> class Request:
...     delayq_due, eta = round(time.time() * 1000) - 300, None
>>> class Task:
...     request = Request()
>>> Task.app = app
>>> recorder.record(Task)
True
>>> recorder.histogram.snapshot().quantile(0.5)
500.0
>>> recorder.histogram.pending.clear()  # (no Redis behind this example)
>>> uninstall(app)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

import click
from celery import bootsteps
from celery.signals import task_prerun, worker_process_shutdown, worker_shutdown

from ..config import DEFAULTS, DelayQConfig, configured, intercept_line, setting_name
from ..exceptions import ConfigurationError
from ..setting_values import flag
from ..store.connection import error_text
from ..store.envelope import DUE_HEADER
from ..store.facade import get_store
from ..store.lateness import Histogram, key_for
from . import starts

__all__ = [
    "FLUSH_EVERY",
    "DelayQWorker",
    "LatenessRecorder",
    "WorkerConfigurationError",
    "install",
    "recorder_for",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: Seconds between two flushes of a worker process's start lateness (at most).
FLUSH_EVERY = 1.0

_recorders: dict[int, LatenessRecorder] = {}  # id(app) -> its recorder
_lock = threading.Lock()


class LatenessRecorder:
    """Records due -> start of the delayq messages one app's worker runs, per process."""

    def __init__(self, app: Any) -> None:
        self.app = app
        config = DelayQConfig.from_app(app)
        self.key = key_for(config.prefix, "start")
        self.histogram = Histogram()
        self._pid = -1  # the process whose flusher thread runs
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._failing = False

    def record(self, task: Any) -> bool:
        """Count ``task``'s lateness when its request carries ``delayq_due``; whether it did."""
        request = getattr(task, "request", None)
        due = getattr(request, DUE_HEADER, None)
        if due is None:
            return False
        try:
            due = float(due) / 1000.0  # (ms)
            late_ms = (time.time() - due) * 1000.0
        except (TypeError, ValueError):
            return False
        if not _eta_is_due(getattr(request, "eta", None), due):
            return False
        if self._pid != os.getpid():
            self._start_flusher()
        self.histogram.observe(late_ms)
        return True

    def _start_flusher(self) -> None:
        """(Re)start the flusher thread in this process: after a fork only the forking thread
        exists in the child, and what the parent had not flushed is the parent's."""
        with self._start_lock:
            pid = os.getpid()
            if self._pid == pid:
                return
            if self._pid != -1:
                self.histogram = Histogram()
            self._pid = pid
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name="delayq-lateness", daemon=True
            )
            self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(FLUSH_EVERY):
            self.flush()

    def flush(self) -> int:
        """Send what was recorded (one pipeline); never raises. Returns how many were sent."""
        if not self.histogram.pending:
            return 0
        try:
            sent = self.histogram.flush(get_store(self.app), self.key)
        except Exception as exc:  # Redis away: the counts are kept for the next flush
            if not self._failing:
                logger.warning(
                    "delayq: cannot write task start lateness to Redis (%s); kept for the next try",
                    error_text(exc),
                )
            self._failing = True
            return 0
        self._failing = False
        return sent

    def stop(self) -> None:
        """Stop the flusher thread of this process and flush what is left."""
        self._stop.set()
        self.flush()


def install(app: Any) -> LatenessRecorder:
    """Record due -> start lateness of the delayq messages ``app``'s worker runs (whatever
    ``delayq_record_lateness`` says); returns the recorder (the same one when called again).
    Its receivers act on ``app``'s tasks only."""
    uid = f"celery_delayq.lateness:{id(app)}"
    with _lock:
        recorder = _recorders.get(id(app))
        if recorder is not None:
            return recorder
        recorder = _recorders[id(app)] = LatenessRecorder(app)

    def prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
        task = task or sender
        if getattr(task, "app", None) is app:
            _record(recorder, task)

    def shutdown(**_: Any) -> None:
        recorder.stop()

    task_prerun.connect(prerun, weak=False, dispatch_uid=uid)
    worker_process_shutdown.connect(shutdown, weak=False, dispatch_uid=uid)
    worker_shutdown.connect(shutdown, weak=False, dispatch_uid=uid)
    return recorder


def uninstall(app: Any) -> None:
    """Stop recording for ``app`` (flushing what is left)."""
    uid = f"celery_delayq.lateness:{id(app)}"
    with _lock:
        recorder = _recorders.pop(id(app), None)
    if recorder is not None:
        for signal in (task_prerun, worker_process_shutdown, worker_shutdown):
            signal.disconnect(dispatch_uid=uid)
        recorder.stop()


def recorder_for(app: Any) -> LatenessRecorder | None:
    """The recorder :func:`install` made for ``app``, if any."""
    return _recorders.get(id(app))


def _eta_is_due(eta: Any, due: float) -> bool:
    """Whether a request's ``eta`` is its own delayq due time: none (the default), or the
    same instant to the millisecond (``delayq_publish_eta``). A retry Celery sent with a
    countdown has an ``eta`` of its own and the ``delayq_due`` of the attempt it retries.

    >>> _eta_is_due(None, 1.0), _eta_is_due("1970-01-01T00:00:01+00:00", 1.0)
    (True, True)
    >>> _eta_is_due("1970-01-01T00:00:04+00:00", 1.0)
    False
    """
    if eta is None:
        return True
    try:
        when = eta if isinstance(eta, datetime) else datetime.fromisoformat(str(eta))
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)  # Celery reads a naive eta as UTC
        return abs(when.timestamp() - due) < 0.001
    except (TypeError, ValueError, OverflowError):
        return False


def _record(recorder: LatenessRecorder, task: Any) -> None:
    try:
        recorder.record(task)
    except Exception:  # never fail a task for a measurement
        logger.debug("delayq: lateness not recorded", exc_info=True)


def _setting(app: Any, name: str) -> bool:
    try:
        value = app.conf[name]
    except KeyError:
        value = DEFAULTS[name][0]
    return flag(name, value)


class WorkerConfigurationError(ConfigurationError, click.ClickException):
    """A bad ``delayq_*`` setting (or, with ``delayq_strict_settings``, an unknown name) found
    as a worker of the app is built. Also a :class:`click.ClickException`, so that
    ``celery worker`` ends with one line, ``Error: delayq: <the problem>``, and exit code 1,
    instead of a traceback (as a beat does, ``BeatConfigurationError``)."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


class DelayQWorker(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep of an app with delayq (:func:`celery_delayq.install` adds it, with the
    slot receivers' step, :class:`~celery_delayq.flow.slots.SlotReceivers`): when the worker
    is built, reads the app's settings (a bad one stops the worker here; an unknown name is
    logged, :func:`~celery_delayq.config.check_settings`), logs what ``delayq_intercept_eta``
    covers, installs the lateness recorder when ``delayq_record_lateness`` is on, and adds
    the start check (:class:`~.starts.StartCheck`) to the consumer when ``delayq_start_check``
    is on. All of it is the worker's app's only: another app in the same process gets none
    of it.

    An app without a store (no ``delayq_url`` and a broker that is not Redis:
    :func:`~celery_delayq.config.configured`), which a shared task with the mixin binds to
    as well, gets none of it either: one warning, and its worker runs as plain Celery."""

    name = "celery_delayq.worker.lateness.DelayQWorker"

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        app = w.app
        self.recorder: LatenessRecorder | None = None
        if not configured(app):
            logger.warning(
                "delayq: app %r has no delayq store (%s is not set and the broker is not Redis): "
                "this worker runs its tasks as plain Celery (no start check, lateness or slots); "
                "set %s to use delayq here",
                app.main,
                setting_name(app, "delayq_url"),
                setting_name(app, "delayq_url"),
            )
            return
        try:
            DelayQConfig.from_app(app)  # a bad setting stops the worker here, as it starts
        except ConfigurationError as exc:
            raise WorkerConfigurationError(f"delayq: {exc}") from None
        line = intercept_line(app)
        if line is not None:
            logger.info("delayq: %s", line)
        # (before a prefork pool forks: the children inherit the receivers)
        self.recorder = install(app) if _setting(app, "delayq_record_lateness") else None
        if _setting(app, "delayq_start_check"):
            starts.install(app)  # the consumer, built after every worker step's __init__, has it
        if self.recorder is not None:
            logger.info("delayq: recording due -> start lateness of delayq messages in %s", self.recorder.key)
