"""In-process Celery apps for tests: :func:`make_app`, :func:`add_task` (the tests' ``t.add``),
the ``app``, ``app_factory`` and ``dispatchers`` fixtures, the autouse fixture that forgets
shared tasks after each test, and :func:`forget_subscriptions` for an app whose results
subscribed to the backend."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Queue

from celery_delayq import DelayedTask


@pytest.fixture(autouse=True)
def _forget_shared_tasks() -> Iterator[None]:
    """Drop the shared tasks a test declared (``@shared_task``, ``@app.task`` with Celery's
    default ``shared=True``, code run from the docs) when it ends.

    Celery pushes every shared task into every app finalized later in the process; two
    callables under one name then raise DuplicateTaskNameWarning (an error under
    ``filterwarnings = error``) in whichever later test first finalizes an app.
    """
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(before)


def add_task(app: Celery) -> Any:
    """Register the tests' ``t.add`` (``x + y``, a :class:`DelayedTask`, not shared) on ``app``;
    returns the task. The one definition the test modules share."""

    @app.task(base=DelayedTask, name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return add


def make_app(broker: str, delayq_url: str | None = None, **conf: Any) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(
        delayq_url=delayq_url,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    """An in-process app (broker and store on the session server) with two DelayedTasks."""
    application = make_app(redis_url)

    add_task(application)

    @application.task(base=DelayedTask, name="t.noop", shared=False)
    def noop() -> None:
        return None

    yield application
    application.close()


#: ``app_factory(broker=None, **settings)``: a fresh app, closed at the end of the test.
AppFactory = Callable[..., Celery]


@pytest.fixture
def app_factory(redis_url: str) -> Iterator[AppFactory]:
    """The tests' one app factory: ``app_factory(broker=None, **settings)`` makes a fresh app
    with the tasks ``t.add`` (``add(x, y=None)``, returns ``x``: any one or two arguments, as the
    push path's option sets send) and ``t.noop``, and queues ``celery`` and ``q2``; the broker
    and the store (``delayq_url``) default to the test server, any setting may be given
    (``delayq_url=...``, ``task_queues=...``). Every app made is closed at the end of the test.

    A module needing ``t.add``'s checked ``(x, y)`` signature (:func:`add_task`) overrides it
    (tests/test_producer.py)."""
    apps: list[Celery] = []

    def factory(broker: str | None = None, **conf: Any) -> Celery:
        conf.setdefault("delayq_url", redis_url)
        conf.setdefault("task_queues", [Queue("celery"), Queue("q2")])
        application = make_app(broker or redis_url, **conf)

        @application.task(base=DelayedTask, name="t.add", shared=False)
        def add(x: Any, y: Any = None) -> Any:
            return x

        @application.task(base=DelayedTask, name="t.noop", shared=False)
        def noop() -> None:
            return None

        apps.append(application)
        return application

    yield factory
    for application in apps:
        application.close()


@pytest.fixture
def dispatchers() -> Iterator[Callable[..., Any]]:
    """Makes :class:`Dispatcher` objects (or of a subclass given as ``cls=``) and stops each at
    the end of the test (flushes its lateness, removes its heartbeat, closes it)."""
    from celery_delayq.beat.dispatch import Dispatcher

    made: list[Dispatcher] = []

    def factory(app: Celery, cls: type[Dispatcher] = Dispatcher, **kwargs: Any) -> Dispatcher:
        dispatcher = cls(app, **kwargs)
        made.append(dispatcher)
        return dispatcher

    yield factory
    for dispatcher in made:
        dispatcher.stop()


def forget_subscriptions(app: Celery) -> None:
    """Drop the result subscriptions a group's results made (``res.then(barrier)``), before the
    session's Redis stops.

    A result collected later would retry its unsubscribe against the stopped server, from a
    finalizer that may run in the middle of a later compile, and that breaks CPython 3.11's AST
    recursion counter ("SystemError: AST constructor recursion depth mismatch").
    """
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        consumer.subscribed_to.clear()


def race_producers(
    redis_url: str, task: Callable[..., Any], call: Callable[[Any], Any], rounds: int
) -> Counter[str]:
    """Two producers (an app and connection each, in two threads) make ``rounds`` calls each
    at once: ``call(task)``, ``task`` being ``task`` registered on the producer's app as
    ``t.<its name>``. Returns how many calls answered each ``outcome``; an error in either is raised."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def producer() -> None:
        app = make_app(redis_url)
        bound = app.task(base=DelayedTask, name=f"t.{task.__name__.strip('_')}", shared=False)(task)
        try:
            for _ in range(rounds):
                res = call(bound)
                with lock:
                    outcomes[res.outcome or "none"] += 1
        except BaseException as exc:  # raised below
            errors.append(exc)
        finally:
            app.close()

    threads = [threading.Thread(target=producer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return outcomes
