"""celery_delayq.spark: the plain-Python writer and reader, and the ``delayq`` Spark data source.

The first half needs no Spark (the functions behind the data source, on the session's
Redis); tests marked ``spark`` run a real local Spark (``local[2]``, the session
``spark`` fixture), and the end-to-end test delivers what Spark wrote with a real
``celery beat`` and ``celery worker``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.config import reconfigure
from celery_delayq.exceptions import ConfigurationError, InvalidDueTime, InvalidOptions
from celery_delayq.spark import READ_COLUMNS, JobWriter, ReadOptions, WriteOptions, read_shard, write_rows
from celery_delayq.store.facade import get_store
from celery_delayq.store.keys import KeySpace
from tests.support.apps import make_app
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env
from tests.support.spark import spark
from tests.support.store import command_calls, make_store, published_ids, stored

__all__ = ["cluster_url", "redis_cluster", "spark"]  # fixtures, used by name

pa = pytest.importorskip("pyarrow")

BASE = datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


def pending_ids(r: redis.Redis, prefix: str = "delayq", shards: int = 16) -> dict[str, float]:
    out: dict[str, float] = {}
    for shard in KeySpace(prefix, shards).all_shards():
        out.update(dict(r.zrange(shard.due, 0, -1, withscores=True)))
    return out


def comparable(envelope: dict[str, Any]) -> dict[str, Any]:
    """An envelope less what differs between any two producers: its id, creation time,
    reply-to (the producing app's ``thread_oid``) and origin (the producing process)."""
    return {k: v for k, v in envelope.items() if k not in ("i", "c", "r", "o")}


# -- options: every mistake is reported when the options are given ----------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"task": "t.add"}, "option url is required"),
        ({"url": "http://x", "task": "t.add"}, "redis://"),
        ({"url": "redis://127.0.0.1:1/0"}, "option task is required"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "dueColum": "d"}, "unknown option 'dueColum'"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "args": "a", "argsColumn": "b"}, "exclude each other"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idColumn": "a", "idTemplate": "{b}"}, "exclude"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idTemplate": "fixed"}, "names no column"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idTemplate": "r:{}"}, "must name a column"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idTemplate": "r:{a"}, "not a format string"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "priority": "300"}, "between 0 and 255"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "expires": "-1"}, "option expires"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "shards": "0"}, "option shards"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "replace": "maybe"}, "true or false"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "options": "[1]"}, "JSON object"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "options": '{"task_id": "x"}'}, "may not set"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "options": '{"unique_for": 5}'}, "may not set"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "uniqueFor": "60"}, "needs the jobs' ids"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idColumn": "i", "uniqueFor": "0"}, "seconds > 0"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "idColumn": "i", "uniqueFor": "1h"}, "seconds > 0"),
        (
            {
                "url": "redis://127.0.0.1:1/0",
                "task": "t",
                "idColumn": "i",
                "uniqueFor": "60",
                "replace": "true",
            },
            "without replace",
        ),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "options": '{"producer": 1}'}, "producer"),
        ({"url": "redis://127.0.0.1:1/0", "task": "t", "app": "no.such.module:app"}, "cannot load"),
        ({"app": "tests.apps.spark_app:app", "task": "t", "prefix": "delayq"}, "does not match"),
        ({"app": "tests.apps.spark_app:app", "task": "t", "shards": "16"}, "does not match"),
        ({"app": "tests.apps.spark_app:app", "task": "t.no"}, "no task 't.no'; its tasks: .*spark.remind"),
    ],
)
def test_bad_write_options_are_refused_when_given(options: dict[str, str], message: str) -> None:
    with pytest.raises((ConfigurationError, ValueError, TypeError, KeyError), match=message):
        WriteOptions.parse(options)


def test_bad_read_options_are_refused_when_given() -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'task'"):
        ReadOptions.parse({"url": "redis://127.0.0.1:1/0", "task": "t"})
    with pytest.raises(ConfigurationError, match="dueFrom"):
        ReadOptions.parse({"url": "redis://127.0.0.1:1/0", "dueFrom": "tomorrow"})
    read = ReadOptions.parse({"url": "redis://127.0.0.1:1/0", "DUEFROM": "2031-05-04T12:00:00+00:00"})
    assert read.due_from == int(BASE.timestamp() * 1000)


