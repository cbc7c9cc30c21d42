"""The ``delayq`` streaming sink (``writeStream.format("delayq")``): each micro-batch's rows as
jobs, exactly once, across replays, a driver SIGKILLed between a batch's writes and its commit,
and a Redis server that goes away in the middle of a batch.

The in-process tests use the session's local Spark; the fault tests run the driver
(``tests/apps/stream_driver.py``) as a process of its own, in a session of its own, so that it
can be killed whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.spark import spark_problem
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import ConfigurationError
from celery_delayq.spark import WriteOptions
from celery_delayq.spark.options import STREAM_UNIQUE_FOR
from celery_delayq.store.keys import KeySpace
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.processes import ROOT, Procs, subprocess_env
from tests.support.spark import spark
from tests.support.store import make_store, stored

__all__ = ["cluster_url", "redis_cluster", "spark"]  # fixtures, used by name

pytest.importorskip("pyarrow")

SCHEMA = "user_id long, text string, due timestamp"


def write_events(folder: Path, files: int, per_file: int, due: str = "2030-01-01T00:00:00Z") -> int:
    """``files`` JSON-lines files of ``per_file`` events each (user ids 0, 1, ...); the count."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part-{f:04d}.json", "w") as out:
            for i in range(per_file):
                n = f * per_file + i
                out.write(json.dumps({"user_id": n, "text": f"reminder {n}", "due": due}) + "\n")
    return files * per_file


def pending(r: redis.Redis, shards: int = 16) -> dict[str, float]:
    """Every waiting job's id and due score."""
    out: dict[str, float] = {}
    for shard in KeySpace("delayq", shards).all_shards():
        out.update({str(k): float(v) for k, v in r.zrange(shard.due, 0, -1, withscores=True)})
    return out


def forget_commit(checkpoint: Path, batch: int) -> None:
    """Take micro-batch ``batch`` out of Spark's commit log (and its checksum): as after a crash
    before Spark wrote it, the restarted query writes that batch again."""
    (checkpoint / "commits" / str(batch)).unlink()
    (checkpoint / "commits" / f".{batch}.crc").unlink(missing_ok=True)


# -- options ------------------------------------------------------------------------------------


def test_stream_options_take_checkpoint_location_refuse_replace_and_default_the_window() -> None:
    base = {"url": "redis://127.0.0.1:1", "task": "proj.remind", "args": "user_id"}
    parsed = WriteOptions.parse({**base, "checkpointLocation": "/tmp/ck"}, stream=True)
    assert parsed.unique_ms == STREAM_UNIQUE_FOR * 1000  # no ids from the rows needed
    assert WriteOptions.parse({**base, "uniqueFor": "60"}, stream=True).unique_ms == 60_000
    with pytest.raises(ConfigurationError, match="option replace is refused"):
        WriteOptions.parse({**base, "replace": "true"}, stream=True)
    with pytest.raises(ConfigurationError, match="delayq write: unknown option 'checkpointLocation'"):
        WriteOptions.parse({**base, "checkpointLocation": "/tmp/ck"})  # a batch write has none


def test_the_store_reports_a_corrupt_commit_record_and_replaces_it(
    redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(redis_url)
    try:
        assert store.stream_committed("q1") is None
        store.commit_stream("q1", 7, 60_000)
        assert store.stream_committed("q1") == 7
        for corrupt in ("seven", None):
            r.delete("delayq:stream:q1")
            if corrupt is None:
                r.hset("delayq:stream:q1", "batch", "7")  # not a string at all
            else:
                r.set("delayq:stream:q1", corrupt)
            with caplog.at_level("WARNING", logger="celery_delayq.store.streams"):
                assert store.stream_committed("q1") is None
            assert "delayq:stream:q1 is not a micro-batch number (a corrupt record)" in caplog.text
            caplog.clear()
            store.commit_stream("q1", 8, 60_000)
            assert store.stream_committed("q1") == 8
    finally:
        store.close()


# -- in process: a replayed micro-batch ---------------------------------------------------------


def _stream(spark: Any, events: Path, checkpoint: Path, url: str, **options: str) -> Any:
    df = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(events))
    writer = (
        df.writeStream.format("delayq")
        .option("url", url)
        .option("task", "e2e.record")
        .option("args", "user_id")
        .option("kwargs", "text")
        .option("checkpointLocation", str(checkpoint))
    )
    for name, value in options.items():
        writer = writer.option(name, value)
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    return query


