"""Worker side of flow control: a gated task's slot is renewed while it runs and given back
when it ends.

When a beat releases a gated job (:mod:`.gate`), the job takes one slot of its key
(``gate:run:<key>``) that lasts ``delayq_start_ttl`` seconds while its message waits for a
worker, and ``delayq_slot_ttl`` seconds once a worker started it. The message carries the
:data:`~.gate.GATE_HEADER` header, which Celery hands to the task as
``task.request.delayq_gate`` (custom message headers become request attributes, in the
process that runs the task, with every pool). This module's receivers:

- ``task_prerun``: the slot is taken over (one ``Store.renew_slots`` call: its lease becomes
  ``delayq_slot_ttl`` and its token "run"), and the request is remembered in its process'
  running set; a
  daemon thread of that process (started at its first gated task, again in each prefork
  child) renews every slot of the set every ``delayq_slot_ttl / 3`` s (``Store.renew_slots``,
  one pipeline).
- ``task_postrun``: the slot is given back (``Store.release``) with the task's outcome: state
  ``SUCCESS`` -> "succeeded", ``RETRY`` -> "retry" (a batch member is not counted yet), any
  other -> "failed" (in a prefork child whose task was terminated by
  ``revoke(terminate=True)`` the state is None); the job is forgotten.
- A retry: the retry message carries the request's headers, gate header included. A
  ``DelayedTask`` (:class:`~..producer.task.DelayQTaskMixin`) sends it through delayq, stored again and
  gated again at its due time: its slot is given back as "retry". Any other task (a batch
  member may be a plain task) sends it straight to the broker, outside the gate: its slot is
  kept and renewed by this process until the retried run ends and gives it back (or until a
  renewal finds it gone), so the key's cap holds over the retry and a batch counts the member
  once, when it ends.
- ``task_revoked``: a task revoked or expired before it ran (no prerun, no postrun) gives its
  slot back as "failed". It runs in the worker's main process; its ``request`` is the task's
  request context, which carries the header too. A terminated task gets both its child's
  postrun and this: the second release finds the slot gone and does nothing.

A release the worker cannot make (Redis unreachable) is logged, never raised into the task:
the slot then comes back when it expires (``delayq_slot_ttl`` after the last renewal), and
so does the slot of a worker that dies mid-task, whose job is then delivered again.

The receivers are connected per app, by the worker bootstep that :func:`celery_delayq.install`
adds to the app (a ``DelayedTask`` bound to the app adds it), or by :func:`install` here; each
acts on the tasks of its app only, so an app without delayq in the same process gets none.
The store is the one of the app the task belongs to (``get_store(task.app)``).

>>> from celery import Celery
>>> app = Celery(broker="redis://127.0.0.1:6390/0", set_as_current=False)
>>> app.conf.delayq_slot_ttl = 3
>>> keeper = install(app)
>>> keeper.every
1.0
>>> disconnect(app)
>>> outcome_of("SUCCESS"), outcome_of("RETRY"), outcome_of("FAILURE"), outcome_of(None)
('succeeded', 'retry', 'failed', 'failed')
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

from celery import bootsteps
from celery.signals import (
    task_postrun,
    task_prerun,
    task_revoked,
    worker_process_shutdown,
    worker_shutdown,
)

from ..config import DelayQConfig, configured
from ..producer.task import DelayQTaskMixin
from ..store.connection import error_text
from ..store.facade import get_store
from .gate import GATE_HEADER, Gate, batch_of

__all__ = ["SlotKeeper", "SlotReceivers", "connect", "disconnect", "install", "keeper_for", "outcome_of"]

logger = logging.getLogger(__name__)

_keepers: weakref.WeakKeyDictionary[Any, SlotKeeper] = weakref.WeakKeyDictionary()  # app -> keeper
_connected: weakref.WeakSet[Any] = weakref.WeakSet()  # apps whose receivers are connected
_lock = threading.Lock()


def outcome_of(state: Any) -> str:
    """The release outcome of a task that ended in Celery state ``state``."""
    if state == "SUCCESS":
        return "succeeded"
    if state == "RETRY":
        return "retry"
    return "failed"


class SlotKeeper:
    """The slots of one app's gated tasks running in this process: renewed, then released."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.ttl = DelayQConfig.from_app(app).slot_ttl
        #: seconds between two renewals of this process' slots
        self.every = self.ttl / 3
        #: job id -> (key, batch id or None) of the gated tasks running in this process
        self.running: dict[str, tuple[str, str | None]] = {}
        self._lock = threading.Lock()
        self._pid = -1  # the process whose renewal thread runs
        self._stop = threading.Event()
        self._failing = False
        #: take-overs ("take", id, key) and releases ("release", id, key, outcome, batch) the
        #: task signals queued for this process' thread to send (:meth:`send`)
        self._outbox: list[tuple[Any, ...]] = []
        self._kick = threading.Event()
        self._sending = threading.Lock()

    # -- the task's life ------------------------------------------------------------------------

    def started(self, job_id: str, header: Any) -> bool:
        """A task with this gate header started here: renew its slot until it ends. False when
        the header does not read (the beat released such a job without a slot)."""
        gate = self._track(job_id, header)
        if gate is None:
            return False
        self.take_over(job_id, gate.key)
        return True

    def _track(self, job_id: str, header: Any) -> Gate | None:
        """Note a started task of this gate ``header`` as running here (its slot renewed until it
        ends); None when the header does not read."""
        gate = Gate.from_header(header)
        if gate is None:
            return None
        if self._pid != os.getpid():
            self._start_renewer()
        with self._lock:
            self.running[job_id] = (gate.key, gate.batch or batch_of(job_id))
        return gate

    def take_over(self, job_id: str, key: str) -> None:
        """The task starts: its slot, which lasted ``delayq_start_ttl`` while the message waited
        for a worker, now lasts ``delayq_slot_ttl`` and is this process' to renew (one
        ``Store.renew_slots`` call). Never raises: on a Redis error the renewal thread tries
        again, and until then the slot keeps the start TTL."""
        try:
            get_store(self.app).renew_slots([(job_id, key)], int(self.ttl * 1000))
        except Exception as exc:
            logger.warning(
                "delayq: cannot take over the slot of %s (key %r) in Redis: %s", job_id, key, error_text(exc)
            )

    def finished(self, job_id: str, header: Any, outcome: str) -> bool:
        """A gated task ended (or was revoked before it ran): give its slot back with
        ``outcome``; whether Redis said the slot was released. Never raises."""
        known = self._untrack(job_id, header)
        if known is None:
            return False
        key, batch = known
        try:
            result = get_store(self.app).release(job_id, key, outcome, batch)
        except Exception as exc:
            logger.warning(
                "delayq: cannot give back the slot of %s (key %r) in Redis: %s; it comes back "
                "when it expires (delayq_slot_ttl, %.0f s)",
                job_id,
                key,
                error_text(exc),
                self.ttl,
            )
            return False
        return bool(result.released)

    def _untrack(self, job_id: str, header: Any) -> tuple[str, str | None] | None:
        """Forget an ended task: its ``(key, batch id or None)``, from the running set or else
        from its gate ``header``; None when neither has it (nothing to give back)."""
        with self._lock:
            known = self.running.pop(job_id, None)
        if known is not None:
            return known
        gate = Gate.from_header(header)
        return None if gate is None else (gate.key, gate.batch or batch_of(job_id))

    # -- the task's life, off the task's path ---------------------------------------------------

    def start_soon(self, job_id: str, header: Any) -> bool:
        """:meth:`started`, with the take-over queued for this process' thread (:meth:`send`)
        instead of sent from the task's thread: the task does not wait for Redis."""
        gate = self._track(job_id, header)
        if gate is None:
            return False
        with self._lock:
            self._outbox.append(("take", job_id, gate.key))
        self._kick.set()
        return True

    def finish_soon(self, job_id: str, header: Any, outcome: str) -> bool:
        """:meth:`finished`, with the release queued for this process' thread (:meth:`send`);
        False when the header does not read (nothing to give back)."""
        known = self._untrack(job_id, header)
        if known is None:
            return False
        if self._pid != os.getpid():
            self._start_renewer()
        with self._lock:
            self._outbox.append(("release", job_id, known[0], outcome, known[1]))
        self._kick.set()
        return True

    def send(self) -> int:
        """Send what :meth:`start_soon` and :meth:`finish_soon` queued, in one round trip
        (``Store.slot_updates``): a take-over whose release is queued too is left out (the
        release gives the slot back). When it returns, everything queued before the call was
        sent. How many calls were sent. Never raises: an error is logged, and a slot not given
        back comes back when it expires, as with :meth:`finished`."""
        with self._sending:
            with self._lock:
                queued, self._outbox = self._outbox, []
            if not queued:
                return 0
            ending = {item[1] for item in queued if item[0] == "release"}
            takes = [(item[1], item[2]) for item in queued if item[0] == "take" and item[1] not in ending]
            releases = [(item[1], item[2], item[3], item[4]) for item in queued if item[0] == "release"]
            try:
                _, results = get_store(self.app).slot_updates(takes, int(self.ttl * 1000), releases)
            except Exception as exc:
                logger.warning(
                    "delayq: cannot take over or give back the slots of %d task(s) in Redis: %s; a "
                    "slot not given back comes back when it expires (delayq_slot_ttl, %.0f s)",
                    len(takes) + len(releases),
                    error_text(exc),
                    self.ttl,
                )
                return 0
            for (job_id, key, _, _), result in zip(releases, results, strict=True):
                if isinstance(result, Exception):
                    logger.warning(
                        "delayq: cannot give back the slot of %s (key %r) in Redis: %r; it comes back "
                        "when it expires (delayq_slot_ttl, %.0f s)",
                        job_id,
                        key,
                        result,
                        self.ttl,
                    )
            return len(takes) + len(releases)

    def retrying(self, job_id: str, header: Any) -> None:
        """A gated task's run ended in a retry that Celery sent straight to the broker: keep
        renewing its slot here until the retried run gives it back."""
        gate = Gate.from_header(header)
        if gate is not None:
            with self._lock:
                self.running[job_id] = (gate.key, gate.batch or batch_of(job_id))

    # -- renewal --------------------------------------------------------------------------------

    def _start_renewer(self) -> None:
        """(Re)start the renewal thread in this process: after a fork only the forking thread
        exists in the child, and the parent's running set is the parent's."""
        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                return
            if self._pid != -1:  # a forked child: what the parent had queued is the parent's
                self.running = {}
                self._outbox = []
                self._kick = threading.Event()
                self._sending = threading.Lock()
            self._pid = pid
            self._stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(self._stop,), name="delayq-slots", daemon=True)
            thread.start()

    def _run(self, stop: threading.Event) -> None:
        """This process' thread: sends what the task signals queue as soon as they queue it,
        and renews the running slots every :attr:`every` s."""
        renew_at = time.monotonic() + self.every
        while not stop.is_set():
            self._kick.wait(max(0.0, renew_at - time.monotonic()))
            self._kick.clear()
            self.send()
            if time.monotonic() >= renew_at:
                self.renew()
                renew_at = time.monotonic() + self.every
        self.send()

    def renew(self) -> int:
        """Renew the slots of this process' running gated tasks (one pipeline); how many Redis
        still had. Never raises."""
        with self._lock:
            jobs = [(job_id, key) for job_id, (key, _) in self.running.items()]
        if not jobs:
            return 0
        try:
            renewed = get_store(self.app).renew_slots(jobs, int(self.ttl * 1000))
        except Exception as exc:
            if not self._failing:
                logger.warning(
                    "delayq: cannot renew the slots of %d running gated task(s) (%s); a slot not "
                    "renewed within delayq_slot_ttl (%.0f s) comes back and its job runs again",
                    len(jobs),
                    error_text(exc),
                    self.ttl,
                )
            self._failing = True
            return 0
        if self._failing:
            logger.warning("delayq: renewing slots works again")
        self._failing = False
        gone = [job_id for job_id, ok in renewed.items() if not ok]
        if gone:  # given back by another process (a retried run), or expired: nothing to keep
            with self._lock:
                for job_id in gone:
                    self.running.pop(job_id, None)
        return len(renewed) - len(gone)

    def stop(self) -> None:
        """Stop this process' renewal thread, after sending what is queued."""
        self._stop.set()
        self._kick.set()
        self.send()


