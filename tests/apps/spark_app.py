"""A Celery app named by the Spark tests' ``app`` option (``tests.apps.spark_app:app``).

Its task carries its own routing and limits, which a bare app would not know: jobs
written with this app must carry them, as ``apply_at`` on the task would.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_delayq import DelayedTask

app = Celery(
    "spark-app", set_as_current=False, broker=os.environ.get("DELAYQ_TEST_STORE", "redis://127.0.0.1:1/0")
)
app.conf.update(task_ignore_result=True, delayq_prefix="sparkq", delayq_shards=8)


@app.task(base=DelayedTask, name="spark.remind", queue="reminders", priority=5, time_limit=30, shared=False)
def remind(user_id: int, text: str = "") -> None:
    return None