@pytest.mark.spark
@pytest.mark.slow
def test_a_replayed_micro_batch_stores_nothing_twice(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Three micro-batches of 200 events: 600 jobs, ids from the stream's place. Spark writes
    batch 2 again when its commit log lacks it: skipped whole while the sink's own commit record
    is there; without it too, its jobs are kept (waiting) or taken (gone: delivered), none new."""
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 3, 200)
    query = _stream(spark, events, checkpoint, redis_url)
    first = pending(r)
    assert len(first) == total
    assert all(job_id.startswith(f"stream:{query.id}:") for job_id in first)
    assert r.get(f"delayq:stream:{query.id}") == "2"
    # Spark lost its commit of batch 2 (a crash after the sink committed): the batch is skipped.
    forget_commit(checkpoint, 2)
    _stream(spark, events, checkpoint, redis_url)
    assert pending(r) == first
    # Both commits lost (a crash between the batch's writes and any commit), and 50 of its jobs
    # gone since (delivered): the replay stores none of them again and keeps the rest as they are.
    forget_commit(checkpoint, 2)
    r.delete(f"delayq:stream:{query.id}")
    batch_2 = sorted(job_id for job_id in first if job_id.startswith(f"stream:{query.id}:2:"))
    assert len(batch_2) == 200
    store = make_store(redis_url)
    try:
        for job_id in batch_2[:50]:
            assert store.cancel(job_id)
    finally:
        store.close()
    _stream(spark, events, checkpoint, redis_url)
    after = pending(r)
    assert len(after) == total - 50
    assert set(after) == set(first) - set(batch_2[:50])
    assert r.get(f"delayq:stream:{query.id}") == "2"
    assert 0 < r.pttl(f"delayq:stream:{query.id}") <= STREAM_UNIQUE_FOR * 1000


@pytest.mark.spark
@pytest.mark.slow
def test_a_stream_takes_the_due_column_as_an_argument_too(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """``dueColumn`` also in ``args`` (a reminder that receives its own due time): the query runs
    to its end with every event stored once, the task getting the due timestamp as a datetime
    (before: the executor's ``KeyError: 'due'`` killed the query)."""
    from kombu.utils.json import loads

    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 2, 50)
    query = _stream(spark, events, checkpoint, redis_url, args="user_id,due")
    assert query.exception() is None
    jobs = pending(r)
    assert len(jobs) == total
    assert set(jobs.values()) == {datetime(2030, 1, 1, tzinfo=UTC).timestamp() * 1000}
    first = f"stream:{query.id}:0:0:0"
    assert loads(stored(r, first)["j"] + "]")[0] == [0, datetime(2030, 1, 1, tzinfo=UTC)]
    assert r.get(f"delayq:stream:{query.id}") == "1"  # both micro-batches committed


@pytest.mark.spark
@pytest.mark.slow
def test_a_bad_row_fails_the_query_naming_it_and_a_restart_after_the_fix_loses_nothing(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """docs/spark.md, "When errors are raised": a row whose due time is null fails the query with
    the row named (not a bare KeyError); with the data fixed, the query restarted from its
    checkpoint writes the failed micro-batch again, and every event is stored once."""
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 2, 50)
    second = events / "part-0001.json"
    good = second.read_text().splitlines()
    bad = [*good[:7], json.dumps({"user_id": 57, "text": "reminder 57", "due": None}), *good[8:]]
    second.write_text("\n".join(bad) + "\n")
    with pytest.raises(Exception, match=r"row 7: due column 'due' is null") as failed:
        _stream(spark, events, checkpoint, redis_url, args="user_id,due")
    assert "KeyError" not in str(failed.value)
    assert len(pending(r)) == 50  # the first micro-batch, committed
    second.write_text("\n".join(good) + "\n")
    query = _stream(spark, events, checkpoint, redis_url, args="user_id,due")
    assert query.exception() is None
    assert len(pending(r)) == total


@pytest.mark.spark
@pytest.mark.slow
def test_a_corrupt_commit_record_is_reported_and_the_batch_written_again_once(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A commit record that is not a batch number (here a list) counts as none: the replayed
    batch is written again, its jobs kept, and the record replaced by the commit."""
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 2, 100)
    query = _stream(spark, events, checkpoint, redis_url)
    first = pending(r)
    forget_commit(checkpoint, 1)
    r.delete(f"delayq:stream:{query.id}")
    r.rpush(f"delayq:stream:{query.id}", "not a batch number")
    _stream(spark, events, checkpoint, redis_url)
    assert pending(r) == first and len(first) == total
    assert r.get(f"delayq:stream:{query.id}") == "1"  # replaced by the commit


@pytest.mark.spark
@pytest.mark.slow
def test_a_full_redis_fails_the_query_and_a_restart_with_room_loses_nothing(
    spark: Any, tmp_path: Path
) -> None:
    """Events of 2 KB against a 4 MB ``maxmemory``: the query fails with StoreFull; once Redis
    has room, the restarted query stores each event's job once."""
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    events.mkdir()
    total = 0
    for f in range(4):
        with open(events / f"part-{f}.json", "w") as out:
            for _ in range(1000):
                out.write(
                    json.dumps({"user_id": total, "text": "x" * 2000, "due": "2030-01-01T00:00:00Z"}) + "\n"
                )
                total += 1
    with EmbeddedRedis(extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]) as server:
        url = server.url + "/0"
        with pytest.raises(Exception, match="StoreFull"):
            _stream(spark, events, checkpoint, url)
        r = redis.Redis.from_url(url, decode_responses=True)
        assert len(pending(r)) < total
        r.config_set("maxmemory", "0")
        _stream(spark, events, checkpoint, url)
        assert len(pending(r)) == total
        r.close()


@pytest.mark.spark
@pytest.mark.cluster
@pytest.mark.slow
def test_a_stream_into_a_redis_cluster_and_a_replay_there(
    spark: Any, cluster_url: str, tmp_path: Path
) -> None:
    """``cluster=true``: jobs on each id's node, the commit record on its own; a batch written
    again with both commits lost stores nothing new."""
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 2, 300)
    query = _stream(spark, events, checkpoint, cluster_url, cluster="true")
    store = make_store(cluster_url, cluster=True)
    try:
        assert store.count() == total
        assert store.stream_committed(str(query.id)) == 1
        forget_commit(checkpoint, 1)
        store.client.delete(f"delayq:stream:{query.id}")
        _stream(spark, events, checkpoint, cluster_url, cluster="true")
        assert store.count() == total
        assert store.stream_committed(str(query.id)) == 1
    finally:
        store.close()


