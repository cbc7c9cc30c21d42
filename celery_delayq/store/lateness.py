"""Lateness histograms kept in Redis: cheap to record, bounded in size, readable by anyone.

Three histograms per key prefix, each one Redis hash (a single key, no shard tag):

- ``<prefix>:lateness:publish``: due time -> the beat published the message (every beat); a
  job flow control held back counts from when flow control let it go (a batch's completion
  job: from when its batch finished; a parked or deferred gated job: from its release), so the
  figure is what the beats control;
- ``<prefix>:lateness:start``: due time -> a worker started the task (workers with
  ``delayq_record_lateness`` on; the due time travels in the message's ``delayq_due`` header);
- ``<prefix>:lateness:gated``: how long jobs were held back by flow control (gated), due time
  -> let go: a batch's completion job until its batch finished, a gated job parked for a slot,
  paused or deferred by a rate until it was released (every beat).

Fields: ``le:<bound ms>`` for each bound of :data:`BOUNDS` and ``le:inf``, each the number
of observations at most that bound and above the previous one (not cumulative), plus
``count`` and ``sum_ms``. A :class:`Histogram` adds observations in memory and
:meth:`Histogram.flush` sends them as one pipeline of ``HINCRBY``/``HINCRBYFLOAT``, so a
recorder costs one round trip per flush, whatever the rate; the hash never holds more than
``len(BOUNDS) + 3`` fields.

Each flush also adds the same counts, in the same pipeline, to the hash of the current minute
(Redis server clock), ``<key>:m:<epoch minute>`` (:func:`minute_key`), which expires an hour
after its minute ends: :func:`read_window` sums the last :data:`WINDOW_MINUTES` of them, the
lateness "of the last hour" (the dashboard's overview). At most ``WINDOW_MINUTES + 1`` such
hashes exist per kind, each as small as the cumulative one.

>>> h = Histogram()
>>> for ms in (0.4, 3, 3, 70, 12_000):
...     h.observe(ms)
>>> h.pending["le:1"], h.pending["le:5"], h.pending["le:100"], h.pending["le:30000"]
(1, 2, 1, 1)
>>> snap = Snapshot.from_fields({k: str(v) for k, v in h.pending.items()})
>>> snap.count, snap.quantile(0.5), snap.quantile(0.99)
(5, 5.0, 30000.0)
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..exceptions import InvalidInput
from .connection import error_text

__all__ = [
    "BOUNDS",
    "OPEN_MINUTES",
    "WINDOW_MINUTES",
    "Histogram",
    "LatenessStore",
    "PublishLateness",
    "Snapshot",
    "WindowReader",
    "key_for",
    "minute_key",
    "minute_ttl_ms",
    "read",
    "read_window",
    "tally",
]

logger = logging.getLogger(__name__)

#: Seconds between two flushes of a beat's due -> publish lateness (at most; only when
#: something was published).
LATENESS_FLUSH_EVERY = 2.0


class LatenessStore(Protocol):
    """Where histograms are kept (:class:`.facade.Store`)."""

    def add_lateness(self, key: str, fields: Mapping[str, float], minute: int | None = None) -> None: ...

    def lateness_fields(self, key: str) -> dict[str, Any]: ...

    def lateness_minutes(self, key: str, minutes: Iterable[int]) -> list[dict[str, Any]]: ...

    def server_now_ms(self) -> int: ...


#: Upper bounds of the buckets, in ms (the last bucket, ``le:inf``, takes the rest).
BOUNDS: tuple[float, ...] = (
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000,
)  # fmt: skip
_FIELDS = (*(f"le:{b:g}" for b in BOUNDS), "le:inf")
KINDS = ("publish", "start", "gated")


def key_for(prefix: str, kind: str) -> str:
    """The hash holding ``kind`` (``"publish"``, ``"start"`` or ``"gated"``) lateness of ``prefix``.

    >>> key_for("delayq", "start")
    'delayq:lateness:start'
    """
    if kind not in KINDS:
        raise InvalidInput(f"lateness kind must be one of {KINDS}, got {kind!r}")
    return f"{prefix}:lateness:{kind}"


#: Minutes the windowed record covers: the lateness "of the last hour".
WINDOW_MINUTES = 60
MINUTE_MS = 60_000


def minute_key(key: str, minute: int) -> str:
    """The hash holding what was added to the histogram ``key`` during epoch minute ``minute``
    (``server ms // 60000``).

    >>> minute_key("delayq:lateness:start", 29_000_000)
    'delayq:lateness:start:m:29000000'
    """
    return f"{key}:m:{int(minute)}"


def minute_ttl_ms(minute: int, now_ms: int) -> int:
    """How long the hash of ``minute`` is kept, from ``now_ms``: until :data:`WINDOW_MINUTES`
    after its minute ends (<= 0: it is older than any window read, write nothing). So at most
    ``WINDOW_MINUTES + 1`` minute hashes of a histogram exist at any time.

    >>> minute_ttl_ms(10, 10 * 60_000 + 30_000) == 60 * 60_000 + 30_000
    True
    >>> minute_ttl_ms(10, 71 * 60_000)
    0
    """
    return (int(minute) + WINDOW_MINUTES + 1) * MINUTE_MS - int(now_ms)


def tally(values_ms: Iterable[float], counts: Iterable[int] | None = None) -> dict[str, float]:
    """The fields that observing each of ``values_ms`` adds (bucket each value once, then add
    the result to several histograms with :meth:`Histogram.add`); with ``counts``, each value
    observed that many times (``lua/push.lua`` gives the lateness of what it pushed as (ms,
    count) pairs: bucketed once a pair, not once a job).

    >>> tally([0.4, 3, 3, -2]) == {"le:1": 2, "le:5": 2, "count": 4, "sum_ms": 6.4}
    True
    >>> tally([0.4, 3, -2], [1, 2, 1]) == tally([0.4, 3, 3, -2])
    True
    """
    out: dict[str, float] = {}
    fields, bounds, find = _FIELDS, BOUNDS, bisect.bisect_left
    total = 0.0
    n = 0
    weights = itertools.repeat(1) if counts is None else counts
    for ms, k in zip(values_ms, weights, strict=False):  # (repeat(1) has no end)
        if ms < 0:
            ms = 0.0
        name = fields[find(bounds, ms)]
        out[name] = out.get(name, 0) + k
        total += ms * k
        n += k
    if n:
        out["count"] = n
        out["sum_ms"] = total
    return out


@dataclass
class Histogram:
    """Observations not yet sent to Redis. Thread-safe: a worker's pool threads share one."""

    pending: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, ms: float) -> None:
        """Count one lateness of ``ms`` (a job started early counts as 0)."""
        ms = max(0.0, ms)
        name = _FIELDS[bisect.bisect_left(BOUNDS, ms)]
        with self._lock:
            pending = self.pending
            pending[name] = pending.get(name, 0) + 1
            pending["count"] = pending.get("count", 0) + 1
            pending["sum_ms"] = pending.get("sum_ms", 0.0) + ms

    def add(self, fields: Mapping[str, float]) -> None:
        """Add field increments (from :func:`tally`, or another histogram's ``pending``)."""
        if not fields:
            return
        with self._lock:
            pending = self.pending
            for name, value in fields.items():
                pending[name] = pending.get(name, 0) + value

    def snapshot(self) -> Snapshot:
        """What this histogram holds now (not yet flushed), as a :class:`Snapshot`.

        >>> h = Histogram()
        >>> h.add(tally([3, 700]))
        >>> h.snapshot().cumulative()[2:4], h.snapshot().count
        ([(5.0, 1), (10.0, 1)], 2)
        """
        with self._lock:
            fields = dict(self.pending)
        return Snapshot.from_fields(fields)

    def flush(self, store: LatenessStore, key: str) -> int:
        """Add what was observed to ``key`` in one pipeline; returns how many observations.

        On an error the observations are put back (counted at the next flush)."""
        with self._lock:
            pending, self.pending = self.pending, {}
        if not pending:
            return 0
        try:
            store.add_lateness(key, pending)
        except Exception:
            with self._lock:
                for name, value in pending.items():
                    self.pending[name] = self.pending.get(name, 0) + value
            raise
        return int(pending.get("count", 0))