def install(app: Any) -> SlotKeeper:
    """Keep the slots of ``app``'s gated tasks that this process runs: connects this module's
    receivers for ``app``'s tasks (:func:`connect`) and makes the keeper now; the same keeper
    when called again. A worker of an app with delayq's bootstep
    (:func:`celery_delayq.install`) does it at its start."""
    connect(app)
    return _keeper(app)


def keeper_for(app: Any) -> SlotKeeper | None:
    """The keeper of ``app`` in this process, if one was made."""
    return _keepers.get(app)


def _keeper(app: Any) -> SlotKeeper:
    keeper = _keepers.get(app)
    if keeper is None:
        with _lock:
            keeper = _keepers.get(app)
            if keeper is None:
                keeper = _keepers[app] = SlotKeeper(app)
    return keeper


def _header(request: Any) -> Any:
    return getattr(request, GATE_HEADER, None)


def _gated(sender: Any, task: Any) -> tuple[Any, Any, Any] | None:
    """``(task, request, gate header)`` of a prerun/postrun's task, or None when not gated."""
    task = task or sender
    request = getattr(task, "request", None)
    header = _header(request)
    return None if header is None else (task, request, header)


def _on_prerun(sender: Any = None, task_id: Any = None, task: Any = None, **_: Any) -> None:
    gated = _gated(sender, task)
    if gated is None:
        return
    task, request, header = gated
    try:
        job_id = task_id or request.id
        if not _keeper(task.app).start_soon(job_id, header):
            logger.warning(
                "delayq: task %s carries a %s header that does not read; it holds no slot",
                job_id,
                GATE_HEADER,
            )
    except Exception:  # never fail a task for its slot
        logger.warning("delayq: the slot of task %s is not renewed", task_id, exc_info=True)


