"""Daily reminders for a users table, planned in Spark and delivered by Celery.

A complete pipeline around the ``delayq`` Spark data source (:mod:`celery_delayq.spark`):

1. a users table (generated, 10,000 rows by default, or read from Parquet): ``user_id``,
   ``name``, ``locale``, ``timezone`` (IANA), and the preferred local ``hour`` and ``minute``;
2. each user's next reminder at that local time, daylight-saving correct, computed with
   Spark SQL functions (:func:`with_next_reminder`);
3. one job per user written with ``df.write.format("delayq")``, with the id
   ``reminder:{user_id}:{local_date}``: running the pipeline again keeps the jobs already
   pending, so it is idempotent;
4. the schedule read back with ``spark.read.format("delayq")``, the pending load per
   minute over the next 24 h written as CSV and as a PNG chart, and a summary printed.

Run it (from the repository root), with a worker and a beat to deliver the reminders:

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.spark_reminders worker -l info
    celery -A examples.spark_reminders beat -S celery_delayq.Scheduler -l info
    python -m examples.spark_reminders [--url URL] [--users N] [--parquet PATH] [--out DIR]
                                       [--master local[2]] [--now ISO-8601]

``--url`` (else ``$DELAYQ_EXAMPLE_URL``) names the Redis of the jobs; the worker and the
beat take theirs from ``$DELAYQ_EXAMPLE_URL``. With neither, the pipeline runs against a
throwaway Redis of its own (:mod:`celery_delayq.devtools.embedded`) that is gone when it ends.
pyspark is imported only by the pipeline, not by the worker that runs :func:`remind`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import available_timezones

import redis
from celery import Celery

from celery_delayq import DelayedTask

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

ROOT = Path(__file__).resolve().parent.parent
URL_ENV = "DELAYQ_EXAMPLE_URL"
URL = os.environ.get(URL_ENV)  # the worker's and the beat's broker and store
TASK = "examples.spark_reminders.remind"
RUNS = "examples:spark_reminders:runs"  # HINCRBY <task id> 1 per run
SENT = "examples:spark_reminders:sent"  # RPUSH <json> per run
ID_TEMPLATE = "reminder:{user_id}:{local_date}"
CSV_NAME, PNG_NAME = "load_per_minute.csv", "load_per_minute.png"

app = Celery("spark_reminders", broker=URL, set_as_current=False)
app.conf.update(delayq_url=URL, task_ignore_result=True, broker_connection_retry_on_startup=True)

_recorder: redis.Redis | None = None


@app.task(base=DelayedTask, bind=True, name=TASK, shared=False)  # type: ignore[untyped-decorator]
def remind(
    self: Any, user_id: int, name: str, locale: str, timezone: str, local_date: str, local_time: str
) -> str:
    """Pretend to notify the user; record the run (``HINCRBY RUNS <id> 1``, ``RPUSH SENT``)."""
    global _recorder
    text = f"{name} ({locale}): your daily reminder, {local_date} {local_time} {timezone}"
    if _recorder is None:
        _recorder = redis.Redis.from_url(URL or "")
    record = {"id": self.request.id, "user_id": user_id, "local_date": local_date,
              "local_time": local_time, "timezone": timezone, "ran": time.time()}  # fmt: skip
    pipe = _recorder.pipeline(transaction=False)
    pipe.hincrby(RUNS, self.request.id, 1)
    pipe.rpush(SENT, json.dumps(record))
    pipe.execute()
    return text


# -- the users table ------------------------------------------------------------------------------

#: IANA zones and their weight in the generated table: daylight saving in the north (US, EU)
#: and in the south (Sydney, Auckland), half-hour and 45-minute offsets (Kolkata, St John's,
#: Kathmandu, Chatham), a 30-minute DST shift (Lord Howe), zones without DST (Sao Paulo since
#: 2019, Tokyo, UTC).
ZONES: dict[str, tuple[int, str]] = {
    "America/New_York": (16, "en-US"),
    "Europe/London": (14, "en-GB"),
    "America/Los_Angeles": (10, "en-US"),
    "Europe/Berlin": (10, "de-DE"),
    "Asia/Kolkata": (10, "hi-IN"),
    "America/Sao_Paulo": (8, "pt-BR"),
    "Australia/Sydney": (8, "en-AU"),
    "Asia/Tokyo": (6, "ja-JP"),
    "UTC": (6, "en"),
    "Pacific/Auckland": (5, "en-NZ"),
    "America/St_Johns": (2, "en-CA"),
    "Asia/Kathmandu": (2, "ne-NP"),
    "Australia/Lord_Howe": (2, "en-AU"),
    "Pacific/Chatham": (1, "en-NZ"),
}
#: Preferred local hours and their weight: mostly mornings and evenings, a few night owls
#: whose 01:00-03:00 is the hour that spring-forward days skip and fall-back days repeat.
HOURS: dict[int, int] = {
    0: 1, 1: 2, 2: 2, 3: 1, 5: 2, 6: 6, 7: 14, 8: 16, 9: 12, 10: 6, 12: 8, 13: 3,
    17: 4, 18: 8, 19: 7, 20: 5, 21: 2, 22: 1,
}  # fmt: skip
NAMES = ("Ada", "Bo", "Chen", "Dara", "Emeka", "Farah", "Giulia", "Hiro", "Ines", "Jonas",
         "Kavya", "Luis", "Mele", "Noor", "Olga", "Priya", "Quinn", "Rangi", "Sofia", "Tane")  # fmt: skip


def generate_users(spark: SparkSession, n: int, seed: int = 7) -> DataFrame:
    """``n`` users (``user_id`` 1..n), the same for the same ``n`` and ``seed`` on any cluster:
    every column is a hash of the row's id, so no partitioning or ordering changes it."""
    from pyspark.sql import functions as F

    def pick(values: Sequence[Any], weights: Sequence[int], salt: str) -> Column:
        expanded = [v for v, w in zip(values, weights, strict=True) for _ in range(w)]
        h = F.pmod(F.xxhash64(F.col("id"), F.lit(seed), F.lit(salt)), F.lit(len(expanded)))
        return F.element_at(F.array(*[F.lit(v) for v in expanded]), (h + 1).cast("int"))

    zones = list(ZONES)
    locales = F.create_map(*[F.lit(x) for zone, (_, loc) in ZONES.items() for x in (zone, loc)])
    h = F.xxhash64(F.col("id"), F.lit(seed), F.lit("minute"))
    # a quarter hour for most users, any minute for one in ten
    minute = F.when(F.pmod(h, 10) == 0, F.pmod(F.shiftright(h, 8), 60)).otherwise(F.pmod(h, 4) * 15)
    return (
        spark.range(1, n + 1, numPartitions=max(1, min(8, n // 2500)))
        .select(
            F.col("id").alias("user_id"),
            pick(NAMES, [1] * len(NAMES), "name").alias("name"),
            pick(zones, [w for w, _ in ZONES.values()], "zone").alias("timezone"),
            pick(list(HOURS), list(HOURS.values()), "hour").alias("hour"),
            minute.cast("int").alias("minute"),
        )
        .withColumn("locale", locales[F.col("timezone")])
        .select("user_id", "name", "locale", "timezone", "hour", "minute")
    )


def load_users(spark: SparkSession, path: str) -> DataFrame:
    """Users from Parquet: ``user_id``, ``timezone``, ``hour`` required; ``minute`` (0),
    ``name`` ("user <id>") and ``locale`` ("en") optional. Bad rows are refused, not skipped."""
    from pyspark.sql import functions as F

    df = spark.read.parquet(path)
    missing = [c for c in ("user_id", "timezone", "hour") if c not in df.columns]
    if missing:
        raise SystemExit(f"{path}: no column {', '.join(missing)} (its columns: {', '.join(df.columns)})")
    users = df.select(
        F.col("user_id").cast("bigint").alias("user_id"),
        (F.col("name") if "name" in df.columns else F.format_string("user %d", "user_id"))
        .cast("string")
        .alias("name"),
        (F.col("locale") if "locale" in df.columns else F.lit("en")).cast("string").alias("locale"),
        F.col("timezone").cast("string").alias("timezone"),
        F.col("hour").cast("int").alias("hour"),
        (F.col("minute") if "minute" in df.columns else F.lit(0)).cast("int").alias("minute"),
    )
    bad = users.where(
        F.col("user_id").isNull() | F.col("timezone").isNull()
        | ~F.col("hour").between(0, 23) | ~F.col("minute").between(0, 59)
        | F.col("hour").isNull() | F.col("minute").isNull()
    ).count()  # fmt: skip
    if bad:
        raise SystemExit(
            f"{path}: {bad} row(s) without a user_id or timezone, or with hour/minute out of range"
        )
    return users


def check_timezones(users: DataFrame) -> None:
    """Refuse zone names Python's zoneinfo does not know (Spark would fail mid-write on them)."""
    known = available_timezones() | {"UTC"}
    unknown = sorted(r[0] for r in users.select("timezone").distinct().collect() if r[0] not in known)
    if unknown:
        raise SystemExit(f"unknown time zones in the users table: {', '.join(unknown[:10])}")


# -- the next reminder ------------------------------------------------------------------------------


def _offset(instant: Column, tz: Column) -> Column:
    """The UTC offset, in seconds, of zone ``tz`` at ``instant`` (seconds since the epoch).

    ``from_utc_timestamp`` turns an instant into the zone's wall clock (as a timestamp read in
    UTC); going that way is always well defined, unlike local -> instant."""
    from pyspark.sql import functions as F

    return F.unix_seconds(F.from_utc_timestamp(F.timestamp_seconds(instant), tz)) - instant


def _instant_of_wall(wall: Column, tz: Column) -> Column:
    """The instant (epoch seconds) at which the wall clock of ``tz`` shows ``wall`` (the local
    date and time as seconds since 1970-01-01T00:00 local), by an explicit rule:

    * the usual case: the one instant whose local time is ``wall``;
    * ``wall`` happens twice (fall-back day, e.g. 01:30 in New York on 2026-11-01): the
      FIRST occurrence, still on daylight time. One reminder per local date, on the first
      moment the clock shows the time; the repeated hour does not remind again;
    * ``wall`` never happens (spring-forward day, e.g. 02:30 in New York on 2027-03-14):
      ``wall`` read with the offset in force just before the jump, which moves it forward by
      the length of the gap (02:30 -> 03:30 EDT; 02:15 -> 02:45 on Lord Howe's 30-minute
      jump). The reminder still comes that day, as long after the jump as it was meant to
      come after its start. (This is also what ``zoneinfo`` gives with ``fold=0`` and what
      ``java.time`` does; it is spelled out here rather than left to either.)

    Candidates are ``wall`` minus the offset a day before and a day after (zones change
    their offset at most once in two days); a candidate is real when its local time is
    ``wall`` again."""
    from pyspark.sql import functions as F

    before = wall - _offset(wall - 86_400, tz)
    after = wall - _offset(wall + 86_400, tz)
    before_ok = before + _offset(before, tz) == wall
    after_ok = after + _offset(after, tz) == wall
    return (
        F.when(before_ok & after_ok, F.least(before, after))  # one instant, or the first of two
        .when(before_ok, before)
        .when(after_ok, after)
        .otherwise(before)  # skipped: moved forward by the gap
    )


def with_next_reminder(users: DataFrame, now: datetime | Column) -> DataFrame:
    """``users`` with each user's next reminder strictly after ``now``:

    * ``due``: the instant (TIMESTAMP) of the next local ``hour:minute`` (see
      :func:`_instant_of_wall` for the days on which that time is skipped or repeated);
    * ``local_date``: the local date it is for (``yyyy-MM-dd``; part of the job id);
    * ``local_time``: the wall clock at ``due`` (``HH:mm``; differs from the preferred time
      only when the day skipped it);
    * ``shifted``: the preferred time did not exist that day;
    * ``crosses_dst``: the zone's UTC offset at ``due`` is not the one at ``now``.

    Pure Spark SQL functions on seconds since the epoch, so the session time zone does not
    matter. ``now`` is a datetime (naive: UTC) or a TIMESTAMP column."""
    from pyspark.sql import Column as SparkColumn
    from pyspark.sql import functions as F

    if isinstance(now, SparkColumn):
        now_s = F.unix_seconds(now)
    else:
        aware = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
        now_s = F.lit(int(aware.timestamp() // 1))  # due times are whole minutes: > floor(now) suffices
    tz = F.col("timezone")
    clock = F.col("hour").cast("bigint") * 3600 + F.col("minute").cast("bigint") * 60
    today = F.floor((now_s + _offset(now_s, tz)) / 86_400)  # the local date now, in days since 1970
    first = _instant_of_wall(today * 86_400 + clock, tz)
    second = _instant_of_wall((today + 1) * 86_400 + clock, tz)  # always after now
    day = F.when(first > now_s, today).otherwise(today + 1)
    due = F.when(first > now_s, first).otherwise(second)
    local = F.col("_due_s") + _offset(F.col("_due_s"), tz)
    return (
        users.withColumn("_due_s", due)
        .withColumn("_day", day.cast("int"))
        .select(
            *users.columns,
            F.timestamp_seconds("_due_s").alias("due"),
            F.date_from_unix_date("_day").cast("string").alias("local_date"),
            F.format_string(
                "%02d:%02d",
                F.floor(F.pmod(local, 86_400) / 3600).cast("int"),
                F.floor(F.pmod(local, 3600) / 60).cast("int"),
            ).alias("local_time"),
            (F.col("_day").cast("bigint") * 86_400 + clock != local).alias("shifted"),
            (_offset(F.col("_due_s"), tz) != _offset(now_s, tz)).alias("crosses_dst"),
        )
    )


# -- the pipeline ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """What one run did."""

    users: int
    written: int
    write_seconds: float
    pending: int
    due_24h: int
    shifted: int
    crosses_dst: int
    busiest: tuple[datetime, int] | None
    csv: Path
    png: Path

    def summary(self) -> str:
        rate = self.written / self.write_seconds if self.write_seconds > 0 else float("inf")
        busiest = (f"{self.busiest[0]:%Y-%m-%d %H:%M} UTC, {self.busiest[1]} jobs"
                   if self.busiest else "none (no job due in the next 24 h)")  # fmt: skip
        return "\n".join([
            f"users: {self.users}",
            f"jobs written: {self.written} in {self.write_seconds:.2f} s ({rate:,.0f} rows/s; a session's "
            "first write also starts Spark's Python workers)",
            f"  ids {ID_TEMPLATE} (running again keeps those still pending)",
            f"  on a skipped local time (moved forward by the DST gap): {self.shifted}; "
            f"across a UTC-offset change: {self.crosses_dst}",
            f"pending reminders: {self.pending}",
            f"due in the next 24 h: {self.due_24h}",
            f"busiest minute: {busiest}",
            f"wrote {self.csv} and {self.png}",
        ])  # fmt: skip


def write_jobs(jobs: DataFrame, url: str) -> None:
    """One ``remind`` job per row, due at ``due``; an id still pending is kept as it is."""
    (
        jobs.write.format("delayq")
        .option("url", url)
        .option("task", TASK)
        .option("dueColumn", "due")
        .option("kwargs", "user_id,name,locale,timezone,local_date,local_time")
        .option("idTemplate", ID_TEMPLATE)
        .option("expires", "3600")  # a reminder more than an hour late is not sent
        .mode("append")
        .save()
    )


def load_per_minute(spark: SparkSession, url: str, start: datetime, hours: int = 24) -> list[tuple[int, int]]:
    """``(minute, jobs)`` for every minute of ``[start, start + hours)`` (epoch seconds of the
    minute, UTC), counting the pending ``remind`` jobs due in it, from ``format("delayq")``."""
    from pyspark.sql import functions as F

    end = start + timedelta(hours=hours)
    due = F.col("due")
    window = (
        spark.read.format("delayq").option("url", url).load()
        .where((due >= F.lit(start)) & (due < F.lit(end)))  # pushed down: a score range per shard
        .where((F.col("task") == TASK) & (F.col("state") != "dead"))
    )  # fmt: skip
    seconds = F.unix_seconds(due)
    per_minute = window.groupBy((seconds - F.pmod(seconds, 60)).alias("minute")).count()
    counts: dict[int, int] = {row["minute"]: row["count"] for row in per_minute.collect()}
    first = int(start.timestamp()) // 60 * 60
    return [(m, counts.get(m, 0)) for m in range(first, math.ceil(end.timestamp()), 60)]


def write_outputs(load: list[tuple[int, int]], out: Path) -> tuple[Path, Path]:
    """The load as CSV (``minute,jobs``; minute in ISO-8601 UTC) and as a PNG chart."""
    from matplotlib import dates as mdates
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / CSV_NAME, out / PNG_NAME
    minutes = [datetime.fromtimestamp(m, UTC) for m, _ in load]
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["minute", "jobs"])
        writer.writerows((f"{t:%Y-%m-%dT%H:%MZ}", n) for t, (_, n) in zip(minutes, load, strict=True))
    fig = Figure(figsize=(12, 4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    # A step outline, not 1,440 bars: bars thinner than a pixel get dropped when rendered.
    counts = [n for _, n in load]
    ax.fill_between(minutes, counts, step="post", color="tab:blue", linewidth=0.8)  # type: ignore[arg-type]
    ax.set_ylim(0, max(counts, default=0) * 1.05 + 1)
    ax.set_title(f"Pending reminders per minute, {minutes[0]:%Y-%m-%d %H:%M} UTC + 24 h" if minutes else "")
    ax.set_xlabel("due (UTC)")
    ax.set_ylabel("jobs per minute")
    ax.xaxis.set_major_locator(mdates.HourLocator(interval=2, tz=UTC))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
    if minutes:
        ax.set_xlim(minutes[0], minutes[-1] + timedelta(minutes=1))  # type: ignore[arg-type]
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(png_path, format="png")  # Figure.savefig renders with Agg
    return csv_path, png_path


def run(spark: SparkSession, url: str, users: DataFrame, now: datetime, out: Path) -> Report:
    """Plan, write, read back and chart (steps 2-4 of the module docstring)."""
    from pyspark.sql import functions as F

    check_timezones(users)
    jobs = with_next_reminder(users, now).cache()
    try:
        n, shifted, crossing = jobs.select(
            F.count(F.lit(1)), F.count_if("shifted"), F.count_if("crosses_dst")
        ).first()  # type: ignore[misc]
        started = time.perf_counter()
        write_jobs(jobs, url)
        elapsed = time.perf_counter() - started
    finally:
        jobs.unpersist()
    pending = (
        spark.read.format("delayq").option("url", url).load()
        .where((F.col("task") == TASK) & (F.col("state") != "dead"))
        .count()
    )  # fmt: skip
    load = load_per_minute(spark, url, now)
    csv_path, png_path = write_outputs(load, out)
    top = max(load, key=lambda x: (x[1], -x[0]), default=None)
    busiest = (datetime.fromtimestamp(top[0], UTC), top[1]) if top and top[1] else None
    return Report(users=n, written=n, write_seconds=elapsed, pending=pending,
                  due_24h=sum(c for _, c in load), shifted=shifted, crosses_dst=crossing,
                  busiest=busiest, csv=csv_path, png=png_path)  # fmt: skip


def start_spark(master: str) -> SparkSession:
    """A Spark session for the example: UTC, no UI, filter pushdown on, bound to loopback."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this interpreter (and its venv)
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:  # executors import celery_delayq (the data source) from here too
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
    import warnings

    from pyspark.sql import SparkSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pyspark's note on the pandas version
        spark = (
            SparkSession.builder.master(master)
            .appName("spark-reminders")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.python.filterPushdown.enabled", "true")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _instant(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.spark_reminders", description=__doc__.split("\n")[0])
    p.add_argument("--url", help=f"Redis URL of the jobs (default: ${URL_ENV}, else a throwaway Redis)")
    p.add_argument("--users", type=int, default=10_000, help="users to generate (default: 10000)")
    p.add_argument("--seed", type=int, default=7, help="seed of the generated users (default: 7)")
    p.add_argument("--parquet", help="read the users from this Parquet file or folder instead")
    p.add_argument("--out", default="spark_reminders_out", help="folder of the CSV and the PNG")
    p.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    p.add_argument(
        "--now", type=_instant, help="plan from this instant (ISO-8601; naive: UTC) instead of now"
    )
    args = p.parse_args(argv)
    if args.users < 1:
        p.error("--users must be at least 1")
    return args


def main(argv: Sequence[str] | None = None, spark: SparkSession | None = None) -> int:
    """Run the pipeline; ``spark``: an existing session to use (else one is started and stopped)."""
    args = parse_args(argv)
    now = args.now or datetime.now(UTC)
    url = args.url or os.environ.get(URL_ENV)
    with contextlib.ExitStack() as stack:
        if not url:
            from celery_delayq.devtools.embedded import EmbeddedRedis

            url = stack.enter_context(EmbeddedRedis()).url + "/0"
            print(f"no --url and no ${URL_ENV}: a throwaway Redis at {url}; no worker will see the jobs")
        if spark is None:
            spark = start_spark(args.master)
            stack.callback(spark.stop)
        from celery_delayq.spark import register

        register(spark)  # an installed celery-delayq is found by name; this works from a checkout too
        if args.parquet:
            users = load_users(spark, args.parquet)
        else:
            users = generate_users(spark, args.users, args.seed)
        print(f"planning from {now:%Y-%m-%d %H:%M:%S} UTC, jobs in {url}")
        report = run(spark, url, users, now, Path(args.out))
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
