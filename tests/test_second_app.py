"""A second app without delayq settings in the process starts its worker as plain Celery's
(issue 52).

A task whose base has the mixin (a ``@shared_task(base=DelayedTask)``, or the same function
registered in two apps) binds to every app in the process, and binding attaches delayq's worker
steps (``celery_delayq.install``). An app with neither ``delayq_url`` nor a Redis broker (a test
app on ``memory://``) has no store: its worker's delayq steps turn themselves off with one
warning, and its tasks' ``apply_async(countdown=...)`` is Celery's. Before, its worker died at
start on the start check's ``ConfigurationError`` and its ``apply_async(countdown=...)`` raised it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

from celery_delayq import DelayedTask, ScheduledResult
from celery_delayq.config import configured
from celery_delayq.exceptions import ConfigurationError
from celery_delayq.worker.starts import StartCheck

#: ``start_worker``'s options: a WARNING is logged (its default level is ERROR).
WORKER: dict[str, Any] = {"perform_ping_check": False, "shutdown_timeout": 30, "loglevel": "WARNING"}


def make(name: str, broker: str, **conf: Any) -> tuple[Celery, Any]:
    """An app and its ``DelayedTask`` ``two.add`` (the same function in each app, as a shared
    task would be)."""
    app = Celery(name, broker=broker, backend="cache+memory://", set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)

    def add(x: int, y: int) -> int:
        return x + y

    return app, app.task(base=DelayedTask, name="two.add", shared=False)(add)


def test_configured_is_a_store_url_or_a_redis_broker() -> None:
    assert configured(make("a", "redis://127.0.0.1:6390/0")[0])
    assert configured(make("b", "amqp://guest@127.0.0.1:5672//", delayq_url="redis://x:1/0")[0])
    assert not configured(make("c", "memory://")[0])
    assert not configured(make("d", "amqp://guest@127.0.0.1:5672//")[0])


def test_apply_async_with_countdown_is_celerys_on_an_app_without_a_store(redis_url: str) -> None:
    plain, add = make("plain", "memory://", task_always_eager=False)
    # Celery's own path: no store asked (there is none), an AsyncResult, a message with its eta
    result = add.apply_async((1, 2), countdown=30)
    assert isinstance(result, AsyncResult) and not isinstance(result, ScheduledResult)
    # asking for the interception without a store says what is missing, at the call
    plain.conf.delayq_intercept_eta = True
    with pytest.raises(ConfigurationError, match="delayq_url is not set and the broker is not Redis"):
        add.apply_async((1, 2), countdown=30)
    with pytest.raises(ConfigurationError, match="delayq_url is not set and the broker is not Redis"):
        add.apply_at(0)
    # the app with a store intercepts as before
    _, stored = make("with", redis_url, delayq_intercept_eta=True)
    assert isinstance(stored.apply_async((1, 2), countdown=30), ScheduledResult)


@pytest.mark.e2e
@pytest.mark.slow
def test_two_apps_in_one_process_each_start_a_real_worker_and_run_a_task(
    redis_url: str,
) -> None:
    with_store, add_with = make("with_store", redis_url)
    plain, add_plain = make("plain", "memory://")
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("celery_delayq.worker.lateness")  # (Celery's worker sets up the root's)
    log.addHandler(handler)
    with (
        contextlib.ExitStack() as undo,
        start_worker(with_store, **WORKER) as worker,
        start_worker(plain, **WORKER) as plain_worker,
    ):
        undo.callback(log.removeHandler, handler)
        # both run at once, in this process
        assert add_plain.delay(1, 2).get(timeout=30) == 3
        assert add_plain.apply_async((2, 3), countdown=0.2).get(timeout=30) == 5
        assert add_with.delay(3, 4).get(timeout=30) == 7
        assert not [s for s in plain_worker.consumer.blueprint.order if isinstance(s, StartCheck)]
        checks = [s for s in worker.consumer.blueprint.order if isinstance(s, StartCheck)]
        assert len(checks) == 1  # the app with a store has delayq's worker side
    # one warning, from the worker of the app without a store
    assert lines == [
        "delayq: app 'plain' has no delayq store (delayq_url is not set and the broker is not Redis): "
        "this worker runs its tasks as plain Celery (no start check, lateness or slots); set "
        "delayq_url to use delayq here"
    ]
