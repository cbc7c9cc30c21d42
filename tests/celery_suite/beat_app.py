"""The app of the ``celery beat -S celery_delayq.Scheduler`` that runs beside Celery's
integration suite (``tests/test_celery_suite.py``): the suite's broker, backend and tasks
(``t.integration.tasks``, importable from the sdist's directory), with delayq's settings."""

from __future__ import annotations

import os

from celery import Celery

from tests.celery_suite.plugin import delayq_changes

app = Celery(
    "celery_suite_beat",
    broker=os.environ["TEST_BROKER"],
    backend=os.environ["TEST_BACKEND"],
    include=["t.integration.tasks"],
    task_cls="celery_delayq:DelayedTask",
    changes=delayq_changes(),
)
