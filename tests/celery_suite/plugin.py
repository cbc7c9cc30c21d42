"""A pytest plugin for Celery's own integration suite (``t/integration``), loaded with
``-p tests.celery_suite.plugin`` by ``tests/test_celery_suite.py``; the suite is not modified.

With ``DELAYQ_SUITE_INTERCEPT=1`` every task of the suite's app is a
:class:`~celery_delayq.DelayedTask` (the app's ``task_cls``: the suite's ``@shared_task``
tasks take the app's task class) and ``delayq_intercept_eta`` is on, with ``delayq_url`` =
``DELAYQ_SUITE_STORE``; a ``celery beat -S celery_delayq.Scheduler`` started beside the
suite (``tests.celery_suite.beat_app``) publishes the intercepted calls. Without it, the
suite runs on plain Celery. The suite's own ``conftest.py`` reads the broker and result
backend from ``TEST_BROKER`` and ``TEST_BACKEND``.

With it, the plugin also defines a ``@shared_task(base=DelayedTask)``, as a code base with
delayq would: such a task binds to every app of the process, so the apps the suite makes for
itself (``TestApp``: a ``memory://`` broker, no delayq settings, a worker started in the
suite's process) get delayq's worker steps too, and must start as plain Celery's (issue 52).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest


def delayq_changes() -> dict[str, Any]:
    """The delayq settings of the suite's app, and of the beat's (``beat_app``)."""
    return {"delayq_url": os.environ["DELAYQ_SUITE_STORE"], "delayq_intercept_eta": True}


@pytest.fixture(scope="session")
def celery_parameters() -> Mapping[str, Any]:
    """Overrides ``celery.contrib.pytest``'s (the suite's conftest does not define it)."""
    if os.environ.get("DELAYQ_SUITE_INTERCEPT") != "1":
        return {}
    return {"task_cls": "celery_delayq:DelayedTask", "changes": delayq_changes()}


#: The store's counter of intercepted calls (every process of the suite's worker adds to it).
INTERCEPTED = "celery_suite:intercepted"


def _count_intercepts() -> None:
    """Count each intercepted call in the store, so that the test can tell the suite went
    through delayq (the prefork worker's children inherit the patch from this process)."""
    import redis

    from celery_delayq.producer.task import DelayQTaskMixin

    intercept = DelayQTaskMixin._delayq_intercept
    client = redis.Redis.from_url(os.environ["DELAYQ_SUITE_STORE"])

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = intercept(self, *args, **kwargs)
        client.incr(INTERCEPTED)
        return result

    DelayQTaskMixin._delayq_intercept = counted  # type: ignore[method-assign]


def _share_a_delayed_task() -> None:
    """A shared task with the mixin, bound to every app of the process when it is finalized."""
    from celery import shared_task

    from celery_delayq import DelayedTask

    @shared_task(base=DelayedTask, name="celery_suite.shared_delayed")
    def shared_delayed() -> None:
        return None


if os.environ.get("DELAYQ_SUITE_INTERCEPT") == "1":
    _count_intercepts()
    _share_a_delayed_task()
