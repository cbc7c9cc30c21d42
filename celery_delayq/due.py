"""Due times: what a caller gives as ``eta``, ``countdown``-like delay or ``expires``, read
as milliseconds since the epoch (UTC), and those milliseconds written back as datetimes.

Owns the rules for naive datetimes (Celery's UTC rule for an intercepted ``apply_async``;
the app's timezone for the command line and Spark), the accepted range (1970 to the end
of year 9999) and the ``eta`` header text of a due time.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from .exceptions import InvalidDueTime

__all__ = [
    "MAX_DUE_MS",
    "celery_expires",
    "celery_naive_as_utc",
    "due_iso",
    "due_ms_from_delay",
    "due_ms_from_eta",
    "local_now_ms",
    "ms_to_datetime",
]

# The latest due time accepted: the last millisecond of year 9999 (datetime's limit).
MAX_DUE_MS = 253_402_300_799_999


def local_now_ms() -> int:
    """Milliseconds since the epoch, by this machine's clock."""
    return int(time.time() * 1000)


def ms_to_datetime(ms: float) -> datetime:
    """UTC-aware datetime of ``ms`` milliseconds since the epoch.

    Exact to the millisecond at any date (a float of seconds is not, far from now):

    >>> ms_to_datetime(1_700_000_000_000).isoformat()
    '2023-11-14T22:13:20+00:00'
    >>> ms_to_datetime(74_195_825_955_087).isoformat()
    '4321-03-04T23:39:15.087000+00:00'
    """
    return _EPOCH + timedelta(milliseconds=ms)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def due_iso(due_ms: int) -> str:
    """The ``eta`` header of a job due at ``due_ms`` (``delayq_publish_eta``): the UTC time,
    exact to the millisecond, as Celery's ``as_task_v2`` writes an aware ``eta``
    (``datetime.isoformat()``, so no fraction when it is a whole second).

    >>> due_iso(1_700_000_000_123), due_iso(1_700_000_000_000)
    ('2023-11-14T22:13:20.123000+00:00', '2023-11-14T22:13:20+00:00')
    """
    return (_EPOCH + timedelta(milliseconds=due_ms)).isoformat()


def _check_ms(ms: float, what: str) -> int:
    if not math.isfinite(ms):
        raise InvalidDueTime(f"{what} must be finite, got {ms / 1000.0!r}")
    if ms < 0:
        raise InvalidDueTime(f"{what} must not be before 1970-01-01T00:00:00Z, got {ms / 1000.0!r} s")
    if ms > MAX_DUE_MS:
        raise InvalidDueTime(f"{what} is past year 9999: {ms / 1000.0!r} s since the epoch")
    return round(ms)


def celery_naive_as_utc(value: Any) -> Any:
    """``value`` (an ``eta`` or ``expires`` given to ``apply_async``) as Celery reads it.

    Celery's worker reads a naive datetime, or an ISO-8601 string without an
    offset, as UTC, whatever ``timezone`` and ``enable_utc`` say
    (``maybe_make_aware(..., naive_as_utc=True)`` in ``celery.worker.request``;
    the same in Celery 5.4 to 5.7). Such a value comes back aware, in UTC;
    anything else comes back as it is.

    >>> celery_naive_as_utc(datetime(2030, 1, 1, 9)).isoformat()
    '2030-01-01T09:00:00+00:00'
    >>> celery_naive_as_utc("2030-01-01T09:00:00").isoformat()
    '2030-01-01T09:00:00+00:00'
    >>> celery_naive_as_utc("2030-01-01T09:00:00+01:00")
    '2030-01-01T09:00:00+01:00'
    """
    parsed = value
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return value  # due_ms_from_eta says what is wrong with it
    if isinstance(parsed, datetime) and (parsed.tzinfo is None or parsed.utcoffset() is None):
        return parsed.replace(tzinfo=UTC)
    return value


def celery_expires(value: Any, now: datetime | None = None) -> Any:
    """An ``expires`` given to an intercepted ``apply_async``, as Celery reads it.

    Celery counts a number of seconds from the call, not from the due time
    (``as_task_v2``), so a task due in an hour with ``expires=600`` expires
    before it is due; it comes back as that absolute, aware time. A naive
    datetime (or ISO string) is UTC (:func:`celery_naive_as_utc`). Anything
    else comes back as it is, for :func:`build_envelopes` to check.

    >>> celery_expires(600, now=datetime(2030, 1, 1, tzinfo=UTC)).isoformat()
    '2030-01-01T00:10:00+00:00'
    >>> celery_expires(None) is None
    True
    """
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < 1e10
    ):
        return (now or datetime.now(UTC)) + timedelta(seconds=value)
    return celery_naive_as_utc(value)