@dataclass(frozen=True)
class Snapshot:
    """A histogram as read from Redis."""

    buckets: tuple[int, ...]  # one count per bound of BOUNDS, then the +inf bucket
    count: int
    sum_ms: float

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Snapshot:
        buckets = tuple(int(float(fields.get(name, 0) or 0)) for name in _FIELDS)
        return cls(buckets, int(float(fields.get("count", 0) or 0)), float(fields.get("sum_ms", 0) or 0))

    @property
    def mean_ms(self) -> float | None:
        return self.sum_ms / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (``inf`` past the last
        bound), or None when empty: a histogram says "at most", not the exact value."""
        total = sum(self.buckets)
        if not total:
            return None
        rank = q * total
        seen = 0
        for bound, n in zip((*BOUNDS, float("inf")), self.buckets, strict=True):
            seen += n
            if seen >= rank and n:
                return float(bound)
        return float("inf")

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound ms, observations <= it)`` for each bucket, as Prometheus wants them."""
        out: list[tuple[float, int]] = []
        seen = 0
        for bound, n in zip((*BOUNDS, float("inf")), self.buckets, strict=True):
            seen += n
            out.append((float(bound), seen))
        return out


def read(store: LatenessStore, prefix: str, kind: str) -> Snapshot:
    """The ``kind`` histogram of ``prefix`` as it is in Redis now."""
    return Snapshot.from_fields(store.lateness_fields(key_for(prefix, kind)))


