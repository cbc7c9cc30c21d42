"""Row ``spark``: jobs scheduled by ``df.write.format("delayq")`` on a local Spark, against one
plain Python process running the same writer, on the same Redis in the same run.

    .venv/bin/python -m bench.spark [--rows 1000000] [--master local[2]]
    .venv/bin/python -m bench --only spark          # the suite's row (200,000 rows; --full: 1M)

It starts its own Redis server (a free loopback port, never 6379) and a local SparkSession
(``local[2]``, no UI, driver on 127.0.0.1, session time zone UTC, executors running this
interpreter with the repository on ``PYTHONPATH``).

- **Ours**: N rows (``user_id`` bigint, ``due`` timestamp spread over the next 3 days, ``text``
  a short string, ``day`` the due date) made by ``spark.range`` and cached (counted, untimed),
  written with ``format("delayq")``, kwargs ``user_id,text`` and ``idTemplate
  reminder:{user_id}:{day}``. Timed from ``save()`` to its return, after an untimed small write
  has started Spark's Python workers (which Spark reuses).
- **Baseline**: the same rows as Python dicts made in this process (untimed), written by
  ``celery_delayq.spark.write_rows`` with the same options: the plain writer (one
  :class:`~celery_delayq.spark.JobWriter`, the same envelopes and ids, pipelined enqueues in
  batches of 5,000 grouped by shard). Redis is flushed before each write.
- A second figure feeds the same rows as Arrow batches of 10,000 (Spark's batch size) to one
  ``JobWriter.add_batch`` in this process: exactly what each Spark partition runs, so the ratio
  is what Spark's parallelism gains net of its own costs.

After each write (untimed) the jobs stored are counted (ZCARD of every shard's due set) and a
sample of ids, computed in Python from the template, is looked up with its due time: a count
other than N, or a missing id, fails the row.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psutil

from .harness import DEFAULT, ROOT, BenchError, Context
from .report import Line, RowResult, notes, table

TASK = "bench.remind"
ID_TEMPLATE = "reminder:{user_id}:{day}"
KWARGS = "user_id,text"
#: Due times: the next whole hour plus ``(i * STEP) % SPREAD_S`` seconds (a prime step spreads
#: consecutive rows over the whole window, and over every shard's sorted set).
SPREAD_S = 3 * 86_400
STEP = 7_919
#: The untimed first write that starts Spark's Python workers.
WARM_ROWS = 2_000
#: Ids looked up after each write.
SAMPLE_IDS = 1_000
#: Rows per Arrow batch (``spark.sql.execution.arrow.maxRecordsPerBatch``'s default).
ARROW_BATCH = 10_000
DEFAULT_ROWS = 1_000_000
DEFAULT_MASTER = "local[2]"
STREAM_BATCHES = 4  # micro-batches of the streaming line


def spark_problem() -> str | None:
    """Why a local Spark cannot run here (None: it can)."""
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (pip install -e '.[spark]')"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (Spark needs Java 17)"
    return None


def master_cores(master: str) -> int:
    """Task slots of a local master: ``local[k]`` -> k, ``local[*]`` -> the machine's cores."""
    if master == "local":
        return 1
    found = re.fullmatch(r"local\[(\d+|\*)(?:,\s*\d+)?\]", master)
    if found is None:
        raise BenchError(f"--master {master!r}: only a local master is measured here (local[k])")
    text = found.group(1)
    return (os.cpu_count() or 1) if text == "*" else int(text)


