"""Settings of the example project (plain Celery settings; ``delayq_*`` are celery-delayq's).

Every URL comes from ``DELAYQ_EXAMPLE_URL`` (default: the local Redis, database 0).
"""

from __future__ import annotations

import os
from datetime import timedelta

URL = os.environ.get("DELAYQ_EXAMPLE_URL", "redis://127.0.0.1:6379/0")

# -- Celery --------------------------------------------------------------------------------------
broker_url = URL
broker_connection_retry_on_startup = True
task_ignore_result = True  # the tasks record what they did themselves
timezone = "UTC"  # schedules without tz= use it; apply_at takes naive datetimes (as UTC) only here
imports = ("examples.project.tasks",)

# -- celery-delayq -------------------------------------------------------------------------------
# The job store. With a Redis broker it defaults to the broker URL; when both name the same
# server and database, a beat pushes each message and removes its job in one script (the push
# path, delayq_push).
delayq_url = URL
# Every key starts with this prefix, so several projects can share one Redis.
delayq_prefix = "project"
# Jobs are spread over this many sorted sets (one Redis Cluster slot each). Producers and
# beats must agree on url, prefix and shards.
delayq_shards = 8
# How long a beat holds the jobs it claimed; if it dies, another beat delivers them after this.
delayq_reclaim_ttl = 30.0
# The longest a beat sleeps without looking at every shard (it is woken earlier by new jobs).
delayq_max_sleep = 10.0
# Left at its default (False) here: True would send plain apply_async(countdown=...) and
# self.retry(countdown=...) of DelayedTask tasks through delayq too (see examples/django_settings).
delayq_intercept_eta = False

# -- beat ------------------------------------------------------------------------------------------
# `celery -A examples.project beat` then needs no -S option.
beat_scheduler = "celery_delayq.Scheduler"
# Each beat stores these entries in Redis at start, as recurring schedules, so each run happens
# once however many beats run. (Every 5 s so the demo sees it fire; a real project would purge
# every few minutes.)
beat_schedule = {
    "purge-expired-sessions": {
        "task": "examples.project.tasks.purge_sessions",
        "schedule": timedelta(seconds=5),
    },
}
