"""What a person types to manage schedules and gate keys, read the same way by the CLI and the
web dashboard: a schedule's rule (cron, every or at), its JSON values and options, a gate
key's limit; and storing a schedule with the errors a person can cause said in their words.

No click, no rich, no Redis of its own: a value that cannot be used raises :class:`InputError`
(a ``ValueError``) saying what is wrong; the CLI prints it as a usage error (exit 2), the
dashboard shows it next to the form. ``prefix`` names the fields as the caller shows them
(``"--"``: ``--every``; ``""``: the form's ``every``).

>>> rule_of(None, "30s", None, required=True)
datetime.timedelta(seconds=30)
>>> json_value('[1, 2]', "--args", list)
[1, 2]
>>> limit_of("none"), limit_of(" 3 ")
(None, 3)
>>> options_value(None, "reports", {"priority": 3})
{'priority': 3, 'queue': 'reports'}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..due import ms_to_datetime
from ..exceptions import InvalidOptions, ScheduleError
from ..flow.gate import check_limit
from ..schedules.api import Schedules
from ..schedules.spec import Schedule
from .timeparse import parse_duration

__all__ = [
    "InputError",
    "add_schedule",
    "json_value",
    "limit_of",
    "options_value",
    "rule_of",
    "update_schedule",
]


class InputError(ValueError):
    """A value a person gave that cannot be used; the message says what is wrong."""


def rule_of(
    cron: str | None,
    every: str | None,
    at: str | None,
    required: bool,
    when: Callable[[str], int] = int,
    prefix: str = "--",
) -> Any:
    """The rule :meth:`Schedules.add` takes, from one of ``cron`` (passed on: the schedule checks
    it), ``every`` (a duration: ``30s``, ``1h30m``) or ``at`` (a time ``when`` reads as ms
    since the epoch: the caller's :func:`.timeparse.parse_when`; ValueError when it is not
    one); None when none is given and not ``required``."""
    given = [x for x in (cron, every, at) if x is not None]
    if len(given) > 1:
        raise InputError(f"give one of {prefix}cron, {prefix}every or {prefix}at")
    if not given:
        if required:
            raise InputError(
                f"give the rule: {prefix}cron '0 9 * * 1-5', {prefix}every 30s "
                f"or {prefix}at 2026-12-01T09:00:00Z"
            )
        return None
    if cron is not None:
        return cron
    if every is not None:
        try:
            every_ms = parse_duration(every)
        except ValueError as exc:
            raise InputError(f"{prefix}every: {exc}") from None
        if every_ms <= 0:
            raise InputError(f"{prefix}every must be longer than 0, got {every!r}")
        return timedelta(milliseconds=every_ms)
    assert at is not None
    try:
        return ms_to_datetime(when(at))
    except InputError:
        raise
    except ValueError as exc:
        raise InputError(f"{prefix}at: {exc}") from None


def json_value(text: str | None, what: str, kind: type) -> Any:
    """The JSON array (``kind`` list) or object (dict) typed for ``what``; None stays None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{what} must be JSON: {exc} in {text!r}") from None
    if not isinstance(value, kind):
        raise InputError(f"{what} must be a JSON {'array' if kind is list else 'object'}, got {text!r}")
    return value


def options_value(
    options_json: str | None, queue: str | None, base: dict[str, Any] | None, what: str = "--options"
) -> Any:
    """``apply_async`` options: the JSON object given (else ``base``) with ``queue`` set when
    given; None when neither is given."""
    options = json_value(options_json, what, dict)
    if options is None and queue is None:
        return None
    merged = dict(base or {}) if options is None else dict(options)
    if queue is not None:
        merged["queue"] = queue
    return merged


def limit_of(text: str, what: str = "N") -> int | None:
    """A gate key's run-time limit as typed: a whole number >= 1, or ``none`` (no cap: None)."""
    if text.strip().lower() == "none":
        return None
    try:
        return check_limit(int(text), what)
    except InvalidOptions as exc:
        raise InputError(str(exc)) from None
    except ValueError:
        raise InputError(f"{what}: a limit is a whole number >= 1, or 'none'; got {text!r}") from None


def add_schedule(
    schedules: Schedules,
    name: str,
    task: str,
    rule: Any,
    args: Any,
    kwargs: Any,
    replace: bool = False,
    **settings: Any,
) -> Schedule:
    """:meth:`Schedules.add` (``replace``: ``upsert``), importing the app's modules first when
    the task is checked (as a worker does); arguments that do not fit the task: InputError."""
    if settings.get("check_task", True):
        schedules.app.loader.import_default_modules()
    call = schedules.upsert if replace else schedules.add
    try:
        return call(name, task, rule, args, kwargs, **settings)
    except TypeError as exc:  # Celery's check of the arguments against the task's signature
        if isinstance(exc, ScheduleError):
            raise
        raise InputError(f"the arguments do not fit task {task!r}: {exc}") from None


def update_schedule(schedules: Schedules, name: str, changes: dict[str, Any]) -> Schedule:
    """:meth:`Schedules.update` (a new task: the app's modules imported first); arguments that
    do not fit the task: InputError."""
    if "task" in changes:
        schedules.app.loader.import_default_modules()
    try:
        return schedules.update(name, **changes)
    except TypeError as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise InputError(f"the arguments do not fit the task of schedule {name!r}: {exc}") from None
