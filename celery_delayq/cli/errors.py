"""The CLI's exit codes, its one-line errors, and the table that maps the package's exceptions
to them (by exception class, never by the text of a message).

Exit codes: 0 done; 1 something was not found or not done (each one is named on stderr);
2 a usage error (a bad option, time, duration, cron expression or JSON value); 3 the store
cannot be used (Redis unreachable, a bad ``delayq_url`` or another bad ``delayq_*`` setting).

>>> from celery_delayq.exceptions import ScheduleExists
>>> problem = cli_error(ScheduleExists("taken", name="nightly"), url="redis://cache:6379/0")
>>> type(problem).__name__, problem.exit_code
('CliError', 1)
>>> problem.message
"a schedule named 'nightly' exists: change it with `schedules update`, or `schedules add --replace`"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import click

from ..exceptions import (
    BatchExists,
    ConfigurationError,
    InvalidBatch,
    ScheduleError,
    ScheduleExists,
    ScheduleNotFound,
    StoreError,
    StoreRefused,
    StoreUnreachable,
    UnknownKey,
    UnknownTask,
)
from ..store.connection import REDIS_ERRORS, UNREACHABLE_ERRORS

__all__ = [
    "ERRORS",
    "EXIT_NOT_DONE",
    "EXIT_OK",
    "EXIT_STORE",
    "EXIT_USAGE",
    "CliError",
    "ErrorRule",
    "StoreProblem",
    "UsageProblem",
    "cli_error",
    "rule_for",
    "usage",
]

EXIT_OK, EXIT_NOT_DONE, EXIT_USAGE, EXIT_STORE = 0, 1, 2, 3


class CliError(click.ClickException):
    """A one-line error (``Error: ...`` on stderr): something not found or not done (exit 1)."""

    exit_code = EXIT_NOT_DONE


class UsageProblem(CliError):
    """A bad option value: time, duration, cron expression, JSON (exit 2, as click's own)."""

    exit_code = EXIT_USAGE


class StoreProblem(CliError):
    """Redis cannot be reached or used, or a ``delayq_*`` setting is bad (exit 3)."""

    exit_code = EXIT_STORE


def usage(message: str) -> NoReturn:
    """Stop with a usage error (exit 2)."""
    raise UsageProblem(message)


@dataclass(frozen=True)
class ErrorRule:
    """What the CLI says for one exception class."""

    #: The kind of error, and so the exit code.
    problem: type[CliError]
    #: The line, from the exception and the store's URL (password redacted).
    text: Callable[[Any, str], str]
    #: The error may come from running without ``-A``: then the hint to pass it is shown instead.
    app_hint: bool = False


def _unknown_task(exc: UnknownTask, url: str) -> str:
    if exc.task is None:
        return f"{exc} (or pass --no-check-task)"
    return (
        f"task {exc.task!r} is not registered in this app; import its module first (or pass --no-check-task)"
    )


def _schedule_exists(exc: ScheduleExists, url: str) -> str:
    return (
        f"a schedule named {exc.name!r} exists: change it with `schedules update`, "
        "or `schedules add --replace`"
    )


def _unknown_key(exc: UnknownKey, url: str) -> str:
    if exc.schedule:
        command = {"resume": "resume"}.get(exc.action, "pause")
        return (
            f"{exc.key!r} is a schedule, not a gate key: use `celery delayq schedules {command} "
            f"{exc.key}` (or --new to {exc.action} a new gate key {exc.key!r})"
        )
    return (
        f"no gate key {exc.key!r} has been seen (no job of it stored or gated, no limit or pause "
        f"set): check the name, or pass --new to {exc.action} it anyway"
    )


_UNREACHABLE = ErrorRule(StoreProblem, lambda exc, url: f"cannot reach Redis at {url}: {exc}", app_hint=True)
_ANSWERED = ErrorRule(StoreProblem, lambda exc, url: f"Redis at {url} answered: {exc}")

#: Exception class -> what the CLI says. The most specific class in an exception's MRO wins.
ERRORS: dict[type[BaseException], ErrorRule] = {
    ScheduleNotFound: ErrorRule(CliError, lambda exc, url: str(exc)),
    ScheduleExists: ErrorRule(CliError, _schedule_exists),
    BatchExists: ErrorRule(CliError, lambda exc, url: str(exc)),
    UnknownKey: ErrorRule(CliError, _unknown_key),
    InvalidBatch: ErrorRule(UsageProblem, lambda exc, url: str(exc)),
    UnknownTask: ErrorRule(UsageProblem, _unknown_task),
    ScheduleError: ErrorRule(UsageProblem, lambda exc, url: str(exc)),
    ConfigurationError: ErrorRule(StoreProblem, lambda exc, url: f"configuration: {exc}", app_hint=True),
    **dict.fromkeys(UNREACHABLE_ERRORS, _UNREACHABLE),
    **dict.fromkeys(REDIS_ERRORS, _ANSWERED),
    # The store's own errors name its URL and setting themselves (store.connection.store_error);
    # redis-py's, from a call made outside the store's methods, are worded above. (After them:
    # REDIS_ERRORS names StoreRefused too.)
    StoreUnreachable: ErrorRule(StoreProblem, lambda exc, url: str(exc), app_hint=True),
    StoreRefused: ErrorRule(StoreProblem, lambda exc, url: str(exc)),
    StoreError: ErrorRule(StoreProblem, lambda exc, url: str(exc)),
}


def rule_for(exc: BaseException) -> ErrorRule | None:
    """The rule of the most specific class of ``exc`` in :data:`ERRORS`, or None."""
    return next((ERRORS[cls] for cls in type(exc).__mro__ if cls in ERRORS), None)


def cli_error(exc: BaseException, url: str, no_app: str | None = None) -> CliError:
    """The one-line error for ``exc``, an exception :func:`rule_for` knows.

    ``no_app`` is the command as the user should have typed it when no app was named; the
    errors that may come from that say so instead."""
    rule = rule_for(exc)
    if rule is None:
        raise ValueError(f"no rule for {type(exc).__name__}") from exc
    if rule.app_hint and no_app is not None:
        return StoreProblem(
            f"no Celery app: pass -A/--app proj, as in `celery -A proj delayq {no_app}` "
            f"(Celery's default app cannot be used: {exc})"
        )
    return rule.problem(rule.text(exc, url))
