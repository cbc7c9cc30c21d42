"""Times and durations as a person types them on the command line (no click, no Redis).

Times are ISO-8601 (a naive one is read in the app's timezone: a person at a terminal types
wall-clock times; ``apply_at`` instead reads a naive time as UTC as Celery does, and refuses
one where the app's zone is not UTC), UNIX seconds, ``now``, or relative to now:

>>> parse_when("+1h30m", app=None, now_ms=0), parse_when("-90s", app=None, now_ms=100_000)
(5400000, 10000)
>>> parse_duration("1h30m"), parse_duration("250ms"), parse_duration("45")
(5400000, 250, 45000)
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from ..due import due_ms_from_eta
from ..exceptions import InvalidInput, ScheduleError

__all__ = ["parse_duration", "parse_when"]

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> int:
    """Milliseconds of ``30s``, ``5m``, ``1h30m``, ``2d``, ``250ms``, ``1.5h`` or plain seconds.

    >>> parse_duration("2d"), parse_duration("1.5h")
    (172800000, 5400000)
    """
    spec = text.strip().lower().replace(" ", "")
    if not spec:
        raise InvalidInput("empty duration")
    try:
        seconds = float(spec)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise InvalidInput(f"duration must be finite, got {text!r}")
        return round(seconds * 1000)
    pos, total = 0, 0.0
    for match in _PART.finditer(spec):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS_MS[match.group(2)]
        pos = match.end()
    if pos != len(spec) or pos == 0:
        raise InvalidInput(f"bad duration {text!r}: use e.g. 30s, 5m, 1h30m, 2d, 250ms")
    return round(total)


def is_relative(text: str) -> bool:
    """Whether ``text`` counts from now (``now``, ``+10m``, ``-1h``).

    >>> is_relative(" now"), is_relative("+5m"), is_relative("2026-12-01")
    (True, True, False)
    """
    spec = text.strip()
    return spec.lower() == "now" or spec[:1] in ("+", "-")


def parse_when(text: str, app: Any, now_ms: int | None = None) -> int:
    """Milliseconds since the epoch of a time given on the command line: ``now``; ``+10m`` /
    ``-1h`` (relative to now, units as :func:`parse_duration`); UNIX seconds; or ISO-8601
    (naive: in the app's timezone, unlike ``apply_at``, which reads it as UTC as Celery does).
    ``ValueError`` says what is wrong.

    >>> from celery import Celery
    >>> parse_when("2026-12-01T09:00:00+01:00", Celery()), parse_when("1700000000.5", Celery())
    (1796112000000, 1700000000500)
    """
    spec = text.strip()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if spec.lower() == "now":
        return now
    if spec[:1] in ("+", "-"):
        try:
            delta = parse_duration(spec[1:])
        except ValueError as exc:
            raise InvalidInput(f"bad relative time {text!r}: use e.g. +10m, -1h, +1h30m, +2d") from exc
        return now + delta if spec[0] == "+" else now - delta
    when: Any = spec
    if re.fullmatch(r"\d+(\.\d*)?|\.\d+", spec):
        when = float(spec)
    try:
        return due_ms_from_eta(when, app, naive_in_zone=True)
    except (ScheduleError, ValueError, TypeError) as exc:
        raise InvalidInput(
            f"bad time {text!r} ({exc}): use ISO-8601 (2026-12-01T09:00:00+01:00), UNIX seconds, "
            "'now', or a time relative to now such as +10m or -1h"
        ) from exc