def read_window(
    store: LatenessStore, prefix: str, kind: str, minutes: int = WINDOW_MINUTES, now_ms: int | None = None
) -> Snapshot:
    """The ``kind`` histogram of ``prefix`` over the last ``minutes`` minutes (the current one,
    partly gone, and the ``minutes - 1`` before; Redis server clock): the minute hashes summed,
    read in one pipeline."""
    last = _last_minute(store, minutes, now_ms)
    return _summed(store.lateness_minutes(key_for(prefix, kind), range(last - minutes + 1, last + 1)))


def _last_minute(store: LatenessStore, minutes: int, now_ms: int | None) -> int:
    if not 1 <= minutes <= WINDOW_MINUTES:
        raise InvalidInput(f"lateness window: minutes must be 1..{WINDOW_MINUTES}, got {minutes!r}")
    now = store.server_now_ms() if now_ms is None else int(now_ms)
    return now // MINUTE_MS


def _summed(minute_fields: Iterable[Mapping[str, Any]]) -> Snapshot:
    total: dict[str, float] = {}
    for fields in minute_fields:
        for name, value in fields.items():
            try:
                total[name] = total.get(name, 0.0) + float(value)
            except (TypeError, ValueError):
                continue  # not a number: not written by a recorder, skipped
    return Snapshot.from_fields(total)


#: Minutes of the window read again at every :meth:`WindowReader.read_window`: the current
#: one and the one before (a recorder's minute is its own estimate of the server's clock, which
#: may lag the server by a little). The older ones no longer change.
OPEN_MINUTES = 2


