"""celery-delayq: timed delivery for Celery.

Jobs wait in sharded Redis sorted sets instead of worker memory or the broker;
any number of ``celery beat -S celery_delayq.Scheduler`` processes claim them
when due and publish them into their tasks' normal queues.
"""

from __future__ import annotations

from .batch import BatchResult
from .canvas import apply_at, apply_in
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
from .extension import DelayQApp, install, reconfigure
from .jobs import DelayQ, PendingJob
from .result import ScheduledResult
from .rules import CronRule, IntervalRule, OnceRule
from .schedule_spec import Schedule, ScheduleSpec
from .scheduler import Scheduler
from .schedules import Schedules
from .task import DelayedTask, DelayQTaskMixin, delayed_task

__version__ = "0.1.0"

__all__ = [
    "BatchExists",
    "BatchResult",
    "ConfigurationError",
    "CorruptData",
    "CronRule",
    "DelayQ",
    "DelayQApp",
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
    "install",
    "reconfigure",
]
