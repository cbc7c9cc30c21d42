"""The ground every part of the :class:`~celery_delayq.store.facade.Store` stands on:
the client, the key space, the script calls and their decoded replies, the one per-shard loop
(:meth:`StoreBase._per_shard`), the server's clock, and the job shapes kept once a shard.

A part (:mod:`.jobs`, :mod:`.delivery`, :mod:`.reads`, :mod:`.dead`, :mod:`.schedules`,
:mod:`.flow`, :mod:`.batches`, :mod:`.beats`) is a class over :class:`StoreBase`; the façade
inherits them all. A script's integer reply becomes an ``enum`` outcome or a bool through
:func:`_decode` before it leaves its part; a reply that is none of a script's codes raises
:class:`~celery_delayq.exceptions.StoreError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from ..config import DelayQConfig
from ..exceptions import StoreError, StoreFull
from .connection import REDIS_ERRORS, is_oom, make_client
from .direct import DirectCalls
from .keys import KeySpace
from .scripts import SCRIPTS, LuaScript, ScriptCall, run_pipelined, run_replicated
from .stored_forms import joined_form, loaded_form, shape_id_of

_DONE = (False, True)  # 0 nothing done, 1 done (bury, sched_del)

_Code = TypeVar("_Code")
_Item = TypeVar("_Item")


def _decode(script: str, table: Sequence[_Code], code: Any) -> _Code:
    """What ``table`` lists for ``code``, an integer reply of ``lua/<script>.lua``.

    A reply that is none of the script's codes (a script out of step with this module) raises
    :class:`StoreError` rather than being taken for another answer.

    >>> _decode("cancel", ("missing", "cancelled", "delivering"), 2)
    'delivering'
    >>> _decode("cancel", ("missing", "cancelled", "delivering"), -1)
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.StoreError: delayq cancel: unexpected reply -1 (its codes are 0 to 2)
    """
    if type(code) is int and 0 <= code < len(table):
        return table[code]
    raise StoreError(f"delayq {script}: unexpected reply {code!r} (its codes are 0 to {len(table) - 1})")


#: Seconds :meth:`Store.server_now_ms` counts from one reading of the server's ``TIME`` at most
#: (a monotonic clock drifts from the server's by well under 1 ms in that time).
SERVER_CLOCK_MAX_AGE = 60.0

#: Most shapes a process keeps read (they never change: an id names one text).
MAX_KEPT_SHAPES = 10_000


def _int_or(raw: Any, default: int = 0) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default


@contextmanager
def refused_when_full(refused: str, not_stored: Sequence[str] = ()) -> Iterator[None]:
    """Raise :class:`StoreFull` (``refused`` says what was not written; ``not_stored``, the
    jobs of the call) when Redis refuses a write inside for memory; any other error as is.

    Every producer and operator write of the store goes through this (:meth:`Store._write`, the
    pipelined cancels, the plain commands that write), so each one refused by a full Redis
    raises the same error with the same advice. A refused script call wrote nothing: Redis
    refuses a script's first write that may grow memory when it was over ``maxmemory`` at the
    script's start, and never stops a script once it has written."""
    try:
        yield
    except REDIS_ERRORS as exc:
        full = _full_error(exc, refused, not_stored)
        if full is not None:
            raise full from exc
        raise


def _full_error(exc: BaseException, refused: str, not_stored: Sequence[str]) -> StoreFull | None:
    """The :class:`StoreFull` that :func:`refused_when_full` raises for ``exc``, or None."""
    if not is_oom(exc):
        return None
    ids = list(not_stored)
    return StoreFull([], ids, list(range(len(ids))), refused)


