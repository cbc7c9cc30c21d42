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
"""

from __future__ import annotations

from typing import Any

from ..config import DelayQConfig, extension
from .batches import BatchesPart
from .beats import BeatsPart
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


def get_store(app: Any, connect_timeout: float | None = None) -> Store:
    """The app's :class:`Store` (one per app and process, kept by the app's extension,
    :func:`~celery_delayq.config.extension`; redis-py pools are fork-safe).
    ``connect_timeout`` applies when this call makes it (the CLI's)."""
    ext = extension(app)
    store: Store | None = ext.parts.get("store")
    if store is None:
        store = ext.part("store", lambda: Store(DelayQConfig.from_app(app), connect_timeout=connect_timeout))
    return store