def test_schema_check_names_the_missing_or_unusable_column() -> None:
    opts = WriteOptions.parse({"url": "redis://127.0.0.1:1/0", "task": "t", "kwargs": "user_id",
                               "idTemplate": "r:{user_id}:{day}"})  # fmt: skip
    with pytest.raises(ConfigurationError, match="no column 'day'"):
        opts.check_schema({"due": "timestamp", "user_id": "bigint"})
    with pytest.raises(ConfigurationError, match="must be a timestamp"):
        opts.check_schema({"due": "date", "user_id": "bigint", "day": "string"})
    opts.check_schema({"due": "timestamp", "user_id": "bigint", "day": "string"})
    opts = WriteOptions.parse({"url": "redis://127.0.0.1:1/0", "task": "t", "kwargsColumn": "kw"})
    with pytest.raises(ConfigurationError, match="struct, a map or a JSON string"):
        opts.check_schema({"due": "double", "kw": "array<int>"})
    opts = WriteOptions.parse({"url": "redis://127.0.0.1:1/0", "task": "t", "args": "due,wait"})
    opts.check_schema({"due": "timestamp", "wait": "bigint"})  # the due column as an argument too
    with pytest.raises(
        ConfigurationError, match=r"column 'wait' is interval day to second, which .* \(json\)"
    ):
        opts.check_schema({"due": "timestamp", "wait": "interval day to second"})
    pickled = {
        "url": "redis://127.0.0.1:1/0",
        "task": "t",
        "args": "wait",
        "options": '{"serializer": "pickle"}',
    }
    WriteOptions.parse(pickled).check_schema({"due": "timestamp", "wait": "interval day to second"})


# -- writing, without Spark ----------------------------------------------------------------------


def test_a_written_job_is_what_apply_at_stores(app: Celery, redis_url: str, r: redis.Redis) -> None:
    due = BASE + timedelta(hours=1)
    add = app.tasks["t.add"]
    add.apply_at(due, (1, 2), task_id="by-apply-at", priority=3, expires=60)
    stats = write_rows(
        {"url": redis_url, "task": "t.add", "args": "x,y", "idColumn": "id", "priority": "3",
         "expires": "60"},
        [{"id": "by-spark", "due": due, "x": 1, "y": 2}],
    )  # fmt: skip
    assert (stats.rows, stats.stored) == (1, 1)
    ours, theirs = stored(r, "by-spark"), stored(r, "by-apply-at")
    assert comparable(ours) == comparable(theirs)
    assert ours["i"] == "by-spark"
    assert pending_ids(r) == {"by-apply-at": due.timestamp() * 1000, "by-spark": due.timestamp() * 1000}