# -- a driver of its own: killed, and a Redis that goes away -------------------------------------


def skip_without_spark() -> None:
    problem = spark_problem()
    if problem:
        pytest.skip(problem)


def run_driver(
    events: Path, checkpoint: Path, url: str, per_batch: int, kill_at: int = -1, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/apps/stream_driver.py`` to its end (or its death) in a session of its own."""
    full = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    full["SPARK_LOCAL_IP"] = "127.0.0.1"
    full.update(env)
    cmd = [sys.executable, "-m", "tests.apps.stream_driver", str(events), str(checkpoint), url]
    cmd += [str(per_batch), str(kill_at)]
    proc = subprocess.Popen(
        cmd, env=full, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Whatever the driver left of its group (a JVM or a worker) is gone before the next run.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.mark.spark
@pytest.mark.e2e
@pytest.mark.slow
def test_a_stream_killed_twice_schedules_each_event_once_and_each_runs_once(
    redis_url: str, r: redis.Redis, tmp_path: Path, procs: Procs
) -> None:
    """6,000 events in 20 files, 2 files a micro-batch (10 batches), ids from the stream's place.
    The driver is SIGKILLed (with its JVM) between the writes and the commit of batch 3, then of
    batch 6, and restarted from its checkpoint each time: 6,000 jobs, then a real beat and
    worker run each once."""
    skip_without_spark()
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    due = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 5))
    total = write_events(events, 20, 300, due=due)
    killed = [run_driver(events, checkpoint, redis_url, 2, kill_at=k) for k in (3, 6)]
    for run in killed:
        assert run.returncode == -signal.SIGKILL, run.stdout[-3000:]
    assert 0 < len(pending(r)) < total
    last = run_driver(events, checkpoint, redis_url, 2)
    assert last.returncode == 0, last.stdout[-3000:]
    ids = pending(r)
    assert len(ids) == total
    env = subprocess_env(redis_url, redis_url)
    procs.start("worker", env, pool="prefork -c 2", level="warning")  # (85 s -> 67 s for 100,000)
    procs.start("beat", env)
    done = wait_for(lambda: r.hlen("e2e:runs") >= total, 600, 0.5)
    assert done, f"{r.hlen('e2e:runs')} of {total} ran\n{procs.logs()[-5000:]}"
    time.sleep(2.0)  # a late duplicate would show here
    runs = r.hgetall("e2e:runs")
    assert set(runs) == set(ids)
    assert {int(v) for v in runs.values()} == {1}
    assert len(pending(r)) == 0


@pytest.mark.spark
@pytest.mark.slow
def test_redis_gone_during_a_batch_fails_the_query_and_a_restart_loses_nothing(tmp_path: Path) -> None:
    """Partition 0 of batch 1 shuts the server down (saving) once it has written its jobs: the
    query fails with StoreUnreachable naming the URL; the server comes back with what it had, and the
    restarted query writes each event's job once."""
    skip_without_spark()
    events, checkpoint = tmp_path / "events", tmp_path / "checkpoint"
    total = write_events(events, 4, 500)
    with EmbeddedRedis(persist=True) as server:
        failed = run_driver(events, checkpoint, server.url, 1, STREAM_SHUTDOWN_AT_BATCH="1")
        assert failed.returncode != 0
        # the store's own error, naming the URL and the setting (issue 52), not redis-py's bare one
        assert "StoreUnreachable: cannot reach Redis at" in failed.stdout, failed.stdout[-3000:]
        assert "(delayq_url)" in failed.stdout
        assert wait_for(lambda: not server.ping(), 10, 0.1)
        server.process = None
        server.start()
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert 500 <= len(pending(r)) < total  # batch 0, and what batch 1 wrote before the fault
        again = run_driver(events, checkpoint, server.url, 1)
        assert again.returncode == 0, again.stdout[-3000:]
        ids = pending(r)
        assert len(ids) == total
        r.close()


# -- the example ------------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.e2e
@pytest.mark.slow
def test_the_streaming_example_schedules_each_event_once_and_a_worker_runs_them(
    spark: Any,
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    procs: Procs,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/spark_stream.py run twice on one checkpoint (stopped and started again, as its
    docstring says): one job per event fed, keyed by the event's id; a real worker and beat of
    the example's app run each once."""
    from examples import spark_stream as ex

    folders = ["--events", str(tmp_path / "events"), "--checkpoint", str(tmp_path / "checkpoint")]
    argv = ["--url", redis_url, "--seconds", "3", "--per-second", "50", "--delay", "4", *folders]
    assert ex.main(argv, spark=spark) == 0
    assert ex.main(argv, spark=spark) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " events fed, " in line]
    fed = sum(int(line.split(": ")[1].split()[0]) for line in lines)
    ids = pending(r)
    assert len(lines) == 2 and len(ids) == fed > 0, lines
    assert all(job_id.startswith("event-") for job_id in ids)
    env = subprocess_env(redis_url, redis_url, DELAYQ_EXAMPLE_URL=redis_url)
    procs.start("worker", env, app="examples.spark_stream")
    procs.start("beat", env, app="examples.spark_stream")
    log = lambda: (tmp_path / "worker-0.log").read_text(errors="replace")  # noqa: E731
    done = wait_for(lambda: log().count("succeeded in") >= fed, 120, 0.5)
    assert done, f"{log().count('succeeded in')} of {fed} ran\n{procs.logs()[-3000:]}"
    time.sleep(1.0)
    assert log().count("succeeded in") == fed
    assert len(pending(r)) == 0
