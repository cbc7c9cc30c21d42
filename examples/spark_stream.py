"""Events to reminders, continuously: a Spark Structured Streaming query into ``delayq``.

A folder of JSON-lines files that keeps growing stands in for Kafka: a feeder thread writes a
file of events every second (``event_id``, ``user_id``, ``text``, ``at``), and a streaming
query reads each new file, computes a reminder ``--delay`` seconds after each event, and
writes one job per event with ``writeStream.format("delayq")``, keyed by the event's id:

    events.writeStream.format("delayq")
        .option("task", TASK).option("dueColumn", "due")
        .option("args", "user_id").option("kwargs", "text")
        .option("idColumn", "event_id")
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="2 seconds").start()

The sink is exactly once: a micro-batch that Spark writes again (after a crash, or a restart
from the checkpoint) stores none of its jobs twice, even those already delivered, for the
sink's ``uniqueFor`` (7 days unless given; see docs/spark.md, "Streaming"). Stop the example
and start it again with the same ``--checkpoint``: it goes on where it stopped.

Run it (from the repository root), with a worker and a beat to deliver the reminders:

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.spark_stream worker -l info
    celery -A examples.spark_stream beat -S celery_delayq.Scheduler -l info
    python -m examples.spark_stream [--url URL] [--seconds 20] [--per-second 100] [--delay 10]
                                    [--events DIR] [--checkpoint DIR]

``--url`` (else ``$DELAYQ_EXAMPLE_URL``) names the Redis of the jobs; with neither, the query
writes to a throwaway Redis of its own that is gone when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import Celery

from celery_delayq import DelayedTask, DelayQ

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

URL_ENV = "DELAYQ_EXAMPLE_URL"
URL = os.environ.get(URL_ENV)  # the worker's and the beat's broker and store
TASK = "examples.spark_stream.remind"

app = Celery("spark_stream", broker=URL, set_as_current=False)
app.conf.update(delayq_url=URL, task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(base=DelayedTask, name=TASK, shared=False)  # type: ignore[untyped-decorator]
def remind(user_id: int, text: str) -> str:
    """Pretend to notify the user."""
    return f"reminded user {user_id}: {text}"


def feed(folder: Path, stop: threading.Event, per_second: int) -> int:
    """Write a file of ``per_second`` events every second until ``stop``; the events written.
    Each file appears whole (written aside, then renamed), as Spark's file source wants."""
    written = 0
    while not stop.is_set():
        lines = []
        for _ in range(per_second):
            event = {"event_id": f"event-{uuid.uuid4()}", "user_id": written % 1000,
                     "text": f"about event {written}", "at": time.time()}  # fmt: skip
            lines.append(json.dumps(event))
            written += 1
        part = folder / f"events-{time.time_ns()}.json"
        tmp = folder.parent / f".{part.name}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(part)
        stop.wait(1.0)
    return written


def stream(spark: SparkSession, url: str, events: Path, checkpoint: Path, delay: float) -> Any:
    """Start the query: each event's reminder, ``delay`` seconds after it, one job per event id."""
    from pyspark.sql import functions as F

    rows = spark.readStream.schema("event_id string, user_id long, text string, at double").json(str(events))
    reminders = rows.select(
        "event_id", "user_id", "text", F.timestamp_seconds(F.col("at") + F.lit(delay)).alias("due")
    )
    return (
        reminders.writeStream.format("delayq")
        .option("url", url)
        .option("task", TASK)
        .option("dueColumn", "due")
        .option("args", "user_id")
        .option("kwargs", "text")
        .option("idColumn", "event_id")
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="2 seconds")
        .start()
    )


def start_spark(master: str) -> SparkSession:
    """A Spark session for the example: UTC, no UI, bound to loopback."""
    from examples.spark_reminders import start_spark as start

    return start(master)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help=f"Redis of the jobs (else ${URL_ENV}, else a throwaway one)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to feed events (20)")
    parser.add_argument("--per-second", type=int, default=100, help="events a second (100)")
    parser.add_argument("--delay", type=float, default=10.0, help="reminder after the event, s (10)")
    parser.add_argument("--events", type=Path, help="the events folder (else a temporary one)")
    parser.add_argument("--checkpoint", type=Path, help="the query's checkpoint (else a temporary one)")
    parser.add_argument("--master", default="local[2]", help="Spark master (local[2])")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, spark: SparkSession | None = None) -> int:
    """Feed events for ``--seconds``, stream them into reminders, then stop and report.
    ``spark``: an existing session to use (else one is started and stopped)."""
    args = parse_args(argv)
    url = args.url or os.environ.get(URL_ENV)
    with contextlib.ExitStack() as stack:
        if not url:
            from celery_delayq.devtools.embedded import EmbeddedRedis

            url = stack.enter_context(EmbeddedRedis()).url + "/0"
            print(f"no --url and no ${URL_ENV}: a throwaway Redis at {url}; no worker will see the jobs")
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="delayq-stream-")))
        events, checkpoint = args.events or work / "events", args.checkpoint or work / "checkpoint"
        events.mkdir(parents=True, exist_ok=True)
        if spark is None:
            spark = start_spark(args.master)
            stack.callback(spark.stop)
        from celery_delayq.spark import register

        register(spark)  # an installed celery-delayq is found by name; this works from a checkout too
        query = stream(spark, url, events, checkpoint, args.delay)
        stop = threading.Event()
        fed: list[int] = []
        feeder = threading.Thread(target=lambda: fed.append(feed(events, stop, args.per_second)))
        feeder.start()
        time.sleep(args.seconds)
        stop.set()
        feeder.join()
        query.processAllAvailable()  # every file fed is written before the query stops
        query.stop()
        client = Celery(broker=url, set_as_current=False)
        client.conf.delayq_url = url
        pending = DelayQ(client).count()
        client.close()
        print(f"query {query.id}: {fed[0]} events fed, {pending} reminders waiting in {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
