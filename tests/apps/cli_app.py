"""A small Celery app for the ``celery -A tests.apps.cli_app delayq ...`` subprocess test.

Configured from the environment: ``DELAYQ_CLI_URL`` (Redis URL of the broker and the
store), optional ``DELAYQ_CLI_PREFIX`` (the ``delayq_prefix``) and optional
``DELAYQ_CLI_CONF`` (JSON of more app settings).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_delayq import DelayedTask

URL = os.environ.get("DELAYQ_CLI_URL", "redis://127.0.0.1:1/0")

app = Celery("cli", broker=URL)
app.conf.update(
    delayq_url=URL,
    delayq_prefix=os.environ.get("DELAYQ_CLI_PREFIX", "delayq"),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    **json.loads(os.environ.get("DELAYQ_CLI_CONF", "{}")),
)


@app.task(base=DelayedTask, name="cli.remind")
def remind(user_id: int, text: str = "") -> str:
    return f"{user_id}: {text}"


@app.task(base=DelayedTask, name="cli.report")
def report(team: str) -> str:
    return team
