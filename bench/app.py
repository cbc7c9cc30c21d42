"""The Celery app that the benchmark runs as real ``celery worker``/``celery beat`` processes.

Configured from the environment that :mod:`bench.harness` sets for each child:

- ``BENCH_BROKER``: broker URL (Redis or AMQP);
- ``BENCH_STORE``: delayq store URL (``delayq_url``), also where ``bench.job`` records its runs;
- ``BENCH_CONF``: JSON of extra app settings (optional);
- ``BENCH_READY_FILE``: a worker creates this file when it is ready to consume (optional);
- ``BENCH_PUBLISH_LOG``: a file where a beat run with ``-S bench.app.RecordingScheduler``
  appends, in ms, how late each job it published was: the dispatcher's own record
  (``Dispatcher(keep_lateness=...)``, ``stats.lateness_ms``: server clock when the publish was
  sent, minus the due time).

One task, ``bench.job(user_id, text, locale=..., payload=...)``: the rows schedule it with a
real job's arguments, :func:`bench.jobs.job_call` (an int, a text of 32-39 characters and a
``locale=``, all differing per job), and some also with no arguments or with a 2 KB ``payload=``
(:data:`bench.jobs.SHAPES`); it ignores them. A worker running it notes ``"<start> <due>"``
(seconds since the epoch), where due is the ``delayq_due`` header of a delayq job or the ``eta``
of a Celery ETA task, so both are measured by the same code; a thread appends the notes to
``bench:starts`` every 0.1 s (one RPUSH per batch, not per task: the worker's own cost per task
stays as small as it can be).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.signals import after_task_publish, worker_ready

from celery_delayq import DelayedTask, Scheduler

BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:1/0")
STORE = os.environ.get("BENCH_STORE", BROKER)
READY_FILE = os.environ.get("BENCH_READY_FILE", "")
PUBLISH_LOG = os.environ.get("BENCH_PUBLISH_LOG", "")

#: The list ``bench.job`` appends ``"<start> <due>"`` to, in the store's Redis.
STARTS_KEY = "bench:starts"
TASK_NAME = "bench.job"

app = Celery("bench", broker=BROKER, set_as_current=False)
app.conf.update(
    delayq_url=STORE,
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    **json.loads(os.environ.get("BENCH_CONF", "{}")),
)


class _Starts:
    """Buffers the start records of this process; a thread RPUSHes them every 0.1 s."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[str] = []
        self.client: redis.Redis | None = None
        self.thread: threading.Thread | None = None

    def add(self, line: str) -> None:
        with self.lock:
            self.pending.append(line)
            if self.thread is None:  # started in the process that runs tasks (after any fork)
                self.thread = threading.Thread(target=self._loop, name="bench-starts", daemon=True)
                self.thread.start()
                atexit.register(self.flush)

    def flush(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
        if lines:
            if self.client is None:
                self.client = redis.Redis.from_url(STORE)
            self.client.rpush(STARTS_KEY, *lines)

    def _loop(self) -> None:
        while True:
            time.sleep(0.1)
            self.flush()


_starts = _Starts()


#: A ``delayq_due`` above this is in milliseconds, not seconds (1e11 s is in the year 5138).
MS_ABOVE = 1e11


def due_seconds(value: Any) -> float:
    """A ``delayq_due`` header in seconds since the epoch: the header was a float of seconds and
    becomes an int of milliseconds; both are read.

    >>> due_seconds(1700000000.25), due_seconds(1700000000250), due_seconds("1700000000250")
    (1700000000.25, 1700000000.25, 1700000000.25)
    """
    due = float(value)
    return due / 1000.0 if due > MS_ABOVE else due


def due_of(request: Any) -> float | None:
    """The due time of the running task (seconds): delayq's header, else Celery's ``eta``."""
    due = getattr(request, "delayq_due", None)
    if due is not None:
        return due_seconds(due)
    eta = getattr(request, "eta", None)
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        return eta.timestamp()
    return None


@app.task(base=DelayedTask, bind=True, name=TASK_NAME)  # type: ignore[untyped-decorator]
def job(
    self: Any, user_id: int | None = None, text: str = "", locale: str = "en-US", payload: str = ""
) -> None:
    start = time.time()
    due = due_of(self.request)
    _starts.add(f"{start:.6f} {due if due is not None else start:.6f}")


@worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
def _ready(**_: Any) -> None:
    if READY_FILE:
        Path(READY_FILE).write_text(str(os.getpid()))


# -- publish lateness, recorded inside a beat -------------------------------------------------


class _PublishLog:
    """Appends lateness figures (ms) to a file every 0.2 s, from ``source()`` (a list that only
    grows) or from :meth:`add`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.pending: list[str] = []
        self.source: Any = None
        self.taken = 0
        threading.Thread(target=self._loop, name="bench-publish-log", daemon=True).start()
        atexit.register(self.flush)

    def add(self, late_ms: float) -> None:
        with self.lock:
            self.pending.append(f"{late_ms:.3f}\n")

    def flush(self) -> None:
        with self.lock:
            if self.source is not None:
                values = self.source()
                end = len(values)  # appended by the beat's thread: read up to a snapshot
                self.pending.extend(f"{v:.3f}\n" for v in values[self.taken : end])
                self.taken = end
            lines, self.pending = self.pending, []
        if lines:
            with open(self.path, "a") as out:
                out.writelines(lines)

    def _loop(self) -> None:
        while True:
            time.sleep(0.2)
            self.flush()


_log = _PublishLog(PUBLISH_LOG) if PUBLISH_LOG else None


class RecordingScheduler(Scheduler):
    """``celery_delayq.Scheduler`` whose dispatcher keeps the lateness of every job it publishes
    (``keep_lateness``), streamed to ``BENCH_PUBLISH_LOG``. Nothing else differs: no publish
    signal receiver is connected, so the dispatcher takes the path it takes in production."""

    def setup_schedule(self) -> None:
        super().setup_schedule()
        if _log is None:
            return
        from celery_delayq.beat.dispatch import Dispatcher

        assert self.dispatcher is not None
        try:
            dispatcher = Dispatcher(self.app, self.dispatcher.store, keep_lateness=10_000_000)
        except TypeError:  # no keep_lateness any more: time the publishes with the signal
            _log.source = None
            after_task_publish.connect(_on_publish, weak=False)
            return
        self.dispatcher = dispatcher
        _log.source = lambda: dispatcher.stats.lateness_ms


def _on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
    now = time.time()
    due = (headers or {}).get("delayq_due")
    if due is not None and _log is not None:
        _log.add((now - due_seconds(due)) * 1000.0)
