"""celery-delayq: timed delivery for Celery.

Jobs wait in sharded Redis sorted sets instead of worker memory or the broker;
any number of ``celery beat -S celery_delayq.Scheduler`` processes claim them
when due and publish them into their tasks' normal queues.
"""

from __future__ import annotations

from .admin.jobs import DelayQ
from .beat.scheduler import Scheduler
from .config import install
from .exceptions import DelayQError, ScheduleError, StoreError, StoreFull
from .flow.batch import BatchResult
from .producer.canvas import apply_at, apply_in
from .producer.result import ScheduledResult
from .producer.task import DelayedTask, DelayQTaskMixin, delayed_task
from .schedules.api import Schedules
from .schedules.spec import ScheduleSpec

__version__ = "0.1.0"

#: What a caller writes or catches. Everything else is imported from its module: the other
#: errors from :mod:`celery_delayq.exceptions` (each a :class:`DelayQError`), the rules from
#: :mod:`celery_delayq.schedules.rules`, the settings' reader from :mod:`celery_delayq.config`.
__all__ = [
    "BatchResult",
    "DelayQ",
    "DelayQError",
    "DelayQTaskMixin",
    "DelayedTask",
    "ScheduleError",
    "ScheduleSpec",
    "ScheduledResult",
    "Scheduler",
    "Schedules",
    "StoreError",
    "StoreFull",
    "__version__",
    "apply_at",
    "apply_in",
    "delayed_task",
    "install",
]