class WindowReader:
    """:func:`read_window` for a reader that asks again and again (the dashboard, at each
    refresh): the hashes of the minutes that ended more than a minute ago are read once and
    kept, and only the last :data:`OPEN_MINUTES` are read again, so a read of the last hour
    costs 2 ``HGETALL`` a kind, not 60, and the sums are the same.

    Recorders only add to the minute of their server clock (:meth:`Histogram.flush`): a count
    added by hand to an older minute (``Store.add_lateness(minute=...)``) is seen by a new
    reader, not by one that had already kept that minute.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int], Mapping[str, Any]] = {}
        self._lock = threading.Lock()

    def read_window(
        self,
        store: LatenessStore,
        prefix: str,
        kind: str,
        minutes: int = WINDOW_MINUTES,
        now_ms: int | None = None,
    ) -> Snapshot:
        key = key_for(prefix, kind)
        last = _last_minute(store, minutes, now_ms)
        window = range(last - minutes + 1, last + 1)
        with self._lock:
            kept = {m: self._kept[(key, m)] for m in window if (key, m) in self._kept}
        wanted = [m for m in window if m not in kept]
        read = dict(zip(wanted, store.lateness_minutes(key, wanted), strict=True)) if wanted else {}
        with self._lock:
            oldest = last - WINDOW_MINUTES
            for stale in [k for k in self._kept if k[1] <= oldest]:
                del self._kept[stale]
            for minute, fields in read.items():
                if minute <= last - OPEN_MINUTES:
                    self._kept[(key, minute)] = fields
        return _summed(kept[m] if m in kept else read[m] for m in window)


class PublishLateness:
    """A beat's record of due -> publish lateness and of the time gated jobs were held back:
    what is not yet flushed to ``<prefix>:lateness:publish`` and ``<prefix>:lateness:gated``
    (at most every ``LATENESS_FLUSH_EVERY`` s, only when something was published), and
    everything since the start (for its metrics)."""

    def __init__(
        self, store: LatenessStore, prefix: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.key = key_for(prefix, "publish")
        self.gated_key = key_for(prefix, "gated")
        self.clock = clock
        self.pending = Histogram()
        self.seen = Histogram()
        #: held-back time (ms) of gated jobs and completion jobs: not yet flushed, since the start
        self.gated_pending = Histogram()
        self.gated_seen = Histogram()
        self.flushed_at = clock()
        self._failing = False

    def record(self, lateness_ms: Iterable[float], counts: Iterable[int] | None = None) -> None:
        """Count published jobs (bucketed once here, :func:`tally`; sent by :meth:`flush`)."""
        observed = tally(lateness_ms, counts)
        self.pending.add(observed)
        self.seen.add(observed)

    def record_gated(self, held_ms: Iterable[float]) -> None:
        """Count how long published jobs were held back by flow control (``gated``)."""
        observed = tally(held_ms)
        self.gated_pending.add(observed)
        self.gated_seen.add(observed)

    def _waiting(self) -> bool:
        return bool(self.pending.pending or self.gated_pending.pending)

    def due_at(self) -> float:
        """Clock time of the next flush (infinity while nothing waits)."""
        return self.flushed_at + LATENESS_FLUSH_EVERY if self._waiting() else float("inf")

    def _flush_all(self) -> None:
        self.pending.flush(self.store, self.key)
        self.gated_pending.flush(self.store, self.gated_key)

    def flush(self, force: bool = False) -> None:
        """Flush when due (or ``force``). Never raises: on a Redis error the counts are kept
        for the next flush, and one warning is logged until one works."""
        now = self.clock()
        if not self._waiting() or not (force or now - self.flushed_at >= LATENESS_FLUSH_EVERY):
            return
        self.flushed_at = now
        try:
            self._flush_all()
        except Exception as exc:
            if not self._failing:
                logger.warning(
                    "delayq: cannot write the lateness histogram to Redis (%s); the counts are "
                    "kept and written at the next try",
                    error_text(exc),
                )
            self._failing = True
        else:
            self._failing = False

    def last_flush(self) -> None:
        """The beat stops: write what is left (never raises)."""
        if self._waiting():
            try:
                self._flush_all()
            except Exception as exc:
                logger.warning(
                    "delayq: lateness of the last %.0f s not written: %s",
                    LATENESS_FLUSH_EVERY,
                    error_text(exc),
                )