class StoreBase:
    """What every part of the store shares: the config, the key space, the client (and its
    direct connection for single calls), the server's clock and the shapes read so far."""

    #: The setting that named the store's URL, as the configuration spells it (the store's errors
    #: name it; :func:`~.facade.get_store` sets it from the app).
    url_setting = "delayq_url"

    def __init__(
        self,
        config: DelayQConfig,
        client: Any | None = None,
        connect_timeout: float | None = None,
        socket_timeout: float | None = None,
    ) -> None:
        """The store of ``config``, through ``client`` or a client of its own
        (:func:`~celery_delayq.store.connection.make_client`, each connection attempt bounded by
        ``connect_timeout`` seconds and each reply by ``socket_timeout`` when given). A bad URL
        raises ``ValueError``.

        A Cluster client asks a node for the slot map as it is made; when no node named in the
        URL answers, the store is made all the same and its client is made again at each use
        until one answers (so a process whose startup nodes are down starts, and each call meets
        :class:`~celery_delayq.exceptions.StoreUnreachable` meanwhile)."""
        self.config = config
        self.keys = KeySpace(config.prefix, config.shards)
        self._timeouts = (connect_timeout, socket_timeout)
        self._client: Any = None
        self._direct: DirectCalls | None = None
        if client is not None:
            self.client = client
        else:
            try:
                self.client = make_client(config.url, config.cluster, connect_timeout, socket_timeout)
            except REDIS_ERRORS:
                if not config.cluster:
                    raise
        self._clock: tuple[int, float] | None = None  # (server ms, time.monotonic()) read together
        self._warned_past = False
        #: shape id -> shape (stored_forms.shared_form): an id names one text, so it is kept
        self._shapes: dict[str, str] = {}

    @property
    def client(self) -> Any:
        """The redis-py client (``Redis`` or ``RedisCluster``); a Cluster client that could not
        be made yet is made now, or this raises redis-py's error again."""
        client = self._client
        if client is None:
            self.client = client = make_client(self.config.url, self.config.cluster, *self._timeouts)
        return client

    @client.setter
    def client(self, client: Any) -> None:
        self._client = client
        self._direct = DirectCalls.for_client(client)

    @property
    def is_cluster(self) -> bool:
        if self._client is None:
            return self.config.cluster
        return isinstance(self._client, RedisCluster)

    def _write(
        self,
        script: LuaScript,
        keys: Sequence[str],
        args: Sequence[Any],
        refused: str,
        not_stored: Sequence[str] = (),
    ) -> Any:
        """Run one producer-side script (it stores or removes a job, a schedule, a batch or a
        limit); with ``delayq_wait_replicas``, only return once that many replicas have it
        (``WAIT``). Refused by a full Redis: :class:`StoreFull` (:func:`refused_when_full`, written
        out: this is every producer call's path, and the generator costs a few µs a call)."""
        try:
            if self.config.wait_replicas:
                call = ScriptCall(script, keys, args)
                return run_replicated(self.client, [call], self.config.wait_replicas)[0]
            direct = self._direct
            if direct is not None and direct.client is self.client:
                return direct.call(script, keys, args)
            return script(self.client, keys, args)
        except REDIS_ERRORS as exc:
            full = _full_error(exc, refused, not_stored)
            if full is not None:
                raise full from exc
            raise

    def _write_outcome(
        self, script: str, table: Sequence[_Code], keys: Sequence[str], args: Sequence[Any], refused: str
    ) -> _Code:
        """:meth:`_write` of ``lua/<script>.lua``, its reply decoded by ``table`` (:func:`_decode`)."""
        return _decode(script, table, self._write(SCRIPTS[script], keys, args, refused))

    def _shard_calls(
        self,
        script: str,
        items_by_shard: Mapping[int, Sequence[_Item]],
        size: int,
        args: Callable[[int, Sequence[_Item]], list[Any]],
        keys: Callable[[int], Sequence[str]] | None = None,
    ) -> tuple[list[ScriptCall], list[Sequence[_Item]]]:
        """The calls of ``lua/<script>.lua`` over the items of each shard, ``size`` items a call,
        and the chunk of items of each call: a call's ARGV is ``args(shard, chunk)``, its KEYS
        ``keys(shard)`` (default: the shard's core keys). The shards come in the order of
        ``items_by_shard``, the chunks in the order of their items. :meth:`_per_shard` runs them;
        a caller that sends other calls in the same pipeline builds them here."""
        calls: list[ScriptCall] = []
        chunks: list[Sequence[_Item]] = []
        lua = SCRIPTS[script]
        for shard, items in items_by_shard.items():
            shard_keys = self.keys.shard(shard).core if keys is None else keys(shard)
            for start in range(0, len(items), size):
                chunk = items[start : start + size]
                calls.append(ScriptCall(lua, shard_keys, args(shard, chunk)))
                chunks.append(chunk)
        return calls, chunks

    def _per_shard(
        self,
        script: str,
        items_by_shard: Mapping[int, Sequence[_Item]],
        size: int,
        args: Callable[[int, Sequence[_Item]], list[Any]],
        keys: Callable[[int], Sequence[str]] | None = None,
        raise_errors: bool = True,
        replicated: bool = False,
    ) -> list[tuple[Sequence[_Item], Any]]:
        """The one per-shard loop: the calls of :meth:`_shard_calls`, all in one pipeline
        (:func:`~.scripts.run_pipelined`; with ``replicated`` and ``delayq_wait_replicas``,
        :func:`~.scripts.run_replicated`: returning once that many replicas have them).

        Returns ``(chunk, reply)`` for each call, the shards in the order of ``items_by_shard``
        and the chunks in the order of their items, so that a caller zips each reply back onto
        its items. With ``raise_errors`` false a failed call's error is its reply."""
        calls, chunks = self._shard_calls(script, items_by_shard, size, args, keys)
        if replicated and self.config.wait_replicas:
            replies = run_replicated(self.client, calls, self.config.wait_replicas, raise_errors=raise_errors)
        else:
            replies = run_pipelined(self.client, calls, raise_errors=raise_errors)
        return list(zip(chunks, replies, strict=True))

    def _batch_keep_ms(self) -> int | str:
        """ARGV of the scripts that may complete a batch: ms it is kept (``""``: until deleted)."""
        keep = self.config.batch_expires
        return "" if keep is None else max(int(keep * 1000), 1)

    def _saw_server_time(self, server_ms: int) -> None:
        """Remember the server's ``TIME`` read now (by a script), with this process's monotonic
        clock: :meth:`server_now_ms` counts from it."""
        self._clock = (server_ms, time.monotonic())

    def server_now_ms(self) -> int:
        """The Redis server's now, in ms: the last ``TIME`` a script returned (or a ``TIME``
        command, when there is none younger than ``SERVER_CLOCK_MAX_AGE`` seconds) plus the time
        elapsed since on this process's monotonic clock, which a change of the wall clock does
        not move. What a job's envelope counts a relative expiry from, and what a schedule's
        first run is computed from; the due time of ``apply_in`` is counted by the script."""
        clock = self._clock
        if clock is None or time.monotonic() - clock[1] > SERVER_CLOCK_MAX_AGE:
            seconds, micros = self.client.time()
            clock = (int(seconds) * 1000 + int(micros) // 1000, time.monotonic())
            self._clock = clock
        return clock[0] + int((time.monotonic() - clock[1]) * 1000)

    def _loaded(self, job_id: str, stored: str) -> str:
        """The envelope of ``job_id`` from what the jobs hash keeps: its shape joined back
        (read from the shard's shapes hash the first time this process meets it: one ``HGET``)
        and its id (:func:`~.stored_forms.loaded_form`). A shape missing from the hash leaves the
        shape's id in the envelope, and decode_envelope says the shape is missing."""
        shape_id = shape_id_of(stored)
        if shape_id is not None:
            shape = self._shapes.get(shape_id)
            if shape is None:
                shape = self.client.hget(self.keys.shard(self.keys.shard_of(job_id)).shapes, shape_id)
                if shape is not None:
                    if len(self._shapes) >= MAX_KEPT_SHAPES:
                        self._shapes.clear()
                    self._shapes[shape_id] = shape
            stored = joined_form(stored, shape)
        return loaded_form(job_id, stored)

    def sweep_shapes(self) -> int:
        """Drop the shapes hash of every shard that holds no job (``lua/shapes_sweep.lua``: in one
        step, so a job stored at the same time keeps its shape); how many were dropped. The beats
        call it with the batch sweep (:meth:`sweep_batches`)."""
        calls = [
            ScriptCall(SCRIPTS["shapes_sweep"], shard.with_shapes, []) for shard in self.keys.all_shards()
        ]
        return sum(int(result) for result in run_pipelined(self.client, calls))

    def _any_exists(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` (one per shard) may exist: one ``EXISTS`` on one server; on a
        Cluster (keys of many slots), or for a user whose ACL has no ``EXISTS``, always True."""
        if self.is_cluster:
            return True
        try:
            return int(self.client.exists(*keys)) > 0
        except redis.exceptions.NoPermissionError:
            return True