def due_ms_from_eta(eta: Any, app: Any, *, naive_in_zone: bool = False) -> int:
    """Milliseconds since the epoch for a due time.

    ``eta`` is an aware ``datetime``, a UNIX timestamp in seconds (int or
    float), or an ISO-8601 string. A naive datetime (or string without an
    offset) is read:

    * with ``naive_in_zone=True`` (the command line, Spark): in the app's timezone
      (``app.conf.timezone``; UTC when unset and ``enable_utc`` is on, the
      default). When ``enable_utc`` is off and no ``timezone`` is set, it could
      only mean this machine's local time: refused.
    * by default (``apply_at``, ``celery_delayq.apply_at`` and the :class:`~celery_delayq.DelayQ` API): as
      UTC, Celery's rule for a naive ``eta``, when the app's timezone is UTC
      (where every reading agrees); refused otherwise, since there the app's
      zone and Celery's rule name different instants.

    An intercepted ``apply_async(eta=...)`` first makes a naive value aware
    by Celery's rule (:func:`celery_naive_as_utc`).

    >>> from celery import Celery
    >>> due_ms_from_eta(1_700_000_000.5, Celery())
    1700000000500
    >>> due_ms_from_eta(datetime(2030, 1, 1), Celery())  # naive: UTC by default
    1893456000000
    """
    if isinstance(eta, bool):
        raise InvalidDueTime(f"eta must be a datetime or a UNIX timestamp, got {eta!r}")
    if isinstance(eta, int | float):
        try:
            seconds = float(eta)
        except OverflowError as exc:
            raise InvalidDueTime(f"eta is out of range: {eta!r}") from exc
        return _check_ms(seconds * 1000.0, "eta")
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError as exc:
            raise InvalidDueTime(f"eta string is not ISO-8601: {eta!r}") from exc
    if not isinstance(eta, datetime):
        raise InvalidDueTime(
            f"eta must be an aware datetime or a UNIX timestamp in seconds, got {type(eta).__name__}"
        )
    if eta.tzinfo is None or eta.tzinfo.utcoffset(eta) is None:
        eta = eta.replace(tzinfo=_naive_zone(eta, app, naive_in_zone))
    try:
        seconds = eta.timestamp()
    except (OverflowError, ValueError, OSError) as exc:
        raise InvalidDueTime(f"eta {eta!r} is out of range") from exc
    return _check_ms(seconds * 1000.0, "eta")


def _naive_zone(eta: datetime, app: Any, in_zone: bool) -> Any:
    """The zone a naive ``eta`` is read in (see :func:`due_ms_from_eta`), or InvalidDueTime."""
    conf = app.conf
    if in_zone:
        if not conf.timezone and not conf.enable_utc:
            raise InvalidDueTime(
                f"naive datetime {eta.isoformat()} refused: enable_utc is off and no timezone is "
                "set, so it could only mean this machine's local time; pass an aware datetime "
                "or set app.conf.timezone"
            )
        return app.timezone
    if app.uses_utc_timezone() if conf.timezone else conf.enable_utc:
        return UTC  # (the local zone is refused even on a machine in UTC: the same code elsewhere is not)
    zone = conf.timezone or "this machine's local time (enable_utc is off, no timezone set)"
    raise InvalidDueTime(
        f"naive datetime {eta.isoformat()} refused: Celery reads a naive eta as UTC, but this "
        f"app's timezone is {zone}, so it is ambiguous; pass an aware datetime "
        "(tzinfo=ZoneInfo(...) or timezone.utc) or a UNIX timestamp"
    )


def due_ms_from_delay(delay: Any, now_ms: int | None = None) -> int:
    """Milliseconds since the epoch for an ``apply_in`` delay (seconds or timedelta).

    >>> due_ms_from_delay(1.5, now_ms=1000)
    2500
    """
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError as exc:
            raise InvalidDueTime(f"delay is out of range: {delay!r}") from exc
    else:
        raise InvalidDueTime(f"delay must be seconds or a timedelta, got {type(delay).__name__}")
    if not math.isfinite(seconds):
        raise InvalidDueTime(f"delay must be finite, got {seconds!r}")
    if seconds < 0:
        raise InvalidDueTime(f"delay must not be negative, got {seconds!r} s")
    base = local_now_ms() if now_ms is None else now_ms
    return _check_ms(base + seconds * 1000.0, "now + delay")