# -- the rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """Row ``i`` of ``n``: ``user_id`` i, ``due`` ``base_s + (i * STEP) % SPREAD_S``, ``text``
    ``"hi <i>"``, ``day`` the due date (UTC). Spark and Python make the same values."""

    n: int
    base_s: int

    def due_s(self, i: int) -> int:
        return self.base_s + (i * STEP) % SPREAD_S

    def job_id(self, i: int) -> str:
        day = datetime.fromtimestamp(self.due_s(i), UTC).strftime("%Y-%m-%d")
        return ID_TEMPLATE.format(user_id=i, day=day)

    def dicts(self) -> list[dict[str, Any]]:
        """The rows as the mappings ``write_rows`` takes (due: an aware datetime, as Spark's)."""
        days: dict[int, str] = {}
        out: list[dict[str, Any]] = []
        for i in range(self.n):
            due = self.due_s(i)
            day = days.get(due // 86_400)
            if day is None:
                day = days[due // 86_400] = datetime.fromtimestamp(due, UTC).strftime("%Y-%m-%d")
            out.append({"user_id": i, "due": datetime.fromtimestamp(due, UTC), "text": f"hi {i}", "day": day})
        return out

    def arrow_batches(self) -> list[Any]:
        """The rows as pyarrow batches of ``ARROW_BATCH`` with Spark's types (timestamp[us, UTC])."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = pa.array(range(self.n), pa.int64())
        due_s = pc.add(pc.remainder(pc.multiply(ids, STEP), SPREAD_S), self.base_s)
        due = pc.cast(pc.multiply(due_s, 1_000_000), pa.timestamp("us", tz="UTC"))
        text = pc.binary_join_element_wise("hi", pc.cast(ids, pa.string()), " ")
        day = pc.strftime(due, format="%Y-%m-%d")
        table_ = pa.table({"user_id": ids, "due": due, "text": text, "day": day})
        batches: list[Any] = table_.to_batches(max_chunksize=ARROW_BATCH)
        return batches

    def dataframe(self, spark: Any, partitions: int) -> Any:
        from pyspark.sql import functions as F

        due = F.timestamp_seconds(F.lit(self.base_s) + (F.col("id") * STEP) % SPREAD_S)
        return (
            spark.range(0, self.n, 1, partitions)
            .select(
                F.col("id").alias("user_id"),
                due.alias("due"),
                F.concat(F.lit("hi "), F.col("id").cast("string")).alias("text"),
            )
            .withColumn("day", F.date_format("due", "yyyy-MM-dd"))
        )


def write_options(url: str) -> dict[str, str]:
    return {"url": url, "task": TASK, "dueColumn": "due", "kwargs": KWARGS, "idTemplate": ID_TEMPLATE}


# -- Spark -----------------------------------------------------------------------------------


@dataclass
class SparkRun:
    session: Any
    env: dict[str, str | None]

    @property
    def jvm_pid(self) -> int | None:
        from pyspark import SparkContext

        proc = getattr(SparkContext._gateway, "proc", None)
        return proc.pid if proc is not None else None


def start_spark(master: str, partitions: int) -> SparkRun:
    """A local SparkSession whose executors run this interpreter with the repository importable."""
    names = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "SPARK_LOCAL_IP")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # nothing binds or connects off the loopback
    import warnings

    from pyspark.sql import SparkSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyspark's pandas-version FutureWarning
        session = (
            SparkSession.builder.master(master)
            .appName("delayq-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.shuffle.partitions", str(partitions))
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    session.sparkContext.setLogLevel("ERROR")
    return SparkRun(session, saved)


def stop_spark(run: SparkRun) -> None:
    """Stop the session and its JVM (it would otherwise idle until this process exits)."""
    from pyspark import SparkContext

    with contextlib.suppress(Exception):
        run.session.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is not None:
        with contextlib.suppress(Exception):
            gateway.shutdown()
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.stdin.close()  # the JVM exits when its stdin closes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    SparkContext._gateway = None
    SparkContext._jvm = None
    for name, value in run.env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# -- measuring -----------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds (user + system) of some processes: ``own`` pids alone, ``trees`` pids with
    every process under them, those already reaped included (their parents' children times)."""

    def __init__(self, own: Sequence[int] = (), trees: Sequence[int] = ()) -> None:
        self.own, self.trees = list(own), list(trees)

    def total(self) -> float:
        seconds = 0.0
        seen: set[int] = set()
        for pid in self.own:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                seconds += t.user + t.system
                seen.add(pid)
        for pid in self.trees:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                if proc.pid in seen:
                    continue
                seen.add(proc.pid)
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    seconds += t.user + t.system + t.children_user + t.children_system
        return seconds


def machine_busy() -> float:
    """CPU seconds every core of the machine has spent busy (user, nice, system, interrupts)."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


@dataclass
class Timed:
    seconds: float
    cpu: dict[str, float]  # CPU seconds used while writing, per meter

    def rate(self, n: int) -> float:
        return n / self.seconds

    def cores(self, name: str) -> float:
        return self.cpu[name] / self.seconds


def timed(call: Callable[[], Any], meters: dict[str, Callable[[], float]]) -> Timed:
    """Run ``call``; its wall time, and the CPU seconds each meter counted meanwhile."""
    before = {name: meter() for name, meter in meters.items()}
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    return Timed(seconds, {name: meter() - before[name] for name, meter in meters.items()})


def check_stored(store: Any, rows: Rows, what: str) -> str:
    """Count the jobs stored (ZCARD of every shard's due set) and look up a sample of ids with
    their due times; raise :class:`BenchError` unless all ``rows.n`` are there."""
    client, keys = store.client, store.keys
    with client.pipeline(transaction=False) as pipe:
        for shard in range(keys.shards):
            pipe.zcard(keys.shard(shard).due)
        count = sum(int(c) for c in pipe.execute())
    if count != rows.n:
        raise BenchError(
            f"{what}: {count:,} jobs stored, expected {rows.n:,} (ZCARD over {keys.shards} shards)"
        )
    step = max(1, rows.n // SAMPLE_IDS)
    sample = list(range(0, rows.n, step))[:SAMPLE_IDS]
    with client.pipeline(transaction=False) as pipe:
        for i in sample:
            job_id = rows.job_id(i)
            pipe.zscore(keys.shard(keys.shard_of(job_id)).due, job_id)
        scores = pipe.execute()
    wrong = [
        (rows.job_id(i), score)
        for i, score in zip(sample, scores, strict=True)
        if score is None or int(score) != rows.due_s(i) * 1000
    ]
    if wrong:
        raise BenchError(
            f"{what}: {len(wrong)} of {len(sample)} sampled ids missing or with another "
            f"due time, e.g. {wrong[:3]}"
        )
    return f"{count:,} stored, {len(sample):,} sampled ids present with their due time"


def measure(ctx: Context, n: int, master: str) -> RowResult:
    """The row: Spark's write of ``n`` rows vs the plain writer's, on one fresh Redis server."""
    result = RowResult("spark")
    what = f'spark: rows/s, {n:,} rows, format("delayq") on {master} vs plain writer'
    problem = spark_problem()
    if problem:
        result.lines.append(Line(what, None, "rows/s", target=">=0.8", skipped=problem))
        return result
    import pyspark
    import redis

    from celery_delayq.spark import JobWriter, WriteOptions, write_rows
    from celery_delayq.store.facade import Store

    cores = master_cores(master)
    server = ctx.redis()
    url = server.url + "/0"
    assert server.process is not None
    common = {"redis": CpuMeter(own=[server.process.pid]).total, "machine": machine_busy}
    client = redis.Redis.from_url(url)
    options = write_options(url)
    parsed = WriteOptions.parse(options)
    store = Store(parsed.store.config())
    rows = Rows(n, (int(time.time()) // 3600 + 1) * 3600)
    checks: list[str] = []
    ctx.say(f"spark: starting a local Spark ({master})")
    t0 = time.perf_counter()
    run = start_spark(master, cores)
    try:
        startup = time.perf_counter() - t0
        spark = run.session
        jvm = run.jvm_pid
        # Untimed: the first write starts Spark's Python workers (and loads celery_delayq in them).
        # The second, timed the same way, shows what every write costs whatever its size.
        warm = Rows(WARM_ROWS, rows.base_s)
        small = warm.dataframe(spark, cores).write.format("delayq").options(**options).mode("append")
        small_times: list[float] = []
        for _ in range(2):
            t0 = time.perf_counter()
            small.save()
            small_times.append(time.perf_counter() - t0)
            check_stored(store, warm, "spark warm-up write")
            client.flushall()
        cold, again = small_times
        ctx.say(f"spark: caching {n:,} rows in {cores} partitions")
        df = rows.dataframe(spark, cores).cache()
        t0 = time.perf_counter()
        cached = df.count()
        materialize = time.perf_counter() - t0
        if cached != n:
            raise BenchError(f"the cached DataFrame has {cached:,} rows, not {n:,}")
        writer = df.write.format("delayq").options(**options).mode("append")
        ctx.say(f"spark: timed write of {n:,} rows")
        spark_meters = {
            "side": CpuMeter(own=[os.getpid()], trees=[jvm] if jvm else []).total,
            "jvm": CpuMeter(own=[jvm] if jvm else []).total,
            "driver": CpuMeter(own=[os.getpid()]).total,
            **common,
        }
        ours = timed(writer.save, spark_meters)
        checks.append(f"Spark: {check_stored(store, rows, 'the Spark write')}")
        client.flushall()
        # The streaming sink against the batch writer, on the same rows in the same files.
        ctx.say(f"spark: {n:,} rows as {STREAM_BATCHES * cores} Parquet files, streamed and written")
        folder = tempfile.mkdtemp(prefix="delayq-bench-stream-")
        files = os.path.join(folder, "rows")
        df.repartition(STREAM_BATCHES * cores).write.parquet(files)  # untimed
        df.unpersist()
        schema = spark.read.parquet(files).schema
        from_files = spark.read.parquet(files).write.format("delayq").options(**options).mode("append")
        batch_files = timed(from_files.save, spark_meters)
        checks.append(f"Spark from files: {check_stored(store, rows, 'the Spark write of the files')}")
        client.flushall()

        def stream() -> None:
            reader = spark.readStream.schema(schema).option("maxFilesPerTrigger", cores).parquet(files)
            writer = reader.writeStream.format("delayq").options(**options)
            query = writer.option("checkpointLocation", os.path.join(folder, "checkpoint"))
            query.trigger(availableNow=True).start().awaitTermination()

        streamed = timed(stream, spark_meters)
        checks.append(f"stream: {check_stored(store, rows, 'the streaming sink')}")
        client.flushall()
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        stop_spark(run)
    client.flushall()

    # The plain writer, in this process; the rows are made before the clock starts.
    ctx.say(f"spark: baseline, write_rows of {n:,} rows in this process")
    write_rows(parsed, Rows(WARM_ROWS, rows.base_s).dicts())  # warm: the client, the scripts
    client.flushall()
    plain_meters = {"side": CpuMeter(own=[os.getpid()]).total, **common}
    plain = _timed_write_rows(write_rows, parsed, rows, plain_meters)
    checks.append(f"write_rows: {check_stored(store, rows, 'the plain write_rows')}")
    client.flushall()

    ctx.say(f"spark: JobWriter.add_batch of {n:,} rows (Arrow) in this process")
    one = _timed_add_batch(JobWriter, parsed, rows, plain_meters)
    checks.append(f"add_batch: {check_stored(store, rows, 'the Arrow JobWriter')}")
    client.flushall()
    store.close()
    client.close()
    ctx.stop_redis(server)

    result.lines.append(Line(what, ours.rate(n), "rows/s", baseline=plain.rate(n), target=">=0.8"))
    result.lines.append(
        Line(
            f"spark: rows/s per core ({cores} Spark task slots vs 1 process)",
            ours.rate(n) / cores,
            "rows/s",
            baseline=plain.rate(n),
        )
    )
    result.lines.append(
        Line(
            "spark: vs the same JobWriter fed Arrow batches in 1 process",
            ours.rate(n),
            "rows/s",
            baseline=one.rate(n),
        )
    )
    result.lines.append(
        Line(
            f"spark: streaming sink, {STREAM_BATCHES} micro-batches, vs the batch writer on the same files",
            streamed.rate(n),
            "rows/s",
            baseline=batch_files.rate(n),
        )
    )
    result.notes += [
        f"streaming sink: the same rows written (untimed) as {STREAM_BATCHES * cores} Parquet files; "
        f"readStream.parquet with maxFilesPerTrigger {cores} (availableNow: {STREAM_BATCHES} micro-batches "
        f"of {cores} partitions) into writeStream.format('delayq') with the same options, timed from "
        f"start() to the query's end: {streamed.seconds:.2f} s. The sink stores every job with a "
        f"uniqueness window (uniqueFor, 7 days: one more sorted-set entry a job) and records each "
        f"batch's commit. Baseline: spark.read.parquet of the same files written with "
        f"write.format('delayq'), {batch_files.seconds:.2f} s",
        f"ours: {n:,} rows made by spark.range in {cores} partitions (user_id bigint, due timestamp "
        f"spread over {SPREAD_S // 86_400} days from the next whole hour, text 'hi <id>', day its UTC "
        f"date), cached and counted first (untimed, {materialize:.1f} s); timed from save() to its "
        f"return: {ours.seconds:.2f} s. That includes planning the write (a Python worker on the "
        f"driver parses the options and pings Redis), Spark handing the cached rows to Python as Arrow "
        f"batches of {ARROW_BATCH:,}, the envelopes, the Redis writes and the commit; the Python "
        f"workers were already started (an untimed first write of {WARM_ROWS:,} rows took {cold:.1f} "
        f"s, Spark's start {startup:.1f} s before it) and Spark reuses them. A second write of "
        f"{WARM_ROWS:,} rows took {again:.2f} s: about what any write costs whatever its size",
        f"options: task {TASK}, kwargs {KWARGS}, idTemplate {ID_TEMPLATE}, mode append, batchSize "
        f"{parsed.batch_size:,} (the default); one Redis server ({server.url}), flushed before each "
        f"write; {parsed.store.config().shards} shards",
        f"baseline: the same rows as Python dicts made in this process (untimed), written by "
        f"celery_delayq.spark.write_rows with the same options: the plain writer, one JobWriter, the "
        f"same envelopes and ids, one pipeline of enqueue scripts per batch of {parsed.batch_size:,} "
        f"grouped by shard; {plain.seconds:.2f} s. Chosen over a hand-written build_envelopes + "
        f"Store.enqueue loop: that is what JobWriter runs, and measured within a few % of it",
        f"third line: the same rows as pyarrow batches of {ARROW_BATCH:,} (timestamp[us, UTC], as "
        f"Spark sends them) fed to one JobWriter.add_batch in this process, the code each Spark "
        f"partition runs; {one.seconds:.2f} s",
        f"per core: Spark's rows/s / {cores} (the task slots of {master}: {cores} Python workers "
        f"write at once); the plain writer's / 1 (one Python thread). Neither counts Redis (one "
        f"thread, shared by both sides) nor Spark's JVM: see the CPU actually used, next",
        "CPU while writing, in cores (CPU s / wall s), and CPU µs per row: "
        + "; ".join(
            (
                _cpu_note("Spark", ours, n, spark=True),
                _cpu_note("write_rows", plain, n),
                _cpu_note("Arrow JobWriter", one, n),
                _cpu_note("Spark from files", batch_files, n, spark=True),
                _cpu_note("streaming sink", streamed, n, spark=True),
            )
        )
        + f"; the machine has {os.cpu_count()} cores, and what other processes used is part of its figure",
        "stored-count check passed: " + "; ".join(checks) + " (ZCARD over the shards' due sets; ids "
        "computed in Python from the template)",
        f"pyspark {pyspark.__version__}, {_java()}",
    ]
    return result


def _cpu_note(what: str, t: Timed, n: int, spark: bool = False) -> str:
    """``what``'s CPU while it wrote: its side (broken down for Spark), Redis, the machine."""
    side, redis_cpu, machine = t.cpu["side"], t.cpu["redis"], t.cpu["machine"]
    parts = [f"{t.cores('side'):.2f} ({side / n * 1e6:.0f} µs/row)"]
    if spark:
        workers = side - t.cpu["jvm"] - t.cpu["driver"]
        parts.append(
            f"of which Python workers {workers / t.seconds:.2f} ({workers / n * 1e6:.0f} µs/row), "
            f"JVM {t.cores('jvm'):.2f}, driver Python {t.cores('driver'):.2f}"
        )
    others = max(0.0, machine - side - redis_cpu)
    parts.append(
        f"Redis {t.cores('redis'):.2f} ({redis_cpu / n * 1e6:.0f} µs/row); whole machine "
        f"{t.cores('machine'):.2f}, other processes {others / t.seconds:.2f}"
    )
    return f"{what} " + ", ".join(parts)


def _timed_write_rows(
    write_rows: Any, parsed: Any, rows: Rows, meters: dict[str, Callable[[], float]]
) -> Timed:
    dicts = rows.dicts()  # before the clock starts
    return timed(lambda: write_rows(parsed, dicts), meters)


def _timed_add_batch(
    job_writer: Any, parsed: Any, rows: Rows, meters: dict[str, Callable[[], float]]
) -> Timed:
    batches = rows.arrow_batches()  # before the clock starts

    def write() -> None:
        with job_writer(parsed) as writer:
            for batch in batches:
                writer.add_batch(batch)

    return timed(write, meters)


def row_spark(ctx: Context) -> RowResult:
    """The suite's row: ``ctx.sizes.spark_rows`` rows on ``local[2]``."""
    return measure(ctx, ctx.sizes.spark_rows, DEFAULT_MASTER)


def _java() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr
        return out.splitlines()[0].strip()
    except Exception:
        return "java ?"


# -- python -m bench.spark -----------------------------------------------------------------------


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    from .cli import _machine, _run

    parser = argparse.ArgumentParser(
        prog="python -m bench.spark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="rows written (default 1,000,000)")
    parser.add_argument("--master", default=DEFAULT_MASTER, help="a local Spark master (default local[2])")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    try:
        master_cores(args.master)
    except BenchError as exc:
        parser.error(str(exc))
    ctx = Context(DEFAULT, "spark", selected=["spark"])
    atexit.register(ctx.cleanup)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        ctx.say(f"celery-delayq Spark write benchmark: {args.rows:,} rows on {args.master}")
        result = _run(ctx, "spark", lambda: measure(ctx, args.rows, args.master))
    finally:
        ctx.cleanup()
    print()
    print(f"celery-delayq benchmark (spark, {args.rows:,} rows, {time.monotonic() - ctx.started:.0f} s)")
    print(f"machine: {_machine()}")
    print()
    print(table([result]))
    print()
    print("notes:")
    print(notes([result]))
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