def test_with_an_app_the_task_s_own_options_are_stored(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.spark_app import app as spark_app

    spark_app.conf.delayq_url = redis_url
    reconfigure(spark_app)  # (seen within RECHECK_EVERY anyway)
    try:
        task = spark_app.tasks["spark.remind"]
        task.apply_at(BASE, (7,), {"text": "hi"}, task_id="direct")
        write_rows(
            {"app": "tests.apps.spark_app:app", "url": redis_url, "task": "spark.remind", "args": "user_id",
             "kwargs": "text", "idTemplate": "remind:{user_id}"},
            [{"due": BASE, "user_id": 7, "text": "hi"}],
        )  # fmt: skip
        ours = stored(r, "remind:7", "sparkq", 8)
        assert comparable(ours) == comparable(stored(r, "direct", "sparkq", 8))
        assert ours["q"] == "reminders" or ours["q"]["queue"] == "reminders"
        assert set(pending_ids(r, "sparkq", 8)) == {"direct", "remind:7"}
    finally:
        get_store(spark_app).close()
        reconfigure(spark_app)


def test_writing_twice_keeps_the_same_pending_set_and_replace_moves_them(
    redis_url: str, r: redis.Redis
) -> None:
    rows = [{"user": u, "due": BASE + timedelta(minutes=u), "day": "2031-05-04"} for u in range(300)]
    options = {"url": redis_url, "task": "t.remind", "kwargs": "user", "idTemplate": "r:{user}:{day}",
               "batchSize": "64"}  # fmt: skip
    first = write_rows(options, rows)
    before = pending_ids(r)
    second = write_rows(options, rows)
    assert (first.stored, first.kept) == (300, 0)
    assert (second.stored, second.kept, second.replaced) == (0, 300, 0)
    assert pending_ids(r) == before
    assert len(before) == 300 and "r:17:2031-05-04" in before

    moved = [{**row, "due": row["due"] + timedelta(days=1)} for row in rows]
    third = write_rows({**options, "replace": "true"}, moved)
    assert third.replaced == 300
    after = pending_ids(r)
    assert set(after) == set(before)
    assert after["r:0:2031-05-04"] == before["r:0:2031-05-04"] + 86_400_000


def test_unique_for_keeps_delivered_rows_from_being_written_again(
    app: Celery, redis_url: str, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A replayed write (a stream's batch run again) after its jobs were delivered stores none of
    them again while their window is open; the stats say taken."""
    due = datetime.now(UTC) - timedelta(seconds=1)
    rows = [{"user": u, "due": due, "day": "2031-05-04"} for u in range(50)]
    options = {"url": redis_url, "task": "t.noop", "idTemplate": "r:{user}:{day}", "uniqueFor": "3600"}
    first = write_rows(options, rows)
    assert (first.stored, first.kept, first.taken) == (50, 0, 0)
    assert write_rows(options, rows[:10]).kept == 10
    dispatchers(app).run_once()
    assert len(published_ids(r)) == 50 and not pending_ids(r)
    again = write_rows(options, rows)
    assert (again.stored, again.kept, again.taken) == (0, 0, 50)
    assert not pending_ids(r)


def test_without_ids_every_row_is_a_new_job(redis_url: str, r: redis.Redis) -> None:
    rows = [{"due": BASE.timestamp() + i} for i in range(50)]
    write_rows({"url": redis_url, "task": "t.noop"}, rows)
    write_rows({"url": redis_url, "task": "t.noop"}, rows)
    assert len(pending_ids(r)) == 100


def test_due_values_of_every_accepted_kind(redis_url: str, r: redis.Redis) -> None:
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    rows = [
        {"id": "aware", "due": BASE},
        {"id": "seconds", "due": BASE.timestamp()},
        {"id": "iso", "due": BASE.isoformat()},
        {"id": "naive-in-app-zone", "due": datetime(2031, 5, 4, 14, 0)},  # 14:00 Paris = 12:00 UTC
    ]
    write_rows({"url": redis_url, "task": "t.noop", "idColumn": "id", "timezone": "Europe/Paris"}, rows)
    expected = BASE.timestamp() * 1000
    assert pending_ids(r) == {row["id"]: expected for row in rows}
    assert app.conf.timezone == "Europe/Paris"


@pytest.mark.parametrize(
    ("row", "error", "message"),
    [
        ({"id": "a", "due": None}, InvalidDueTime, "row 2: due column 'due' is null"),
        ({"id": "a", "due": float("nan")}, InvalidDueTime, "row 2: eta must be finite"),
        ({"id": "a", "due": -5.0}, InvalidDueTime, "before 1970"),
        ({"id": None, "due": 1.0}, TypeError, "row 2: id column 'id' is null"),
        ({"id": "a"}, ConfigurationError, "row 2: no column 'due'"),
        ({"id": "a", "due": 1.0, "kw": "[1]"}, TypeError, "not an object"),
        ({"id": "a", "due": 1.0, "kw": '{"x": {1, 2}'}, ValueError, "row 2"),
    ],
)
def test_a_bad_row_stores_nothing_of_its_batch(
    redis_url: str, r: redis.Redis, row: dict[str, Any], error: type[Exception], message: str
) -> None:
    good = [{"id": "g1", "due": 1.0, "kw": "{}"}, {"id": "g2", "due": 2.0, "kw": '{"x": 1}'}]
    options = {"url": redis_url, "task": "t.noop", "idColumn": "id", "kwargsColumn": "kw"}
    with pytest.raises(error, match=message):
        write_rows(options, [*good, {"kw": "{}", **row}])
    assert pending_ids(r) == {}


def test_an_argument_the_serializer_refuses_names_its_row(redis_url: str, r: redis.Redis) -> None:
    rows = [{"id": f"j{i}", "due": 1.0, "x": i} for i in range(5)] + [{"id": "bad", "due": 1.0, "x": {1}}]
    with pytest.raises(TypeError, match=r"row 5 \(id 'bad'\)"):
        write_rows({"url": redis_url, "task": "t.noop", "idColumn": "id", "args": "x"}, rows)
    assert pending_ids(r) == {}


def test_arrow_batches_take_timestamps_structs_maps_arrays_and_json(redis_url: str, r: redis.Redis) -> None:
    micros = int(BASE.timestamp() * 1_000_000) + 1_499  # 1.499 ms past: rounds to the ms, as apply_at
    batch = pa.RecordBatch.from_pydict(
        {
            "due": pa.array([micros, micros], pa.timestamp("us", tz="UTC")),
            "uid": pa.array([1, 2], pa.int64()),
            "args": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
            "kw": pa.array(
                [{"a": "x", "n": 1}, {"a": None, "n": 2}], pa.struct([("a", pa.string()), ("n", pa.int64())])
            ),
        }
    )
    opts = WriteOptions.parse({"url": redis_url, "task": "t.f", "argsColumn": "args", "kwargsColumn": "kw",
                               "idTemplate": "u{uid}"})  # fmt: skip
    with JobWriter(opts) as writer:
        writer.add_batch(batch)
    assert writer.stats.stored == 2
    assert pending_ids(r) == {"u1": BASE.timestamp() * 1000 + 1, "u2": BASE.timestamp() * 1000 + 1}
    body = json.loads(stored(r, "u2")["j"] + "]")  # the plain tail ({callbacks...}) is left out
    assert body[:2] == [[3], {"a": None, "n": 2}]

    maps = pa.RecordBatch.from_pydict(
        {
            "due": pa.array([BASE.timestamp()], pa.float64()),
            "id": pa.array(["m"]),
            "kw": pa.array([[("k", 5)]], pa.map_(pa.string(), pa.int64())),
            "a": pa.array(['["s", 1]']),
        }
    )
    opts = WriteOptions.parse({"url": redis_url, "task": "t.f", "argsColumn": "a", "kwargsColumn": "kw",
                               "idColumn": "id"})  # fmt: skip
    with JobWriter(opts) as writer:
        writer.add_batch(maps)
    assert json.loads(stored(r, "m")["j"] + "]")[:2] == [["s", 1], {"k": 5}]


def test_an_arrow_batch_with_a_null_due_names_the_row(redis_url: str, r: redis.Redis) -> None:
    batch = pa.RecordBatch.from_pydict(
        {"due": pa.array([1, None], pa.timestamp("us", tz="UTC")), "id": pa.array(["a", "b"])}
    )
    opts = WriteOptions.parse({"url": redis_url, "task": "t.f", "idColumn": "id"})
    with pytest.raises(InvalidDueTime, match="row 1: due column 'due' is null"), JobWriter(opts) as writer:
        writer.add_batch(batch)
    assert pending_ids(r) == {}


def test_the_due_column_may_also_be_an_argument_and_an_id_field(
    app: Celery, redis_url: str, r: redis.Redis
) -> None:
    """A reminder that receives its own due time: the due column also in ``args``, ``kwargs``
    and ``idTemplate``. The task gets the value as the row has it (a timestamp as a datetime,
    as every timestamp column): the job is what ``apply_at(due, (due,), {"due": due})`` stores,
    from mappings and from Arrow batches (before: ``KeyError: 'due'`` in add_batch)."""
    from kombu.utils.json import loads

    @app.task(base=DelayedTask, name="t.remind", shared=False)
    def remind(at: datetime, due: datetime | None = None, user_id: int = 0) -> None:
        return None

    remind.apply_at(BASE, (BASE,), {"due": BASE, "user_id": 7}, task_id="direct")
    options = {"url": redis_url, "task": "t.remind", "args": "due", "kwargs": "due,user_id",
               "idTemplate": "r:{user_id}:{due:%Y%m%d}"}  # fmt: skip
    write_rows(options, [{"user_id": 7, "due": BASE}])
    assert comparable(stored(r, "r:7:20310504")) == comparable(stored(r, "direct"))
    batch = pa.RecordBatch.from_pydict(
        {
            "due": pa.array([int(BASE.timestamp() * 1_000_000)], pa.timestamp("us", tz="UTC")),
            "user_id": pa.array([8], pa.int64()),
        }
    )
    with JobWriter(WriteOptions.parse(options)) as writer:
        writer.add_batch(batch)
    assert pending_ids(r)["r:8:20310504"] == BASE.timestamp() * 1000
    args, kwargs = loads(stored(r, "r:8:20310504")["j"] + "]")[:2]
    assert args == [BASE] and kwargs == {"due": BASE, "user_id": 8}
    seconds = pa.RecordBatch.from_pydict({"due": pa.array([BASE.timestamp()]), "user_id": pa.array([9])})
    with JobWriter(WriteOptions.parse(options | {"idTemplate": "r:{user_id}"})) as writer:
        writer.add_batch(seconds)  # epoch seconds: the task gets the number, as the row has it
    seconds_args = [[BASE.timestamp()], {"due": BASE.timestamp(), "user_id": 9}]
    assert loads(stored(r, "r:9")["j"] + "]")[:2] == seconds_args


def test_an_arrow_batch_names_the_row_a_value_cannot_work_for(redis_url: str, r: redis.Redis) -> None:
    """Per-row problems of an Arrow batch name the row, never a bare KeyError or JSON error."""
    batch = pa.RecordBatch.from_pydict(
        {"due": pa.array([1.0, 2.0, 3.0]), "uid": pa.array([1, 2, 3]), "a": pa.array(["[1]", "[2]", "[3"])}
    )
    base = {"url": redis_url, "task": "t.f", "idTemplate": "u{uid}"}
    cases: list[tuple[dict[str, str], type[Exception], str]] = [
        ({"argsColumn": "a"}, ValueError, r"^row 2: .*char"),  # a JSON array cut short
        (
            {"idTemplate": "u{uid:%Y}"},
            InvalidOptions,
            r"^row 0: idTemplate 'u\{uid:%Y\}' cannot format uid=1:",
        ),
        ({"idTemplate": "u{uid.name}"}, InvalidOptions, r"^row 0: idTemplate .* AttributeError"),
        ({"args": "nope"}, ConfigurationError, r"no column 'nope' in the batch \(its columns: due, uid, a\)"),
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message), JobWriter(WriteOptions.parse(base | extra)) as writer:
            writer.add_batch(batch)
    with pytest.raises(InvalidOptions, match=r"^row 0: idTemplate"):
        write_rows(base | {"idTemplate": "u{uid[0]}"}, [{"due": 1.0, "uid": 1}])
    with pytest.raises(
        InvalidOptions, match=r"^row 1 \(id 'a\\nb'\): task_id 'a\\nb' of 't.f' holds a control"
    ):
        rows = [{"id": "ok", "due": 1.0}, {"id": "a\nb", "due": 1.0}]
        write_rows({"url": redis_url, "task": "t.f", "idColumn": "id"}, rows)
    assert pending_ids(r) == {}


# -- reading, without Spark -----------------------------------------------------------------------


def test_read_shard_reports_waiting_due_leased_and_dead_jobs(redis_url: str, r: redis.Redis) -> None:
    store = make_store(redis_url, shards=1, reclaim_ttl=600)
    now = time.time()
    rows = [
        {"id": "past-1", "due": now - 60, "x": 1},
        {"id": "past-2", "due": now - 30, "x": 2},
        {"id": "future", "due": now + 3600, "x": 3},
    ]
    write_rows({"url": redis_url, "task": "t.f", "idColumn": "id", "args": "x", "shards": "1"}, rows)
    claimed = store.claim([0], "beat-1", batch=1)[0].jobs  # past-1: leased until now + 600 s
    assert [j.id for j in claimed] == ["past-1"]
    store.enqueue([("dead-one", int((now - 10) * 1000), '{"v":2,"t":"t.gone","c":1}')])
    store.claim([0], "beat-2", batch=5)  # past-2 and dead-one
    store.bury("beat-2", "dead-one", {"reason": "unknown task", "due": int((now - 10) * 1000), "tries": 1,
                                      "envelope": '{"v":2,"t":"t.gone","c":1}'})  # fmt: skip
    rows_out = {row[0]: dict(zip(READ_COLUMNS, row, strict=True)) for row in read_shard(store, 0)}
    assert {k: v["state"] for k, v in rows_out.items()} == {
        "past-1": "leased", "past-2": "leased", "future": "waiting", "dead-one": "dead",
    }  # fmt: skip
    leased = rows_out["past-1"]
    assert leased["task"] == "t.f" and leased["args"] == "[1]" and leased["kwargs"] == "{}"
    assert leased["tries"] == 1 and leased["lease_until"] > datetime.now(UTC) + timedelta(seconds=500)
    assert abs(leased["due"].timestamp() - (now - 60)) < 0.002
    assert rows_out["dead-one"]["reason"] == "unknown task"
    assert rows_out["future"]["queue"] == "celery" and rows_out["future"]["lease_until"] is None

    # A window on due: leased jobs (scored by their lease expiry) are selected by their due time.
    window = {row[0] for row in read_shard(store, 0, int((now - 70) * 1000), int((now - 50) * 1000))}
    assert window == {"past-1"}
    assert {row[0] for row in read_shard(store, 0, include_dead=False)} == {"past-1", "past-2", "future"}

    store.enqueue([("overdue", int((now - 5) * 1000), '{"v":2,"t":"t.f","c":1}')])
    states = {row[0]: row[4] for row in read_shard(store, 0)}
    assert states["overdue"] == "due" and states["future"] == "waiting"
    store.close()


def test_read_shard_reports_gated_and_running_jobs(redis_url: str, r: redis.Redis) -> None:
    """Flow control's jobs: a capped job whose task runs ("running", lease_until its slot) and
    one parked for a slot of its key ("gated", no lease_until: its score is far beyond any
    timestamp Spark takes)."""
    from celery_delayq.flow.gate import Gate, gated_id

    store = make_store(redis_url, shards=1, reclaim_ttl=600)
    now = time.time()
    ids = [gated_id("tenant", None) for _ in range(2)]
    envelope = '{"v":2,"t":"t.f","c":1}'
    store.enqueue([(job_id, int((now - 10 + i) * 1000), envelope) for i, job_id in enumerate(ids)])
    claimed = store.claim([0], "beat-1", batch=5)[0].jobs
    decided = store.gate("beat-1", {0: [(job.id, Gate("tenant", 1)) for job in claimed]}, 60_000)
    assert [decided[job_id].decision.value for job_id in ids] == ["released", "parked"]
    assert store.hold("beat-1", {0: [(ids[0], "tenant")]}, 3_600_000) == {ids[0]: True}
    rows_out = {row[0]: dict(zip(READ_COLUMNS, row, strict=True)) for row in read_shard(store, 0)}
    running, parked = rows_out[ids[0]], rows_out[ids[1]]
    assert (running["state"], parked["state"]) == ("running", "gated")
    assert running["lease_until"] > datetime.now(UTC) + timedelta(seconds=3000)
    assert parked["lease_until"] is None and abs(parked["due"].timestamp() - (now - 9)) < 0.002
    assert (running["tries"], parked["tries"]) == (1, 0)  # a parked job's claim is not a delivery
    store.close()


def test_read_shard_window_edges_are_inclusive_and_pages_join_up(redis_url: str, r: redis.Redis) -> None:
    store = make_store(redis_url, shards=1)
    base = int(BASE.timestamp() * 1000)
    write_rows({"url": redis_url, "task": "t.f", "idColumn": "id", "shards": "1"},
               [{"id": f"j{i}", "due": (base + i) / 1000} for i in range(23)])  # fmt: skip
    got = [row[0] for row in read_shard(store, 0, base + 5, base + 17, page_size=4)]
    assert got == [f"j{i}" for i in range(5, 18)]
    assert list(read_shard(store, 0, base + 9, base + 8)) == []
    store.close()


# -- Spark --------------------------------------------------------------------------------------------


def _users(spark: Any, n: int, start: datetime = BASE, step_s: int = 1) -> Any:
    from pyspark.sql import functions as F

    return spark.range(0, n).select(
        F.col("id").alias("user_id"),
        (F.lit(int(start.timestamp())) + F.col("id") * step_s).cast("timestamp").alias("due"),
        F.concat(F.lit("hello "), F.col("id").cast("string")).alias("text"),
        F.lit("2031-05-04").alias("day"),
    )


def _writer(df: Any, url: str, **options: str) -> Any:
    w = df.write.format("delayq").option("url", url).option("task", "t.remind")
    for key, value in {"kwargs": "user_id,text", "idTemplate": "r:{user_id}:{day}", **options}.items():
        w = w.option(key, value)
    return w.mode("append")


@pytest.mark.spark
@pytest.mark.slow
def test_spark_write_is_idempotent_and_matches_apply_at(spark: Any, app: Celery, redis_url: str,
                                                        r: redis.Redis) -> None:  # fmt: skip
    df = _users(spark, 2_000).repartition(3)
    _writer(df, redis_url).save()
    first = pending_ids(r)
    assert len(first) == 2_000
    assert first["r:5:2031-05-04"] == (BASE.timestamp() + 5) * 1000
    _writer(df, redis_url).save()
    assert pending_ids(r) == first

    @app.task(base=DelayedTask, name="t.remind", shared=False)
    def remind(user_id: int, text: str) -> None:
        return None

    remind.apply_at(BASE + timedelta(seconds=5), kwargs={"user_id": 5, "text": "hello 5"}, task_id="direct")
    assert comparable(stored(r, "r:5:2031-05-04")) == comparable(stored(r, "direct"))


@pytest.mark.spark
@pytest.mark.slow
def test_spark_write_refuses_overwrite_a_missing_column_and_a_bad_url(spark: Any, redis_url: str,
                                                                     r: redis.Redis) -> None:  # fmt: skip
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    df = _users(spark, 10)
    errors = (PySparkException, Py4JJavaError)
    with pytest.raises(errors, match="mode\\('append'\\)"):
        _writer(df, redis_url).mode("overwrite").save()
    with pytest.raises(errors, match="no column 'nope'"):
        _writer(df, redis_url, kwargs="user_id,nope").save()
    with pytest.raises(errors, match=r"(?i)unknown option 'dueColum'"):  # Spark lower-cases names
        _writer(df, redis_url, dueColum="due").save()
    with pytest.raises(errors, match=r"Connection refused|ConnectionError"):
        _writer(df, "redis://127.0.0.1:1/0").save()
    assert pending_ids(r) == {}


@pytest.mark.spark
@pytest.mark.slow
def test_spark_write_takes_the_due_column_as_an_argument_too(spark: Any, redis_url: str,
                                                             r: redis.Redis) -> None:  # fmt: skip
    """``dueColumn`` also in ``args`` and ``idTemplate`` (a reminder that receives its own due
    time): every row is stored, the task gets the row's timestamp as a datetime (before: the
    executor failed with ``KeyError: 'due'``)."""
    from kombu.utils.json import loads

    df = _users(spark, 200).repartition(2)
    _writer(df, redis_url, args="due", kwargs="user_id", idTemplate="r:{user_id}:{due:%H%M%S}").save()
    jobs = pending_ids(r)
    assert len(jobs) == 200
    assert jobs["r:5:120005"] == (BASE.timestamp() + 5) * 1000
    assert loads(stored(r, "r:5:120005")["j"] + "]")[:2] == [[BASE + timedelta(seconds=5)], {"user_id": 5}]


@pytest.mark.spark
@pytest.mark.slow
def test_spark_read_pushes_a_due_window_down_to_a_score_range(spark: Any, redis_url: str,
                                                             r: redis.Redis) -> None:  # fmt: skip
    from pyspark.sql import functions as F

    write_rows({"url": redis_url, "task": "t.remind", "kwargs": "user_id", "idTemplate": "r:{user_id}"},
               [{"user_id": i, "due": BASE.timestamp() + 60 * i} for i in range(1_000)])  # fmt: skip

    def load() -> Any:
        # A fresh DataFrame per filtered query: Spark 4.1-4.3 reuse the last pushed-down reader
        # of a DataFrame for its later queries that have no filter (docs/spark.md, "Filters").
        return spark.read.format("delayq").option("url", redis_url).option("pageSize", "5").load()

    df = load()
    assert tuple(df.columns) == READ_COLUMNS
    calls_before, _ = command_calls(r, "zrange")
    assert df.count() == 1_000
    full_calls = command_calls(r, "zrange")[0] - calls_before
    assert full_calls >= 200  # 1,000 jobs in pages of 5

    start = BASE + timedelta(minutes=100)
    hour = load().where((F.col("due") >= F.lit(start)) & (F.col("due") < F.lit(start + timedelta(hours=1))))
    calls_before = command_calls(r, "zrange")[0]
    ids = sorted(row.id for row in hour.select("id").collect())
    window_calls = command_calls(r, "zrange")[0] - calls_before
    assert ids == sorted(f"r:{i}" for i in range(100, 160))
    assert window_calls <= 16 + 60 // 5 + 16, window_calls  # one range per shard, not every job

    # strict bounds and equality, at whole milliseconds
    at = BASE + timedelta(minutes=10)
    assert [row.id for row in load().where(F.col("due") == F.lit(at)).collect()] == ["r:10"]
    after = (F.col("due") > F.lit(at)) & (F.col("due") <= F.lit(at + timedelta(minutes=2)))
    assert load().where(after).count() == 2
    assert load().where(F.col("due") == F.lit(at + timedelta(microseconds=1))).count() == 0

    shard = KeySpace("delayq", 16).shard_of("r:10")
    one = load().where(F.col("shard") == shard)
    assert one.rdd.getNumPartitions() == 1
    assert "r:10" in {row.id for row in one.collect()}

    window = spark.read.format("delayq").option("url", redis_url)
    window = window.option("dueFrom", str(BASE.timestamp())).option("dueUntil", str(BASE.timestamp() + 120))
    assert sorted(row.id for row in window.load().collect()) == ["r:0", "r:1", "r:2"]

    minute = df.groupBy(F.date_trunc("hour", "due").alias("hour")).count().orderBy("hour").first()
    assert minute is not None and minute["count"] == 60


@pytest.mark.spark
@pytest.mark.e2e
@pytest.mark.slow
def test_jobs_written_by_spark_are_delivered_by_a_real_beat_and_worker(
    spark: Any, redis_url: str, r: redis.Redis, procs: Procs
) -> None:
    """A real beat and worker cannot tell Spark's jobs from apply_at's: both run, once each."""
    soon = datetime.now(UTC) + timedelta(seconds=3)
    df = _users(spark, 300, start=soon, step_s=0).repartition(2)
    (df.write.format("delayq").option("url", redis_url).option("task", "e2e.record")
       .option("args", "user_id").option("kwargs", "text").option("idTemplate", "spark:{user_id}")
       .mode("append").save())  # fmt: skip
    producer = make_app(redis_url)

    @producer.task(base=DelayedTask, name="e2e.record", bind=True, shared=False)
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    direct = [record.apply_at(soon, (i,), {"text": "x"}, task_id=f"direct:{i}").id for i in range(20)]
    env = subprocess_env(redis_url, redis_url)
    procs.start("worker", env)
    procs.start("beat", env)
    expected = {f"spark:{i}" for i in range(300)} | set(direct)
    done = wait_for(lambda: r.hlen("e2e:runs") >= len(expected), 120, 0.2)
    runs = {k: int(v) for k, v in r.hgetall("e2e:runs").items()}
    assert done, f"{len(runs)} of {len(expected)} ran\n{procs.logs()}"
    time.sleep(1.0)
    runs = {k: int(v) for k, v in r.hgetall("e2e:runs").items()}
    assert set(runs) == expected
    assert set(runs.values()) == {1}
    assert DelayQ(producer).count() == 0
    get_store(producer).close()
    producer.close()


@pytest.mark.spark
@pytest.mark.slow
def test_without_spark_s_pushdown_setting_filters_still_work(spark: Any, redis_url: str,
                                                            r: redis.Redis) -> None:  # fmt: skip
    """Spark refuses a reader with ``pushFilters`` when ``spark.sql.python.filterPushdown.enabled``
    is off; the source then plans the plain reader, and Spark applies the filters itself."""
    from pyspark.sql import functions as F

    write_rows({"url": redis_url, "task": "t.remind", "kwargs": "user_id", "idTemplate": "r:{user_id}"},
               [{"user_id": i, "due": BASE.timestamp() + 60 * i} for i in range(100)])  # fmt: skip
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
    try:
        df = spark.read.format("delayq").option("url", redis_url).load()
        window = df.where((F.col("due") >= F.lit(BASE)) & (F.col("due") < F.lit(BASE + timedelta(minutes=5))))
        assert sorted(row.id for row in window.collect()) == [f"r:{i}" for i in range(5)]
        assert df.count() == 100
        assert df.where(F.col("shard") == 0).rdd.getNumPartitions() == 16
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")


@pytest.mark.cluster
def test_write_and_read_on_a_redis_cluster(cluster_url: str) -> None:
    """``cluster=true``: each partition's client is a cluster client; shards spread over the nodes."""
    rows = [{"user": u, "due": BASE.timestamp() + u} for u in range(400)]
    options = {"url": cluster_url, "cluster": "true", "task": "t.remind", "kwargs": "user",
               "idTemplate": "c:{user}"}  # fmt: skip
    assert write_rows(options, rows).stored == 400
    assert write_rows(options, rows).kept == 400
    read = ReadOptions.parse({"url": cluster_url, "cluster": "true", "includeDead": "false"})
    assert read.store.config().cluster and not read.include_dead
    store = make_store(cluster_url, cluster=True)
    try:
        found = [row for shard in range(16) for row in read_shard(store, shard, include_dead=False)]
        assert sorted(row[0] for row in found) == sorted(f"c:{u}" for u in range(400))
        assert {row[4] for row in found} == {"waiting"}
        window = [row[0] for row in read_shard(store, KeySpace("delayq", 16).shard_of("c:7"),
                                               int((BASE.timestamp() + 7) * 1000),
                                               int((BASE.timestamp() + 7) * 1000))]  # fmt: skip
        assert window == ["c:7"]
    finally:
        store.close()
