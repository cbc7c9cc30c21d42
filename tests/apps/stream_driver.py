"""A Spark streaming driver for the sink's fault tests: it streams a folder of JSON-lines events
into ``format("delayq")`` (``availableNow``, ``maxFilesPerTrigger`` files a micro-batch) and
exits when every file is written.

    python -m tests.apps.stream_driver EVENTS CHECKPOINT REDIS_URL FILES_PER_BATCH [KILL_AT_BATCH]
    (and STREAM_SHUTDOWN_AT_BATCH=N in the environment: see KillingWriter)

With ``KILL_AT_BATCH``, the commit of that micro-batch SIGKILLs the driver's whole process group
(the Python driver, its JVM and its Python workers) after every partition's jobs were written
and before the sink or Spark recorded the batch as committed: a driver that dies between a
micro-batch's writes and its commit. Start it in a session of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

import redis
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from celery_delayq.spark.source import DelayQDataSource, _StreamWriter


class KillingWriter(_StreamWriter):
    """The sink's stream writer, whose commit of batch ``$STREAM_KILL_AT_BATCH`` kills the driver,
    and whose partition 0 of batch ``$STREAM_SHUTDOWN_AT_BATCH`` shuts the Redis server down
    (``SHUTDOWN SAVE``) once it has written its jobs."""

    def write(self, iterator: Any) -> Any:
        from pyspark import TaskContext

        done = super().write(iterator)
        context = TaskContext.get()
        batch = context.getLocalProperty("streaming.sql.batchId") if context else None
        at = os.environ.get("STREAM_SHUTDOWN_AT_BATCH")
        if context is not None and at == batch and context.partitionId() == 0:
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis.from_url(os.environ["STREAM_REDIS_URL"]).shutdown(save=True)
        return done

    def commit(self, messages: list[Any], batchId: int) -> None:
        if batchId == int(os.environ.get("STREAM_KILL_AT_BATCH", "-1")):
            os.killpg(int(os.environ["STREAM_DRIVER_PGID"]), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # (Spark may run this in a process of its own session)
        super().commit(messages, batchId)


class KillingSink(DelayQDataSource):
    """``delayq``, whose stream commit of batch ``$STREAM_KILL_AT_BATCH`` kills the driver."""

    @classmethod
    def name(cls) -> str:
        return "delayq_killing"

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        return KillingWriter(super().streamWriter(schema, overwrite).options)  # type: ignore[attr-defined]


def main(events: str, checkpoint: str, url: str, per_batch: str, kill_at: str = "-1") -> None:
    os.environ["STREAM_DRIVER_PGID"] = str(os.getpgrp())
    os.environ["STREAM_KILL_AT_BATCH"] = kill_at
    os.environ["STREAM_REDIS_URL"] = url
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(KillingSink)
    events_df = (
        spark.readStream.schema("user_id long, text string, due timestamp")
        .option("maxFilesPerTrigger", int(per_batch))
        .json(events)
    )
    query = (
        events_df.writeStream.format("delayq_killing")
        .option("url", url)
        .option("task", "e2e.record")
        .option("args", "user_id")
        .option("kwargs", "text")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    print(f"query {query.id} done", flush=True)
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
