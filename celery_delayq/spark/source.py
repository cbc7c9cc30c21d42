"""The ``delayq`` Spark Python Data Source. This module imports pyspark: import
:mod:`celery_delayq.spark` instead, which loads it only when Spark asks for it. It builds
on the package's :mod:`.options`, :mod:`.writer` and :mod:`.reader` (never on the package
itself: no import cycle).

Spark pickles the source, its reader and its writer (options only) to every
executor; each partition opens its own Redis client.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from ..exceptions import ConfigurationError, DelayQError
from ..store.facade import Store
from .options import ReadOptions, WriteOptions
from .reader import READ_COLUMNS, READ_SCHEMA, read_shard
from .writer import JobWriter

__all__ = ["DelayQDataSource"]

logger = logging.getLogger(__name__)


class DelayQDataSource(DataSource):
    """``format("delayq")``: write one job per row, read the pending jobs back."""

    @classmethod
    def name(cls) -> str:
        return "delayq"

    def schema(self) -> str:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        names = tuple(schema.fieldNames())
        if names != READ_COLUMNS:
            raise ConfigurationError(
                f"delayq read: the schema is fixed ({READ_SCHEMA}); do not pass one, select columns instead"
            )
        options = ReadOptions.parse(self.options)
        _ping(options.store.config())  # a bad URL or password fails the query now, on the driver
        return _PushdownReader(options) if _pushdown_enabled() else _Reader(options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        if overwrite:
            raise ConfigurationError(
                "delayq write: mode('overwrite') would mean dropping every pending job; use "
                "mode('append') (with option replace=true to overwrite jobs that have the same id)"
            )
        options = WriteOptions.parse(self.options)
        options.check_schema({f.name: f.dataType.simpleString() for f in schema.fields})
        _ping(options.store.config())
        return _Writer(options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        """``writeStream.format("delayq")``: each micro-batch's rows as jobs, exactly once."""
        if overwrite:  # (Spark's complete output mode)
            raise ConfigurationError(
                "delayq writeStream: output mode complete would mean dropping every pending job; "
                "use outputMode('append')"
            )
        options = WriteOptions.parse(self.options, stream=True)
        options.check_schema({f.name: f.dataType.simpleString() for f in schema.fields})
        _ping(options.store.config())
        return _StreamWriter(options)


def _ping(config: Any) -> None:
    store = Store(config)
    try:
        store.ping()
    finally:
        store.close()


# -- writing ------------------------------------------------------------------------------------


@dataclass
class WriteCommit(WriterCommitMessage):
    """What one partition did."""

    rows: int
    stored: int
    replaced: int
    kept: int
    taken: int = 0


