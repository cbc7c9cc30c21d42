"""celery-delayq: timed delivery for Celery.

Jobs wait in sharded Redis sorted sets instead of worker memory or the broker;
any number of ``celery beat -S celery_delayq.Scheduler`` processes claim them
when due and publish them into their tasks' normal queues.
"""

from __future__ import annotations

from .admin.jobs import DelayQ, PendingJob
from .beat.scheduler import Scheduler
from .config import DelayQConfig
from .exceptions import (
    BatchExists,
    ConfigurationError,
    CorruptData,
    DelayQError,
    InvalidArguments,
    InvalidBatch,
    InvalidDueTime,
    InvalidOptions,
    InvalidSchedule,
    InvalidTaskId,
    PayloadTooLarge,
    ReservedTaskId,
    ScheduleError,
    ScheduleExists,
    ScheduleNotFound,
    SerializationError,
    StoreError,
    StoreFull,
    UnknownTask,
    UnsupportedServer,
)
from .flow import slots as _slots  # noqa: F401  (its task receivers: the slots of gated tasks)
from .flow.batch import BatchResult
from .producer.canvas import apply_at, apply_in
from .producer.result import ScheduledResult
from .producer.task import DelayedTask, DelayQTaskMixin, delayed_task
from .schedules.api import Schedules
from .schedules.rules import CronRule, IntervalRule, OnceRule
from .schedules.spec import Schedule, ScheduleSpec
from .worker import lateness as _worker  # noqa: F401  (its worker_init receiver: delayq_record_lateness)

__version__ = "0.1.0"

__all__ = [
    "BatchExists",
    "BatchResult",
    "ConfigurationError",
    "CorruptData",
    "CronRule",
    "DelayQ",
    "DelayQConfig",
    "DelayQError",
    "DelayQTaskMixin",
    "DelayedTask",
    "IntervalRule",
    "InvalidArguments",
    "InvalidBatch",
    "InvalidDueTime",
    "InvalidOptions",
    "InvalidSchedule",
    "InvalidTaskId",
    "OnceRule",
    "PayloadTooLarge",
    "PendingJob",
    "ReservedTaskId",
    "Schedule",
    "ScheduleError",
    "ScheduleExists",
    "ScheduleNotFound",
    "ScheduleSpec",
    "ScheduledResult",
    "Scheduler",
    "Schedules",
    "SerializationError",
    "StoreError",
    "StoreFull",
    "UnknownTask",
    "UnsupportedServer",
    "__version__",
    "apply_at",
    "apply_in",
    "delayed_task",
]
