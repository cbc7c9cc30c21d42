"""A beat's app that imports no task module: the same broker, store and settings as
``tests.apps.e2e_app`` (``DELAYQ_TEST_BROKER``, ``DELAYQ_TEST_STORE``, ``DELAYQ_TEST_CONF``),
without its tasks, for the tests of jobs whose task the beat does not know
(``tests/test_beat_without_tasks.py``)."""

from __future__ import annotations

import json
import os

from celery import Celery

BROKER = os.environ.get("DELAYQ_TEST_BROKER", "redis://127.0.0.1:1/0")

app = Celery("bare", broker=BROKER)
app.conf.update(
    {
        "delayq_url": os.environ.get("DELAYQ_TEST_STORE", BROKER),
        "broker_connection_retry_on_startup": True,
        **json.loads(os.environ.get("DELAYQ_TEST_CONF", "{}")),
    }
)
