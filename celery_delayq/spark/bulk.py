"""Rows as jobs, without Spark: the plain-Python writer and reader behind the ``delayq``
Spark data source (:mod:`celery_delayq.spark` is its public face; :mod:`._spark_source`, the
part that imports pyspark, builds on this module and never on that one).

Behind each side is a plain-Python function that needs no Spark:
:func:`write_rows` schedules an iterable of row mappings (the Spark writer
feeds it Arrow batches, a partition at a time, through :class:`JobWriter`), and
:func:`read_shard` lists the jobs of one shard in a due-time range.

Every job written is exactly what ``task.apply_at(due, args, kwargs, **options)``
would store for it (the same envelope builder), so beats and workers cannot
tell the two apart. With an id column or template the write is idempotent: a
job whose id is still pending is kept as it is (``replace=true`` overwrites it),
so running the same write twice leaves the same set of pending jobs.

This module is over 600 lines because the options of both sides are most of it: each is
parsed and checked here, on the driver, with a message that names it as the user spelled it.

>>> opts = WriteOptions.parse({"url": "redis://127.0.0.1:6390/0", "task": "t.remind",
...                            "kwargs": "user_id", "idTemplate": "r:{user_id}:{day}"})
>>> opts.kwargs, opts.id_fields
(('user_id',), ('day', 'user_id'))
>>> opts.job_id({"user_id": 7, "day": "2026-11-21"})
'r:7:2026-11-21'
"""

from __future__ import annotations

import json
import math
import string
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from ..build import build_envelopes, new_task_ids
from ..config import DEFAULTS, DelayQConfig, setting_name
from ..due import MAX_DUE_MS, due_ms_from_eta, ms_to_datetime
from ..envelope import decode_envelope, loaded_form
from ..exceptions import ConfigurationError, DelayQError, InvalidDueTime, InvalidOptions, UnknownTask
from ..gate import PARK_MS
from ..store import EnqueueOutcome, Store

__all__ = [
    "READ_COLUMNS",
    "READ_SCHEMA",
    "JobWriter",
    "ReadOptions",
    "WriteOptions",
    "WriteStats",
    "read_shard",
    "write_rows",
]

#: The columns ``spark.read.format("delayq")`` returns, as a Spark DDL schema.
READ_SCHEMA = (
    "id STRING, task STRING, due TIMESTAMP, shard INT, state STRING, queue STRING, "
    "args STRING, kwargs STRING, tries INT, lease_until TIMESTAMP, created TIMESTAMP, reason STRING"
)
READ_COLUMNS = tuple(part.split()[0] for part in READ_SCHEMA.split(", "))

# Options the two sides take (Spark hands them over case-insensitively; so does parse()).
_STORE_OPTIONS = ("url", "app", "prefix", "shards", "cluster", "timezone")
_WRITE_ONLY = (
    "task", "duecolumn", "args", "kwargs", "argscolumn", "kwargscolumn", "idcolumn", "idtemplate",
    "queue", "priority", "routingkey", "expires", "options", "replace", "batchsize",
)  # fmt: skip
_READ_ONLY = ("duefrom", "dueuntil", "includedead", "pagesize")
_SPELLING = {
    name.lower(): name
    for name in (
        "dueColumn", "argsColumn", "kwargsColumn", "idColumn", "idTemplate", "routingKey",
        "batchSize", "dueFrom", "dueUntil", "includeDead", "pageSize",
    )
}  # fmt: skip
_NUMERIC = ("tinyint", "smallint", "int", "bigint", "float", "double", "decimal")


def _spelled(name: str) -> str:
    return _SPELLING.get(name, name)


