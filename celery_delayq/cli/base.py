"""What every ``celery delayq`` command works with: the :class:`Session` (the app, its store made
with the CLI's timeouts, the output settings), the group class that turns the package's
exceptions into one line and an exit code, and the option helpers the commands share.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import tzinfo
from typing import Any, TypeVar

import click
from rich.console import Console

from ..admin import inputs
from ..admin.jobs import DelayQ
from ..admin.views import local_text
from ..config import DelayQConfig, redact_url, setting_name
from ..due import ms_to_datetime
from ..exceptions import ConfigurationError
from ..schedules.api import Schedules
from ..store.facade import Store, get_store
from .errors import EXIT_NOT_DONE, StoreProblem, cli_error, rule_for, usage
from .render import emit_json, make_console, shown
from .timeparse import is_relative, parse_when

__all__ = [
    "CONNECT_TIMEOUT",
    "DelayqGroup",
    "Session",
    "cli_store",
    "json_option",
    "json_value",
    "report",
    "session",
]

#: Seconds to wait for a TCP connection to Redis before saying it cannot be reached.
CONNECT_TIMEOUT = 5.0

F = TypeVar("F", bound=Callable[..., Any])


class Session:
    """What one ``celery delayq`` invocation works with: the app, its store, output settings."""

    def __init__(self, app: Any, no_color: bool = False, app_given: bool = True) -> None:
        self.app = app
        self.no_color = no_color
        #: False when ``celery`` was run without ``-A``/``--app`` (nor ``CELERY_APP``): the app
        #: is Celery's default one, and an error about the store says to pass ``-A``.
        self.app_given = app_given
        self._store: Store | None = None

    # -- the store, made with a connect timeout: an unreachable host fails in seconds, not minutes
    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = cli_store(self.app)
        return self._store

    @property
    def dq(self) -> DelayQ:
        self.store  # noqa: B018 - makes the app's store first (with the CLI's timeouts)
        return DelayQ(self.app)

    @property
    def schedules(self) -> Schedules:
        self.store  # noqa: B018
        return Schedules(self.app)

    @property
    def url(self) -> str:
        return redact_url(DelayQConfig.from_app(self.app).url)

    @property
    def tz(self) -> tzinfo:
        zone: tzinfo = self.app.timezone
        return zone

    def console(self) -> Console:
        return make_console(self.no_color)

    def when(self, ms: int | float | None) -> str:
        """A time for humans, in the app's timezone: ``2026-11-21 15:03:07Z``."""
        return local_text(ms, self.tz)

    def hhmm(self, ms: int | float) -> str:
        return ms_to_datetime(ms).astimezone(self.tz).strftime("%H:%M")

    def emit_json(self, data: Any) -> None:
        emit_json(data)

    def parse_when(self, text: str, what: str) -> int:
        """:func:`.timeparse.parse_when` for an option: ``now``, ``+10m`` and ``-1h`` count from
        the Redis server's clock (as the beat does), not this machine's; bad: a usage error."""
        # (the store first: a bad delayq_url, a ConfigurationError and so a ValueError, is a
        # configuration problem, exit 3, not a bad WHEN)
        now = self.store.server_now_ms() if is_relative(text) else None
        try:
            return parse_when(text, self.app, now)
        except ValueError as exc:
            usage(f"{what}: {exc}")


def cli_store(app: Any) -> Store:
    """The app's store (made once per app) with a connect timeout of :data:`CONNECT_TIMEOUT`."""
    try:
        return get_store(app, connect_timeout=CONNECT_TIMEOUT)
    except (ValueError, TypeError) as exc:
        name = setting_name(app, "delayq_url")
        raise StoreProblem(f"bad {name} {redact_url(DelayQConfig.from_app(app).url)!r}: {exc}") from exc


def session(ctx: click.Context) -> Session:
    """The invocation's :class:`Session` (made by the ``delayq`` group)."""
    obj = ctx.find_object(Session)
    if obj is None:  # pragma: no cover - the group always makes one
        raise click.UsageError("run as `celery -A proj delayq ...`")
    return obj


def json_option(f: F) -> F:
    """The ``--json`` flag every command has."""
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(f)


def json_value(text: str | None, what: str, kind: type) -> Any:
    """The JSON array (``kind`` list) or object (dict) given to option ``what``; None stays None."""
    try:
        return inputs.json_value(text, what, kind)
    except inputs.InputError as exc:
        usage(str(exc))


def report(s: Session, results: list[dict[str, Any]], ok: set[str], as_json: bool, key: str = "id") -> None:
    """Print per-item outcomes (each named by its ``key``); exit 1 when one is not in ``ok``."""
    failed = [r for r in results if r["outcome"] not in ok]
    if as_json:
        s.emit_json({"results": results})
    else:
        for r in results:
            if r["outcome"] in ok:
                click.echo(f"{shown(str(r[key]))}: {r['message']}")
    for r in failed:
        click.echo(f"Error: {r['message']}", err=True)
    if failed:
        raise click.exceptions.Exit(EXIT_NOT_DONE)


class DelayqGroup(click.Group):
    """Turns the errors users cause into one line on stderr and an exit code (no traceback):
    :func:`.errors.cli_error` says which, from the exception's class."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if rule_for(exc) is None:
                raise
            raise cli_error(exc, _url_of(ctx), _command_without_app(ctx)) from exc


def _command_without_app(ctx: click.Context) -> str | None:
    """The command as typed (``schedules ls``) when no app was named, else None."""
    obj = ctx.find_object(Session)
    if obj is None or obj.app_given:
        return None
    words, inner = [ctx.invoked_subcommand or "status"], ctx
    while inner.parent is not None and isinstance(inner.parent.command, DelayqGroup):
        words.insert(0, inner.info_name or "")
        inner = inner.parent
    return " ".join(words)


def _url_of(ctx: click.Context) -> str:
    obj = ctx.find_object(Session)
    try:
        return obj.url if obj is not None else "?"
    except ConfigurationError:
        return "?"