class _Writer(DataSourceArrowWriter):
    def __init__(self, options: WriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> WriteCommit:
        with JobWriter(self.options) as writer:
            for batch in iterator:
                writer.add_batch(batch)
        s = writer.stats
        return WriteCommit(s.rows, s.stored, s.replaced, s.kept, s.taken)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to do: every partition's jobs are stored when its task ends."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Jobs of partitions that finished stay stored; with ids from the rows, running the
        write again stores the rest and keeps those (see docs/spark.md)."""


# -- streaming ----------------------------------------------------------------------------------


@dataclass
class StreamCommit(WriterCommitMessage):
    """What one partition of a micro-batch did; ``skipped``: the batch was committed before."""

    query: str
    rows: int
    stored: int
    kept: int
    taken: int
    skipped: bool = False


class _StreamWriter(DataSourceStreamArrowWriter):
    """Exactly once: each row's job has an id that is the same when Spark writes the micro-batch
    again (the row's own, or ``stream:<query id>:<batch>:<partition>:<row>``), stored with a
    uniqueness window (``uniqueFor``), so a replay keeps what is waiting and does not store again
    what already ran; a batch recorded as committed (:meth:`Store.commit_stream`) is skipped."""

    def __init__(self, options: WriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> StreamCommit:
        from pyspark import TaskContext

        context = TaskContext.get()
        query = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch = context.getLocalProperty("streaming.sql.batchId") if context else None
        if context is None or query is None or batch is None:
            raise DelayQError("delayq writeStream: no streaming query or micro-batch in this task's context")
        store = Store(self.options.store.config())
        try:
            committed = store.stream_committed(query)
            if committed is not None and committed >= int(batch):
                for _ in iterator:  # Spark's input is read to its end, and not written
                    pass
                return StreamCommit(query, 0, 0, 0, 0, skipped=True)
            prefix = f"stream:{query}:{batch}:{context.partitionId()}:"
            with JobWriter(self.options, store=store, id_prefix=prefix) as writer:
                for arrow_batch in iterator:
                    writer.add_batch(arrow_batch)
            s = writer.stats
            return StreamCommit(query, s.rows, s.stored, s.kept, s.taken)
        finally:
            store.close()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Record the batch as committed for its query, for ``uniqueFor``."""
        done = [m for m in messages if isinstance(m, StreamCommit)]
        if not done:
            return  # no partition: nothing was written
        assert self.options.unique_ms is not None  # (always set on a stream: WriteOptions.parse)
        store = Store(self.options.store.config())
        try:
            store.commit_stream(done[0].query, batchId, self.options.unique_ms)
        finally:
            store.close()
        logger.info(
            "delayq stream %s: micro-batch %d committed: %s",
            done[0].query,
            batchId,
            "skipped (committed before)"
            if all(m.skipped for m in done)
            else "{} rows, {} stored, {} kept, {} taken".format(
                *(sum(getattr(m, name) for m in done) for name in ("rows", "stored", "kept", "taken"))
            ),
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Jobs of partitions that finished stay stored; Spark writes the batch again when the
        query restarts, and their ids keep them from being stored twice."""


# -- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPartition(InputPartition):
    shard: int


class _Reader(DataSourceReader):
    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> list[ShardPartition]:
        config = self.options.store.config()
        wanted = self.options.shards
        shards = range(config.shards) if wanted is None else [s for s in wanted if 0 <= s < config.shards]
        return [ShardPartition(s) for s in shards] or [ShardPartition(-1)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        shard = partition.shard if isinstance(partition, ShardPartition) else -1
        if shard < 0:
            return
        o = self.options
        store = Store(o.store.config())
        try:
            yield from read_shard(store, shard, o.due_from, o.due_until, o.include_dead, o.page_size)
        finally:
            store.close()


class _PushdownReader(_Reader):
    """Takes filters on ``due`` (a score range) and on ``shard`` (fewer partitions)."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        low: int | None = None
        high: int | None = None
        shards: set[int] | None = None
        for f in filters:
            column = getattr(f, "attribute", None)
            value = getattr(f, "value", None)
            if column == ("due",) and isinstance(value, datetime):
                us = _micros(value)
                if isinstance(f, EqualTo):
                    if us % 1000:  # no stored due time (whole ms) equals it
                        low, high = 1, 0
                        continue
                    low = _max(low, us // 1000)
                    high = _min(high, us // 1000)
                elif isinstance(f, GreaterThan):
                    low = _max(low, us // 1000 + 1)
                elif isinstance(f, GreaterThanOrEqual):
                    low = _max(low, -(-us // 1000))
                elif isinstance(f, LessThan):
                    high = _min(high, (us + 999) // 1000 - 1)
                elif isinstance(f, LessThanOrEqual):
                    high = _min(high, us // 1000)
                else:
                    yield f
                    continue
            elif column == ("shard",) and isinstance(f, EqualTo | In):
                values = (value,) if isinstance(f, EqualTo) else tuple(value or ())
                if not all(type(v) is int for v in values):
                    yield f
                    continue
                picked = set(values)
                shards = picked if shards is None else shards & picked
            else:
                yield f
        self.options = self.options.narrowed(low, high, shards)


def _micros(value: datetime) -> int:
    """Microseconds since the epoch of a filter's timestamp (naive: UTC, as Spark sends it)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    delta = value - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)


def _min(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


def _pushdown_enabled() -> bool:
    """Whether Spark will hand this reader filters.

    Spark refuses a reader that implements ``pushFilters`` unless
    ``spark.sql.python.filterPushdown.enabled`` is on, and the source cannot
    read that setting; the planning worker that calls :meth:`DelayQDataSource.reader`
    can. With pushdown on, Spark plans in ``data_source_pushdown_filters``; with
    it off, in ``plan_data_source_read`` with ``enable_pushdown`` false.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if filename.endswith("/data_source_pushdown_filters.py"):
            return True
        if filename.endswith("/plan_data_source_read.py"):
            return bool(frame.f_locals.get("enable_pushdown", False))
        frame = frame.f_back  # type: ignore[assignment]
    return False
