"""Scheduling from Spark, and reading the schedule back into it.

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

Behind each side is a plain-Python function that needs no Spark, in :mod:`celery_delayq.bulk`
and named here too: :func:`write_rows` schedules an iterable of row mappings (the Spark
writer feeds it Arrow batches, a partition at a time, through :class:`JobWriter`), and
:func:`read_shard` lists the jobs of one shard in a due-time range.

The data source itself (:mod:`celery_delayq._spark_source`) imports pyspark, an optional
dependency: this module loads it only when Spark asks for it. It imports :mod:`.bulk`, never
this module, so there is no import cycle.
"""

from __future__ import annotations

from typing import Any

from .bulk import (
    READ_COLUMNS,
    READ_SCHEMA,
    JobWriter,
    ReadOptions,
    StoreOptions,
    WriteOptions,
    WriteStats,
    read_shard,
    write_rows,
)

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