def _lower(options: Mapping[str, Any], allowed: Sequence[str], side: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in options.items():
        name = str(key).lower()
        if name not in allowed:
            known = ", ".join(sorted(_spelled(a) for a in allowed))
            raise ConfigurationError(f"delayq {side}: unknown option {key!r}; the options are: {known}")
        if value is not None:
            out[name] = str(value)
    return out


def _flag(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {_spelled(name)} must be true or false, got {value!r}")


def _integer(name: str, value: str | None, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(f"option {_spelled(name)} must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ConfigurationError(f"option {_spelled(name)} must be between {low} and {high}, got {number}")
    return number


def _columns(name: str, value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    names = tuple(part.strip() for part in value.split(","))
    if not all(names):
        raise ConfigurationError(
            f"option {_spelled(name)} must be comma-separated column names, got {value!r}"
        )
    return names


# -- the store and the app --------------------------------------------------------------------


@dataclass(frozen=True)
class StoreOptions:
    """Where the jobs live: a Redis URL and the app's prefix and shard count (or an app to read
    them from). Picklable: Spark ships it to every executor, which opens its own client."""

    url: str | None = None
    app: str | None = None
    prefix: str | None = None
    shards: int | None = None
    cluster: bool | None = None
    timezone: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> StoreOptions:
        shards = options.get("shards")
        cluster = options.get("cluster")
        made = cls(
            url=options.get("url"),
            app=options.get("app"),
            prefix=options.get("prefix"),
            shards=None if shards is None else _integer("shards", shards, 16, 1, 1 << 20),
            cluster=None if cluster is None else _flag("cluster", cluster, False),
            timezone=options.get("timezone"),
        )
        made.config()  # every mistake in these options is reported now, on the driver
        return made

    def celery_app(self) -> Any:
        """The Celery app the jobs are built with: the named one, or a bare app (a task it
        does not have is then scheduled by name, with the app's defaults, as ``send_task``)."""
        key = (self.app, self.timezone)
        with _APPS_LOCK:
            app = _APPS.get(key)
            if app is None:
                app = _load_app(self.app, self.timezone)
                _APPS[key] = app
        return app

    def config(self) -> DelayQConfig:
        app = self.celery_app()
        if self.app is None:
            if not self.url:
                raise ConfigurationError(
                    "delayq: option url is required (the store's Redis URL), or option app naming "
                    "the Celery app whose delayq_* settings to use, e.g. 'proj.celery:app'"
                )
            values: dict[str, Any] = {"delayq_url": self.url}
            if self.prefix is not None:
                values["delayq_prefix"] = self.prefix
            if self.shards is not None:
                values["delayq_shards"] = self.shards
            if self.cluster is not None:
                values["delayq_cluster"] = self.cluster
            return DelayQConfig.from_mapping(values)
        base = DelayQConfig.from_app(app)
        for name, given, own in (("prefix", self.prefix, base.prefix), ("shards", self.shards, base.shards)):
            if given is not None and given != own:
                raise ConfigurationError(
                    f"option {name}={given!r} does not match "
                    f"{setting_name(app, 'delayq_' + name)}={own!r} of app {self.app!r}: "
                    "jobs written with another prefix or shard count are never seen by its beats"
                )
        values = {f"delayq_{name}": getattr(base, name) for name in _CONFIG_NAMES}
        if self.url:
            values["delayq_url"] = self.url
        if self.cluster is not None:
            values["delayq_cluster"] = self.cluster
        return DelayQConfig.from_mapping(values)


_CONFIG_NAMES = tuple(name.removeprefix("delayq_") for name in DEFAULTS)
_APPS: dict[tuple[str | None, str | None], Any] = {}
_APPS_LOCK = threading.Lock()


def _load_app(ref: str | None, timezone: str | None) -> Any:
    from celery import Celery

    if ref is None:
        app = Celery("delayq-spark", set_as_current=False)
        if timezone:
            app.conf.timezone = timezone
        return app
    from celery.app.utils import find_app

    try:
        app = find_app(ref)
    except Exception as exc:
        raise ConfigurationError(
            f"option app={ref!r}: cannot load the Celery app ({type(exc).__name__}: {exc}); give "
            "'module:attribute' importable where Spark runs Python (the driver and every executor)"
        ) from exc
    if timezone:
        raise ConfigurationError("option timezone is taken from the app when option app is given")
    return app


# -- writing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteOptions:
    """A validated write: which task, which columns, which options (see ``docs/spark.md``)."""

    store: StoreOptions
    task: str
    due: str = "due"
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    args_column: str | None = None
    kwargs_column: str | None = None
    id_column: str | None = None
    id_template: str | None = None
    id_fields: tuple[str, ...] = ()
    call_options: tuple[tuple[str, Any], ...] = ()
    replace: bool = False
    batch_size: int = 5000

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> WriteOptions:
        """Read and check Spark's string options; every mistake raises ConfigurationError here."""
        opts = _lower(options, _STORE_OPTIONS + _WRITE_ONLY, "write")
        store = StoreOptions.parse(opts)
        task = opts.get("task", "").strip()
        if not task:
            raise ConfigurationError("delayq write: option task is required (the task's registered name)")
        args, kwargs = _columns("args", opts.get("args")), _columns("kwargs", opts.get("kwargs"))
        args_column, kwargs_column = opts.get("argscolumn"), opts.get("kwargscolumn")
        if args and args_column:
            raise ConfigurationError("options args and argsColumn exclude each other: give one")
        if kwargs and kwargs_column:
            raise ConfigurationError("options kwargs and kwargsColumn exclude each other: give one")
        id_column, id_template = opts.get("idcolumn"), opts.get("idtemplate")
        if id_column and id_template:
            raise ConfigurationError("options idColumn and idTemplate exclude each other: give one")
        id_fields: tuple[str, ...] = ()
        if id_template is not None:
            id_fields = _template_fields(id_template)
        call: dict[str, Any] = {}
        if "options" in opts:
            try:
                extra = json.loads(opts["options"])
            except ValueError as exc:
                raise ConfigurationError(f"option options must be a JSON object: {exc}") from None
            if not isinstance(extra, dict):
                raise ConfigurationError("option options must be a JSON object of apply_async options")
            call.update(extra)
        for name in ("task_id", "replace", "eta", "countdown"):
            if name in call:
                raise ConfigurationError(
                    f"option options may not set {name!r}: ids come from idColumn/idTemplate, the due "
                    "time from dueColumn, and replace is an option of its own"
                )
        if "queue" in opts:
            call["queue"] = opts["queue"]
        if "routingkey" in opts:
            call["routing_key"] = opts["routingkey"]
        if "priority" in opts:
            call["priority"] = _integer("priority", opts["priority"], 0, 0, 255)
        if "expires" in opts:
            try:
                expires = float(opts["expires"])
            except ValueError:
                expires = math.nan
            if not math.isfinite(expires) or expires < 0:
                raise ConfigurationError(
                    f"option expires must be seconds after the due time (>= 0), got {opts['expires']!r}"
                )
            call["expires"] = expires
        made = cls(
            store=store,
            task=task,
            due=opts.get("duecolumn", "due"),
            args=args,
            kwargs=kwargs,
            args_column=args_column,
            kwargs_column=kwargs_column,
            id_column=id_column,
            id_template=id_template,
            id_fields=id_fields,
            call_options=tuple(sorted(call.items())),
            replace=_flag("replace", opts.get("replace"), False),
            batch_size=_integer("batchSize", opts.get("batchsize"), 5000, 1, 1_000_000),
        )
        made.check_options()
        return made

    def columns_used(self) -> list[str]:
        """Every input column the write reads."""
        names = [self.due, *self.args, *self.kwargs]
        names += [c for c in (self.args_column, self.kwargs_column, self.id_column) if c]
        names += self.id_fields
        return list(dict.fromkeys(names))

    def task_of(self, app: Any) -> Any:
        """The task object when an app was named (it must have the task), else the name."""
        if not self.store.app:
            return self.task
        task = app.tasks.get(self.task)
        if task is None:
            raise UnknownTask(
                f"app {self.store.app!r} has no task {self.task!r}; its tasks: "
                + ", ".join(sorted(name for name in app.tasks if not name.startswith("celery.")))
            )
        return task

    def check_options(self) -> None:
        """Build one envelope with these options (a bad queue, priority or option raises here)."""
        app = self.store.celery_app()
        task = self.task_of(app)
        try:
            build_envelopes(app, task, [("delayq-check", 0, None, None)], dict(self.call_options))
        except TypeError as exc:  # the task's signature: checked per row, not here
            if "argument" not in str(exc):
                raise

    def check_schema(self, types: Mapping[str, str]) -> None:
        """Refuse a DataFrame the write cannot read: ``types`` maps column name -> Spark type
        (``simpleString``). Called on the driver before any row is read."""
        missing = [name for name in self.columns_used() if name not in types]
        if missing:
            raise ConfigurationError(
                f"delayq write: no column {', '.join(map(repr, missing))} in the DataFrame "
                f"(its columns: {', '.join(types)})"
            )
        due = types[self.due]
        if not (due.startswith(("timestamp", "string")) or due.startswith(_NUMERIC)):
            raise ConfigurationError(
                f"due column {self.due!r} is {due}: it must be a timestamp, epoch seconds (a number) "
                "or an ISO-8601 string"
            )
        if self.args_column and not types[self.args_column].startswith(("array", "string")):
            raise ConfigurationError(
                f"argsColumn {self.args_column!r} is {types[self.args_column]}: it must be an array "
                "or a JSON string"
            )
        if self.kwargs_column and not types[self.kwargs_column].startswith(("struct", "map", "string")):
            raise ConfigurationError(
                f"kwargsColumn {self.kwargs_column!r} is {types[self.kwargs_column]}: it must be a "
                "struct, a map or a JSON string"
            )

    def job_id(self, row: Mapping[str, Any]) -> str | None:
        """The job id of ``row`` (None: a random one, as apply_at makes)."""
        if self.id_column is not None:
            value = row[self.id_column]
            if value is None:
                raise InvalidOptions(f"id column {self.id_column!r} is null")
            return str(value)
        if self.id_template is not None:
            return self.id_template.format_map({name: row[name] for name in self.id_fields})
        return None


def _template_fields(template: str) -> tuple[str, ...]:
    names: set[str] = set()
    try:
        for _, name, _, _ in string.Formatter().parse(template):
            if name is None:
                continue
            base = name.split(".", 1)[0].split("[", 1)[0]
            if not base or base.isdigit():
                raise ConfigurationError(
                    f"idTemplate {template!r}: every field must name a column, like {{user_id}}"
                )
            names.add(base)
    except ValueError as exc:
        raise ConfigurationError(f"idTemplate {template!r} is not a format string: {exc}") from None
    if not names:
        raise ConfigurationError(
            f"idTemplate {template!r} names no column: every row would get the same id"
        )
    return tuple(sorted(names))


@dataclass
class WriteStats:
    """What a write did: rows read, jobs stored new, replaced, and kept (an id already pending)."""

    rows: int = 0
    stored: int = 0
    replaced: int = 0
    kept: int = 0

    def add(self, other: WriteStats) -> None:
        self.rows += other.rows
        self.stored += other.stored
        self.replaced += other.replaced
        self.kept += other.kept


def _due_ms(value: Any, app: Any) -> int:
    if isinstance(value, Decimal):
        value = float(value)
    return due_ms_from_eta(value, app, naive_in_zone=True)


def _as_kwargs(value: Any, column: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    elif isinstance(value, list):  # an Arrow map arrives as (key, value) pairs
        value = dict(value)
    if not isinstance(value, dict):
        raise InvalidOptions(f"kwargsColumn {column!r} holds {type(value).__name__}, not an object")
    return value


def _as_args(value: Any, column: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list | tuple):
        raise InvalidOptions(f"argsColumn {column!r} holds {type(value).__name__}, not an array")
    return list(value)


class JobWriter:
    """Schedules rows in batches through one Redis client: what one Spark partition runs.

    Rows are buffered up to ``batch_size``; each batch is validated and built
    completely (a bad row raises, naming its position, before the batch is
    written), then written with one pipeline of enqueue scripts grouped by shard,
    by a writer thread, while the next batch is built (the build is Python, the
    write mostly waiting on Redis). Batches already handed over are stored even
    when a later row fails.
    """

    def __init__(self, options: WriteOptions, store: Store | None = None) -> None:
        self.options = options
        self.app = options.store.celery_app()
        self.task: Any = options.task_of(self.app)
        self.config = options.store.config()
        self.store = store if store is not None else Store(self.config)
        self._own_store = store is None
        self.stats = WriteStats()
        self._call = dict(options.call_options)
        self._ids: list[str | None] = []
        self._due: list[int] = []
        self._args: list[Any] = []
        self._kwargs: list[Any] = []
        self._built = 0  # rows whose envelopes were built (a row's number in errors)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: Future[WriteStats] | None = None

    # -- input ------------------------------------------------------------------------------

    def add_row(self, row: Mapping[str, Any]) -> None:
        """Buffer one row (a mapping of column -> value); writes when the buffer is full."""
        o = self.options
        position = self._built + len(self._ids)
        try:
            value = row[o.due]
            if value is None:
                raise InvalidDueTime(f"due column {o.due!r} is null")
            due_ms = _due_ms(value, self.app)
            if o.args_column is not None:
                args: Any = _as_args(row[o.args_column], o.args_column)
            else:
                args = [row[name] for name in o.args]
            if o.kwargs_column is not None:
                kwargs: Any = _as_kwargs(row[o.kwargs_column], o.kwargs_column)
            else:
                kwargs = {name: row[name] for name in o.kwargs}
            job_id = o.job_id(row)
        except KeyError as exc:
            raise ConfigurationError(f"row {position}: no column {exc.args[0]!r}") from None
        except (ValueError, TypeError) as exc:
            raise _at_row(exc, f"row {position}") from exc
        self._append(job_id, due_ms, args, kwargs)

    def add_batch(self, batch: Any) -> None:
        """Buffer the rows of a pyarrow ``RecordBatch`` (what Spark's Arrow writer gets)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        o = self.options
        n = batch.num_rows
        if n == 0:
            return
        schema = batch.schema
        due_col = batch.column(schema.get_field_index(o.due))
        if pa.types.is_timestamp(due_col.type) and due_col.type.tz is not None:
            micros = pc.cast(due_col, pa.int64()).to_pylist()
            due = [None if us is None else _micros_to_ms(us) for us in micros]
        else:  # numbers, strings, timestamps without a zone (read in the app's timezone)
            due = [None if v is None else _due_ms(v, self.app) for v in due_col.to_pylist()]
        needed = [name for name in o.columns_used() if name != o.due]
        cols = {name: batch.column(schema.get_field_index(name)).to_pylist() for name in needed}
        start = self._built + len(self._ids)
        if None in due:
            raise InvalidDueTime(f"row {start + due.index(None)}: due column {o.due!r} is null")
        args_list: list[Any]
        kwargs_list: list[Any]
        if o.args_column is not None:
            args_list = [_as_args(v, o.args_column) for v in cols[o.args_column]]
        elif o.args:
            args_list = [list(t) for t in zip(*(cols[c] for c in o.args), strict=True)]
        else:
            args_list = [None] * n
        if o.kwargs_column is not None:
            kwargs_list = [_as_kwargs(v, o.kwargs_column) for v in cols[o.kwargs_column]]
        elif o.kwargs:
            names = o.kwargs
            rows = zip(*(cols[c] for c in names), strict=True)
            kwargs_list = [dict(zip(names, t, strict=True)) for t in rows]
        else:
            kwargs_list = [None] * n
        if o.id_column is not None:
            raw = cols[o.id_column]
            if None in raw:
                raise InvalidOptions(f"row {start + raw.index(None)}: id column {o.id_column!r} is null")
            ids: list[str | None] = [v if type(v) is str else str(v) for v in raw]
        elif o.id_template is not None:
            fmt, fields = o.id_template.format_map, o.id_fields
            values = zip(*(cols[f] for f in fields), strict=True)
            ids = [fmt(dict(zip(fields, t, strict=True))) for t in values]
        else:
            ids = [None] * n
        for i in range(n):
            self._append(ids[i], due[i], args_list[i], kwargs_list[i])  # type: ignore[arg-type]

    def _append(self, job_id: str | None, due_ms: int, args: Any, kwargs: Any) -> None:
        self._ids.append(job_id)
        self._due.append(due_ms)
        self._args.append(args)
        self._kwargs.append(kwargs)
        if len(self._ids) >= self.options.batch_size:
            self.flush()

    # -- output -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Build the buffered rows' envelopes (a bad row raises here, naming it) and hand them to
        the writer thread, which stores them while the next batch is built. At most one batch is
        in flight; its error, if any, is raised by the next ``flush`` or by :meth:`close`."""
        if not self._ids:
            return
        ids, dues, args, kwargs = self._ids, self._due, self._args, self._kwargs
        self._ids, self._due, self._args, self._kwargs = [], [], [], []
        if None in ids:
            fresh = iter(new_task_ids(ids.count(None)))
            ids = [job_id if job_id is not None else next(fresh) for job_id in ids]
        final: list[str] = ids  # type: ignore[assignment]
        jobs = list(zip(final, dues, args, kwargs, strict=True))
        try:
            envelopes = build_envelopes(
                self.app, self.task, jobs, self._call, max_payload=self.config.max_payload
            )
        except (ValueError, TypeError) as exc:
            position = self._failing_row(jobs)
            where = f"row {self._built + position}" if position is not None else "a row"
            raise _at_row(exc, f"{where} (id {jobs[position or 0][0]!r})") from exc
        self._built += len(jobs)
        self._wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delayq-write")
        self._in_flight = self._pool.submit(self._store, list(zip(final, dues, envelopes, strict=True)))

    def _store(self, jobs: list[tuple[str, int, str]]) -> WriteStats:
        batch = WriteStats(rows=len(jobs))
        for status, _ in self.store.enqueue(jobs, replace=self.options.replace):
            if status is EnqueueOutcome.KEPT:
                batch.kept += 1
            elif status is EnqueueOutcome.REPLACED:
                batch.replaced += 1
            else:
                batch.stored += 1
        return batch

    def _wait(self) -> None:
        """Wait for the batch in flight; count it, or raise its error."""
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            self.stats.add(done.result())

    def _failing_row(self, jobs: list[tuple[str, int, Any, Any]]) -> int | None:
        for position, job in enumerate(jobs):
            try:
                build_envelopes(self.app, self.task, [job], self._call, max_payload=self.config.max_payload)
            except (ValueError, TypeError):
                return position
        return None

    def close(self) -> WriteStats:
        """Write what is buffered, wait until it is stored, and release the client (when this
        writer made it). Returns the figures of everything written."""
        try:
            self.flush()
            self._wait()
        finally:
            self._shutdown()
        return self.stats

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # the client is never closed under a batch in flight
            self._pool = None
        if self._own_store:
            self.store.close()

    def __enter__(self) -> JobWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._shutdown()


def _at_row(exc: Exception, where: str) -> Exception:
    """``exc`` with ``where`` in front: delayq's own errors keep their class, others become a
    plain ValueError or TypeError (a JSON decode error cannot be made with a new message)."""
    if isinstance(exc, DelayQError):
        return type(exc)(f"{where}: {exc}")
    return (TypeError if isinstance(exc, TypeError) else ValueError)(f"{where}: {exc}")


def _micros_to_ms(us: int) -> int:
    ms = round(us / 1000)
    if not 0 <= ms <= MAX_DUE_MS:
        raise InvalidDueTime(f"due time {us / 1e6!r} s since the epoch is before 1970 or past year 9999")
    return ms


def write_rows(options: Mapping[str, Any] | WriteOptions, rows: Iterable[Mapping[str, Any]]) -> WriteStats:
    """Schedule one job per row, as the Spark writer does for one partition.

    ``options`` are the data source's options (or parsed :class:`WriteOptions`);
    ``rows`` are mappings of column name to value. Returns what was stored,
    replaced and kept.
    """
    parsed = options if isinstance(options, WriteOptions) else WriteOptions.parse(options)
    with JobWriter(parsed) as writer:
        for row in rows:
            writer.add_row(row)
    return writer.stats


# -- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadOptions:
    """A validated read: the store, an optional due window (inclusive ms) and which shards."""

    store: StoreOptions
    due_from: int | None = None
    due_until: int | None = None
    include_dead: bool = True
    page_size: int = 5000
    shards: tuple[int, ...] | None = field(default=None)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> ReadOptions:
        opts = _lower(options, _STORE_OPTIONS + _READ_ONLY, "read")
        store = StoreOptions.parse(opts)
        app = store.celery_app()
        bounds: list[int | None] = []
        for name in ("duefrom", "dueuntil"):
            value = opts.get(name)
            if value is None:
                bounds.append(None)
                continue
            try:
                number: Any = float(value)
            except ValueError:
                number = value
            try:
                bounds.append(due_ms_from_eta(number, app, naive_in_zone=True))
            except InvalidDueTime as exc:
                raise ConfigurationError(f"option {_spelled(name)}: {exc}") from None
        return cls(
            store=store,
            due_from=bounds[0],
            due_until=bounds[1],
            include_dead=_flag("includedead", opts.get("includedead"), True),
            page_size=_integer("pageSize", opts.get("pagesize"), 5000, 1, 100_000),
        )

    def narrowed(self, low: int | None, high: int | None, shards: Iterable[int] | None) -> ReadOptions:
        """These options with the due window intersected with ``[low, high]`` and the shards
        limited to ``shards`` (what a pushed-down filter asks for)."""
        due_from = max(x for x in (low, self.due_from, -1) if x is not None)
        due_until = min(x for x in (high, self.due_until, MAX_DUE_MS) if x is not None)
        chosen = self.shards
        if shards is not None:
            wanted = set(shards)
            chosen = tuple(sorted(wanted if chosen is None else wanted.intersection(chosen)))
        return ReadOptions(
            self.store,
            None if due_from < 0 else due_from,
            None if due_until == MAX_DUE_MS else due_until,
            self.include_dead,
            self.page_size,
            chosen,
        )


def _json_text(value: Any) -> str | None:
    if value is None:
        return None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _row(
    job_id: str, shard: int, due_ms: int, raw: str, state: str, tries: int,
    lease_until: int | None, reason: str | None,
) -> tuple[Any, ...]:  # fmt: skip
    task: str | None = None
    queue = args = kwargs = None
    created: datetime | None = None
    try:
        envelope = decode_envelope(loaded_form(job_id, raw))
        task = envelope.task
        queue = envelope.queue
        created = ms_to_datetime(envelope.created_ms)
        args, kwargs = envelope.arguments()
        if envelope.json_body:
            args, kwargs = _json_text(args), _json_text(kwargs)
    except (ValueError, KeyError, TypeError, RecursionError):
        task = "<corrupt envelope>"
    return (
        job_id, task, ms_to_datetime(due_ms), shard, state, queue, args, kwargs, tries,
        ms_to_datetime(lease_until) if lease_until is not None else None, created, reason,
    )  # fmt: skip


def read_shard(
    store: Store, shard: int, due_from: int | None = None, due_until: int | None = None,
    include_dead: bool = True, page_size: int = 5000,
) -> Iterator[tuple[Any, ...]]:  # fmt: skip
    """The jobs of one shard due in ``[due_from, due_until]`` (ms, inclusive; None: open),
    as tuples in :data:`READ_COLUMNS` order.

    ``state`` is ``"waiting"`` (due later), ``"due"`` (due time passed, no beat has
    claimed it yet), ``"leased"`` (a beat is delivering it), ``"gated"`` (flow control holds
    it back: parked for a slot, with no ``lease_until``, or deferred by its rate until
    ``lease_until``), ``"running"`` (a released capped job whose task has not finished; its
    slot lasts until ``lease_until``) or ``"dead"``. Waiting
    and due jobs are read by score range only; leased ones (whose score is
    their lease expiry) from the shard's small leases hash, dead ones from its
    dead-letter hash. Not one snapshot: a job claimed while the shard is read
    can show up as leased, or be missed.
    """
    low = due_from if due_from is not None else 0
    high = due_until if due_until is not None else MAX_DUE_MS
    if low > high:
        return
    now_ms = int(time.time() * 1000)  # "due" or "waiting": this machine's clock will do
    seen: set[str] = set()
    for job_id, due, raw, lease in store.due_entries(shard, low, high, page_size):
        if raw is None:
            continue
        if lease:  # its score is the lease expiry: it is listed below if its due time fits
            continue
        seen.add(job_id)
        yield _row(job_id, shard, due, raw, "due" if due <= now_ms else "waiting", 0, None, None)
    leased = [  # (id, due ms, tries, state); a lease entry that does not read is left out
        (job_id, due, tries, state)
        for job_id, due, tries, state in store.leased(shard)
        if job_id not in seen and low <= due <= high
    ]
    if leased:  # their envelopes and lease expiries: one round trip
        found = store.envelopes_and_scores(shard, [job_id for job_id, _, _, _ in leased])
        for (job_id, due, tries, state), (raw, until) in zip(leased, found, strict=True):
            if raw is not None:
                # a parked job (flow control) has no lease expiry: it waits for a slot
                lease_until = None if until is None or until >= PARK_MS else until
                yield _row(job_id, shard, due, raw, state, tries, lease_until, None)
    if include_dead:
        for job_id, text in store.dead_in_shard(shard, page_size):
            try:
                record = json.loads(text)
                due = int(record["due"])
            except (ValueError, KeyError, TypeError):
                continue
            if low <= due <= high:
                yield _row(job_id, shard, due, record.get("envelope") or "", "dead",
                           int(record.get("tries") or 0), None, record.get("reason"))  # fmt: skip
