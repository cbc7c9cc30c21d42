"""celery-delayq: timed delivery for Celery.

Jobs wait in sharded Redis sorted sets instead of worker memory or the broker;
any number of ``celery beat -S celery_delayq.Scheduler`` processes claim them
when due and publish them into their tasks' normal queues.
"""

from __future__ import annotations

from .api import DelayQ, PendingJob
from .config import DelayQConfig
from .exceptions import (
    ConfigurationError,
    DelayQError,
    InvalidDueTime,
    InvalidOptions,
    PayloadTooLarge,
    ScheduleError,
    SerializationError,
    StoreError,
    UnsupportedServer,
)
from .result import ScheduledResult
from .scheduler import Scheduler
from .task import DelayedTask, DelayQTaskMixin, delayed_task

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DelayQ",
    "DelayQConfig",
    "DelayQError",
    "DelayQTaskMixin",
    "DelayedTask",
    "InvalidDueTime",
    "InvalidOptions",
    "PayloadTooLarge",
    "PendingJob",
    "ScheduleError",
    "ScheduledResult",
    "Scheduler",
    "SerializationError",
    "StoreError",
    "UnsupportedServer",
    "__version__",
    "delayed_task",
]
