"""Rows as jobs: the plain-Python writer that every Spark partition of a ``delayq`` write
runs, usable without Spark too (:func:`write_rows`).

Every job written is exactly what ``task.apply_at(due, args, kwargs, **options)``
would store for it (the same envelope builder), so beats and workers cannot
tell the two apart. With an id column or template the write is idempotent: a
job whose id is still pending is kept as it is (``replace=true`` overwrites it),
so running the same write twice leaves the same set of pending jobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ..due import MAX_DUE_MS, due_ms_from_eta
from ..exceptions import ConfigurationError, DelayQError, InvalidDueTime, InvalidOptions
from ..producer.build import build_envelopes, new_task_ids
from ..store.facade import Store
from ..store.jobs import EnqueueOutcome
from .options import WriteOptions

__all__ = ["JobWriter", "WriteStats", "write_rows"]


@dataclass
class WriteStats:
    """What a write did: rows read, jobs stored new, replaced, kept (an id already pending), and
    taken (``uniqueFor``: an id stored within its window whose job is gone: not stored again)."""

    rows: int = 0
    stored: int = 0
    replaced: int = 0
    kept: int = 0
    taken: int = 0

    def add(self, other: WriteStats) -> None:
        self.rows += other.rows
        self.stored += other.stored
        self.replaced += other.replaced
        self.kept += other.kept
        self.taken += other.taken


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

    def __init__(
        self, options: WriteOptions, store: Store | None = None, id_prefix: str | None = None
    ) -> None:
        self.options = options
        #: A row without an id gets ``<id_prefix><its row number>`` (the streaming sink's place
        #: in the stream), else a new uuid.
        self.id_prefix = id_prefix
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
        start = self._built + len(self._ids)
        due_col = _column(batch, o.due)
        if pa.types.is_timestamp(due_col.type) and due_col.type.tz is not None:
            micros = pc.cast(due_col, pa.int64()).to_pylist()
            due = _each(micros, lambda us: None if us is None else _micros_to_ms(us), start)
        else:  # numbers, strings, timestamps without a zone (read in the app's timezone)
            due = _each(due_col.to_pylist(), lambda v: None if v is None else _due_ms(v, self.app), start)
        # The due column is read again here when it is also an argument or an id field: the task
        # gets its value as the row has it (a timestamp as a datetime, as any timestamp column).
        cols = {name: _column(batch, name).to_pylist() for name in o.row_columns()}
        if None in due:
            raise InvalidDueTime(f"row {start + due.index(None)}: due column {o.due!r} is null")
        args_list: list[Any]
        kwargs_list: list[Any]
        if o.args_column is not None:
            args_column = o.args_column
            args_list = _each(cols[args_column], lambda v: _as_args(v, args_column), start)
        elif o.args:
            args_list = [list(t) for t in zip(*(cols[c] for c in o.args), strict=True)]
        else:
            args_list = [None] * n
        if o.kwargs_column is not None:
            kwargs_column = o.kwargs_column
            kwargs_list = _each(cols[kwargs_column], lambda v: _as_kwargs(v, kwargs_column), start)
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
            fields = o.id_fields
            values = [dict(zip(fields, t, strict=True)) for t in zip(*(cols[f] for f in fields), strict=True)]
            ids = _each(values, o.template_id, start)
        else:
            ids = [None] * n
        for i in range(n):
            self._append(ids[i], due[i], args_list[i], kwargs_list[i])

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
        if None in ids and self.id_prefix is not None:
            prefix, first = self.id_prefix, self._built
            ids = [job_id if job_id is not None else f"{prefix}{first + i}" for i, job_id in enumerate(ids)]
        elif None in ids:
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
        o = self.options
        for status, _ in self.store.enqueue(jobs, replace=o.replace, unique_ms=o.unique_ms):
            if status is EnqueueOutcome.KEPT:
                batch.kept += 1
            elif status is EnqueueOutcome.TAKEN:
                batch.taken += 1
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


def _column(batch: Any, name: str) -> Any:
    """The column ``name`` of an Arrow batch (Spark's schema was checked on the driver; a batch
    handed to :meth:`JobWriter.add_batch` by hand is checked here)."""
    index = batch.schema.get_field_index(name)
    if index < 0:
        raise ConfigurationError(
            f"delayq write: no column {name!r} in the batch (its columns: {', '.join(batch.schema.names)})"
        )
    return batch.column(index)


def _each(values: list[Any], convert: Callable[[Any], Any], start: int) -> list[Any]:
    """``convert`` of every value; a value it refuses raises its error naming the row
    (``start`` is the first value's row number)."""
    try:
        return [convert(v) for v in values]
    except (ValueError, TypeError):
        for position, value in enumerate(values):
            try:
                convert(value)
            except (ValueError, TypeError) as exc:
                raise _at_row(exc, f"row {start + position}") from exc
        raise


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
