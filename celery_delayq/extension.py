"""One object per Celery app: what delayq keeps for it, rebuilt whole when its settings change.

:func:`extension` returns the app's :class:`DelayQApp`, whose parts are the validated
settings (:class:`~.config.DelayQConfig`, part ``"config"``), the store (``"store"``), the
message plans (:mod:`.build`, ``"state"``) and the results cache (:mod:`.result`,
``"results"``), each made on first use by the module that owns it (this module, the lowest of
the package, imports none of them). They live and die together: when the app's
configuration changes, the next :func:`extension` call returns a new object (whoever still
holds the old store, a running beat say, keeps using it).

A change is seen without reading anything private of Celery:

- ``app.conf`` is another object (``config_from_object`` on a configured app, or the app
  configured since the extension was made): seen at the next call;
- a setting written in place (``app.conf.x = ...``, ``app.conf.update``): the extension keeps a
  *fingerprint*, the values of the settings delayq depends on (:data:`WATCHED`, read through
  the public ``app.conf`` mapping), and compares it again at most every :data:`RECHECK_EVERY`
  seconds, so a change is seen within that time. Reading those settings costs about as much
  as a whole ``apply_at`` call (measured: 25 settings, 138 µs), too much for every call.
  :func:`reconfigure` rebuilds at once.

The worker side (slots, lateness, the start check) is attached per app by :func:`install`:
a worker bootstep (:class:`~.worker.DelayQWorker`, named by :data:`WORKER_STEP`) in
``app.steps['worker']``. An app that
uses ``DelayedTask`` (or the mixin) is installed when its task is bound to it; any other app
calls ``celery_delayq.install(app)`` once, in the module the worker loads. An app never
installed gets no delayq receiver and no step.

>>> from celery import Celery
>>> app = Celery(broker="redis://127.0.0.1:6390/0", set_as_current=False)
>>> ext = extension(app)
>>> ext is extension(app), ext.part("answer", lambda: 42)
(True, 42)
>>> app.conf.delayq_prefix = "other"
>>> reconfigure(app) is ext, extension(app).parts
(False, {})
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = [
    "RECHECK_EVERY",
    "WATCHED",
    "WORKER_STEP",
    "DelayQApp",
    "extension",
    "install",
    "installed",
    "reconfigure",
    "watch",
]

T = TypeVar("T")

#: Seconds between two reads of an app's fingerprint (see the module docstring); 0: every call.
RECHECK_EVERY = 0.5

#: The worker bootstep :func:`install` adds, by name (Celery loads it when a worker is built).
WORKER_STEP = "celery_delayq.worker:DelayQWorker"

#: The settings whose values make an app's fingerprint: the broker URLs (``delayq_url``'s
#: default), the Celery settings a stored message is built from, and every ``delayq_*``
#: setting (:mod:`.config` adds them, :func:`watch`).
WATCHED: list[str] = [
    "broker_url",
    "broker_write_url",
    "task_always_eager",
    "task_default_queue",
    "task_default_exchange",
    "task_default_exchange_type",
    "task_default_routing_key",
    "task_default_priority",
    "task_default_delivery_mode",
    "task_queues",
    "task_routes",
    "task_create_missing_queues",
    "task_queue_max_priority",
    "task_inherit_parent_priority",
    "task_serializer",
    "task_compression",
    "task_protocol",
    "task_time_limit",
    "task_soft_time_limit",
    "task_annotations",
    "task_repr_maxlevels",
]

_ATTRIBUTE = "delayq_extension"  # the one attribute delayq sets on an app
_lock = threading.Lock()


def watch(names: Iterable[str]) -> None:
    """Add settings to :data:`WATCHED` (a change to any of them makes extensions anew)."""
    for name in names:
        if name not in WATCHED:
            WATCHED.append(name)


def _fingerprint(app: Any) -> tuple[Any, ...]:
    get = app.conf.get
    return (getattr(app, "namespace", None), *(get(name) for name in WATCHED))


class DelayQApp:
    """What delayq keeps for one app, valid while its settings are unchanged."""

    def __init__(self, app: Any) -> None:
        self.fingerprint = _fingerprint(app)  # (first: reading a setting may load the config)
        self.conf = app.conf  # the configuration object it was made from
        self.checked = time.monotonic()
        #: part name -> the part ("config", "store", "state", "results")
        self.parts: dict[str, Any] = {}

    def part(self, name: str, make: Callable[[], T]) -> T:
        """The part ``name``, made by ``make()`` on first use (two threads may both make it:
        one is kept)."""
        try:
            found: T = self.parts[name]
            return found
        except KeyError:
            made: T = self.parts.setdefault(name, make())
            return made

    def current(self, app: Any) -> bool:
        """Whether this is still ``app``'s extension (see the module docstring)."""
        if app.conf is not self.conf:
            return False
        now = time.monotonic()
        if now - self.checked < RECHECK_EVERY:
            return True
        try:
            same = bool(_fingerprint(app) == self.fingerprint)
        except Exception:  # a value that cannot be compared: made anew
            same = False
        if same:
            self.checked = now
        return same


def extension(app: Any) -> DelayQApp:
    """The app's :class:`DelayQApp`, made on first use and anew after a settings change."""
    ext: DelayQApp | None = app.__dict__.get(_ATTRIBUTE)
    if ext is not None and (
        (app.conf is ext.conf and time.monotonic() - ext.checked < RECHECK_EVERY) or ext.current(app)
    ):
        return ext
    return _rebuild(app, ext)


def reconfigure(app: Any) -> DelayQApp:
    """Make the app's extension anew now (a setting changed and must be seen at once)."""
    return _rebuild(app, app.__dict__.get(_ATTRIBUTE))


def _rebuild(app: Any, old: DelayQApp | None) -> DelayQApp:
    with _lock:
        ext: DelayQApp | None = app.__dict__.get(_ATTRIBUTE)
        if ext is not old and ext is not None:  # another thread made it meanwhile
            return ext
        ext = DelayQApp(app)
        app.__dict__[_ATTRIBUTE] = ext
    return ext


def install(app: Any) -> Any:
    """Attach delayq's worker side to ``app``: the :class:`~.worker.DelayQWorker` bootstep,
    which, in a worker of this app, gives gated tasks' slots back, records start lateness
    (``delayq_record_lateness``) and checks task starts (``delayq_start_check``). Idempotent;
    returns the app. Call it before the worker is built (in the module the worker loads)."""
    steps = app.steps["worker"]
    if not installed(app):
        steps.add(WORKER_STEP)
    return app


def installed(app: Any) -> bool:
    """Whether :func:`install` attached the worker side to ``app``."""
    return any(
        step == WORKER_STEP or getattr(step, "name", None) == "celery_delayq.worker.DelayQWorker"
        for step in app.steps["worker"]
    )
