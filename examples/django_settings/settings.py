"""Django-style settings of the site (``mysite/settings.py`` in a real project).

With ``namespace="CELERY"``, Celery reads every ``CELERY_<NAME>`` here as its setting
``<name>``; celery-delayq's settings follow the same rule: ``CELERY_DELAYQ_URL`` is
``delayq_url``, ``CELERY_DELAYQ_SHARDS`` is ``delayq_shards``, and so on (docs/settings.md).
Names without the prefix are Django's own and Celery ignores them.
"""

from __future__ import annotations

import os

# -- Django (an excerpt; nothing here needs Django to be installed) --------------------------------
DEBUG = False
TIME_ZONE = "Europe/Paris"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "examples.django_settings",  # has a tasks.py, found by app.autodiscover_tasks()
]

REDIS_URL = os.environ.get("DELAYQ_EXAMPLE_URL", "redis://127.0.0.1:6379/0")

# -- Celery ----------------------------------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery 5 workers warn that 'CELERY_TIMEZONE' is deprecated: a false alarm under the CELERY
# namespace (celery/celery#6366), the setting is read as `timezone`.
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_IGNORE_RESULT = True
# `celery -A examples.django_settings beat` then uses delayq's scheduler without -S.
CELERY_BEAT_SCHEDULER = "celery_delayq.Scheduler"

# -- celery-delayq ---------------------------------------------------------------------------------
# The job store (optional with a Redis broker: it defaults to the broker URL).
CELERY_DELAYQ_URL = REDIS_URL
# Key prefix: "mysite:{mysite:0}:due", ... (producers and beats must agree on url, prefix, shards).
CELERY_DELAYQ_PREFIX = "mysite"
CELERY_DELAYQ_SHARDS = 4
# Existing code unchanged: apply_async(countdown=/eta=) and self.retry(countdown=) of
# DelayedTask tasks are stored in delayq instead of waiting in a worker's memory.
CELERY_DELAYQ_INTERCEPT_ETA = True
# A beat that dies holding claimed jobs: another beat delivers them after 60 s.
CELERY_DELAYQ_RECLAIM_TTL = 60
# Jobs one claim takes from one shard.
CELERY_DELAYQ_BATCH_SIZE = 200