def _on_postrun(
    sender: Any = None, task_id: Any = None, task: Any = None, state: Any = None, **_: Any
) -> None:
    gated = _gated(sender, task)
    if gated is None:
        return
    task, request, header = gated
    try:
        keeper, job_id, outcome = _keeper(task.app), task_id or request.id, outcome_of(state)
        if outcome == "retry" and not isinstance(task, DelayQTaskMixin):
            keeper.retrying(job_id, header)
        else:
            keeper.finish_soon(job_id, header, outcome)
    except Exception:
        logger.warning("delayq: the slot of task %s is not given back", task_id, exc_info=True)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    header = _header(request)
    if header is None:
        return
    try:
        _keeper(sender.app).finish_soon(request.id, header, "failed")
    except Exception:
        logger.warning(
            "delayq: the slot of revoked task %s is not given back",
            getattr(request, "id", None),
            exc_info=True,
        )


def _stop(app: Any) -> None:
    keeper = _keepers.get(app)
    if keeper is not None:
        keeper.stop()


def _of(app: Any, task: Any) -> bool:
    return getattr(task, "app", None) is app


def connect(app: Any) -> None:
    """Connect the receivers of ``app``'s gated tasks (once per app): each acts on a task of
    ``app`` only, so another app's tasks in the same process meet no delayq code."""
    uid = f"celery_delayq.flow.slots:{id(app)}"
    with _lock:
        if app in _connected:
            return
        _connected.add(app)

    def prerun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
        if _of(app, task or sender):
            _on_prerun(sender=sender, task=task, **kwargs)

    def postrun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
        if _of(app, task or sender):
            _on_postrun(sender=sender, task=task, **kwargs)

    def revoked(sender: Any = None, **kwargs: Any) -> None:
        if _of(app, sender):
            _on_revoked(sender=sender, **kwargs)

    def shutdown(**_: Any) -> None:
        _stop(app)

    task_prerun.connect(prerun, weak=False, dispatch_uid=uid)
    task_postrun.connect(postrun, weak=False, dispatch_uid=uid)
    task_revoked.connect(revoked, weak=False, dispatch_uid=uid)
    worker_process_shutdown.connect(shutdown, weak=False, dispatch_uid=uid)
    worker_shutdown.connect(shutdown, weak=False, dispatch_uid=uid)


def disconnect(app: Any) -> None:
    """Undo :func:`connect` (and stop the app's keeper in this process)."""
    uid = f"celery_delayq.flow.slots:{id(app)}"
    with _lock:
        if app not in _connected:
            return
        _connected.discard(app)
    for signal in (task_prerun, task_postrun, task_revoked, worker_process_shutdown, worker_shutdown):
        signal.disconnect(dispatch_uid=uid)
    _stop(app)


class SlotReceivers(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep of an app with delayq (:func:`celery_delayq.install` adds it): connects
    the slot receivers of the app's tasks (:func:`connect`) when the worker is built, before a
    prefork pool forks (the children inherit them). Not in the worker of an app without a
    store (:func:`~..config.configured`): the app's delayq worker step says so."""

    name = "celery_delayq.flow.slots.SlotReceivers"

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        if configured(w.app):
            connect(w.app)
