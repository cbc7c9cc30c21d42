"""The one :class:`Store`: one app's shards in one Redis deployment, and the one door to Redis.

The store's methods live in its parts, one module a seam, each a class over
:class:`~.base.StoreBase` (the client, the key space, the script calls, the per-shard loop):

- :mod:`.jobs`: enqueue, get, cancel, reschedule;
- :mod:`.delivery`: claim, push, ack, renew, push_claimed, bury, the push path's templates;
- :mod:`.reads`: counts, scans, id search, shard stats, the overview;
- :mod:`.dead`: dead letters;
- :mod:`.schedules`: the stored schedules and firing their points;
- :mod:`.flow`: gate keys and slots; :mod:`.batches`: batches;
- :mod:`.beats`: heartbeats, lateness, the wake channel, the server checks;
- :mod:`.streams`: what each Spark streaming query committed to the sink.

:class:`Store` inherits them all, so every caller writes ``store.method(...)`` whatever part
holds the method. No other module of the package holds a Redis client or runs a script
(``tests/test_layers.py`` checks it). Building a client and classifying Redis errors live in
:mod:`celery_delayq.store.connection`.

Being the one door, it is where a store that cannot be reached becomes our error: every public
method of :class:`Store` (and every item of an iterator one returns) raises
:class:`~celery_delayq.exceptions.StoreUnreachable` or
:class:`~celery_delayq.exceptions.StoreRefused` in place of redis-py's error, which is kept as its
``__cause__`` (:func:`~.connection.store_error`). Every other error passes as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from types import FunctionType, GeneratorType
from typing import Any

from ..config import DelayQConfig, extension, setting_name
from .base import StoreBase
from .batches import BatchesPart
from .beats import BeatsPart
from .connection import REDIS_ERRORS, store_error
from .dead import DeadPart
from .delivery import DeliveryPart
from .flow import FlowPart
from .jobs import JobsPart
from .reads import ReadsPart
from .schedules import SchedulesPart
from .streams import StreamsPart

__all__ = ["Store", "get_store"]


class Store(
    JobsPart, DeliveryPart, ReadsPart, DeadPart, SchedulesPart, FlowPart, BatchesPart, BeatsPart, StreamsPart
):
    """One app's shards in one Redis deployment."""


def _translated_items(store: StoreBase, items: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from items
    except REDIS_ERRORS as exc:
        error = store_error(exc, store.config.url, store.url_setting)
        if error is None:
            raise
        raise error from exc


def _translated(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` raising the store's errors in place of redis-py's (see the module docstring)."""

    @functools.wraps(method)
    def call(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        try:
            result = method(self, *args, **kwargs)
        except REDIS_ERRORS as exc:
            error = store_error(exc, self.config.url, self.url_setting)
            if error is None:
                raise
            raise error from exc
        if type(result) is GeneratorType:
            return _translated_items(self, result)
        return result

    return call


def _translate_errors(cls: type) -> None:
    """Wrap every public method ``cls`` has (its own and its parts') in :func:`_translated`."""
    names = {
        name
        for base in cls.__mro__
        for name, value in vars(base).items()
        if not name.startswith("_") and type(value) is FunctionType
    }
    for name in sorted(names):
        if type(getattr(cls, name)) is FunctionType:  # (not a staticmethod's function)
            setattr(cls, name, _translated(getattr(cls, name)))


_translate_errors(Store)


def get_store(app: Any, connect_timeout: float | None = None) -> Store:
    """The app's :class:`Store` (one per app and process, kept by the app's extension,
    :func:`~celery_delayq.config.extension`; redis-py pools are fork-safe).
    ``connect_timeout`` applies when this call makes it (the CLI's)."""
    ext = extension(app)
    store: Store | None = ext.parts.get("store")
    if store is None:
        store = ext.part("store", lambda: _made(app, connect_timeout))
    return store


def _made(app: Any, connect_timeout: float | None) -> Store:
    store = Store(DelayQConfig.from_app(app), connect_timeout=connect_timeout)
    store.url_setting = setting_name(app, "delayq_url")
    return store
