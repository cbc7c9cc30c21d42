"""Scheduling jobs from a Spark DataFrame, and reading the pending schedule back into one.

The Spark face is a Python Data Source named ``delayq`` (Spark 4's
``pyspark.sql.datasource``; pyspark is imported only when it is used)::

    (df.write.format("delayq")
        .option("url", "redis://redis:6379/0")
        .option("task", "proj.tasks.remind")
        .option("dueColumn", "remind_at")
        .option("kwargs", "user_id,text")
        .option("idTemplate", "reminder:{user_id}:{day}")
        .mode("append").save())

    pending = spark.read.format("delayq").option("url", "redis://redis:6379/0").load()

Installing celery-delayq registers the name ``delayq`` with Spark (through the
``pyspark_delayq`` module Spark looks for); :func:`register` does it by hand.

What this package owns, a module each:

- :mod:`.options`: the options of a write and a read, parsed and checked on the driver;
- :mod:`.writer`: :func:`write_rows` schedules an iterable of row mappings (the Spark writer
  feeds Arrow batches, a partition at a time, to a :class:`JobWriter`);
- :mod:`.reader`: :func:`read_shard` lists the jobs of one shard in a due-time range;
- :mod:`.source`: the data source itself, the one module that imports pyspark (an optional
  dependency): this package loads it only when Spark asks for it, so everything else here
  runs without pyspark. It builds on the modules above, never on this one: no import cycle.

What it may import from the rest of ``celery_delayq``: the store (:class:`~celery_delayq.store.facade.Store`,
its only way to Redis), the stored format (``envelope``), building envelopes as ``apply_at``
does (``build``) and checking its options as it does (``producer.options``: ``unique_for``),
due times (``due``), the settings (``config``), the gate's park score (``gate``) and the
exceptions. No other module of ``celery_delayq`` imports it (the top-level
``pyspark_delayq`` imports :mod:`.source` for Spark); ``tests/test_layers.py`` checks both.
"""

from __future__ import annotations

from typing import Any

from .options import ReadOptions, StoreOptions, WriteOptions
from .reader import READ_COLUMNS, READ_SCHEMA, read_shard
from .writer import JobWriter, WriteStats, write_rows

__all__ = [
    "READ_COLUMNS",
    "READ_SCHEMA",
    "JobWriter",
    "ReadOptions",
    "StoreOptions",
    "WriteOptions",
    "WriteStats",
    "read_shard",
    "register",
    "write_rows",
]


def register(spark: Any) -> None:
    """Register the ``delayq`` data source with a Spark session (installing the package
    already makes it known to Spark; this is for sessions that do not look it up)."""
    from .source import DelayQDataSource  # pyspark, optional: only when asked for

    spark.dataSource.register(DelayQDataSource)


def __getattr__(name: str) -> Any:
    if name == "DelayQDataSource":
        from .source import DelayQDataSource  # pyspark, optional: only when asked for

        return DelayQDataSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
