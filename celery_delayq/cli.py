"""``celery -A proj delayq ...``: look at and manage the stored jobs, schedules and dead letters.

A Celery sub-command, registered through the ``celery.commands`` entry point, so it
runs with the app ``-A`` names and that app's ``delayq_*`` settings. See docs/cli.md.

Exit codes: 0 done; 1 something was not found or not done (each one is named on
stderr); 2 a usage error (a bad option, time, duration, cron expression or JSON
value); 3 the store cannot be used (Redis unreachable, a bad ``delayq_url`` or
another bad ``delayq_*`` setting).

Times on the command line are ISO-8601 (a naive one is read in the app's
timezone: a person at a terminal types wall-clock times; ``apply_at`` instead reads a
naive time as UTC as Celery does, and refuses one where the app's zone is not UTC), UNIX
seconds, ``now``, or relative to now:

>>> parse_when("+1h30m", app=None, now_ms=0), parse_when("-90s", app=None, now_ms=100_000)
(5400000, 10000)
>>> parse_duration("1h30m"), parse_duration("250ms"), parse_duration("45")
(5400000, 250, 45000)
>>> redact_url("redis://user:secret@cache:6379/0")
'redis://user:***@cache:6379/0'
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta, tzinfo
from typing import IO, Any, NoReturn, TypeVar, cast

import click
import redis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import lateness
from .config import DelayQConfig, redact_url, setting_name
from .exceptions import (
    ConfigurationError,
    ScheduleError,
    ScheduleExists,
    ScheduleNotFound,
    StoreError,
    UnknownTask,
)
from .jobs import CANCELLED, DELIVERING, MISSING, MOVED, NO_ENVELOPE, REQUEUED, DelayQ
from .message import decode_envelope, due_ms_from_eta, ms_to_datetime
from .schedules import Schedule, Schedules
from .store import REDIS_ERRORS, JobRecord, ShardStats, Store, loaded_form

__all__ = ["EXIT_NOT_DONE", "EXIT_OK", "EXIT_STORE", "EXIT_USAGE", "delayq", "parse_duration", "parse_when"]

EXIT_OK, EXIT_NOT_DONE, EXIT_USAGE, EXIT_STORE = 0, 1, 2, 3

#: Seconds to wait for a TCP connection to Redis before saying it cannot be reached.
CONNECT_TIMEOUT = 5.0
#: A beat whose heartbeat is older than this (ms) is shown as stale.
BEAT_ALIVE_MS = 60_000
#: Most rows of the per-shard table before only the shards holding something are shown.
SHARD_ROWS = 32

F = TypeVar("F", bound=Callable[..., Any])


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
    raise UsageProblem(message)


# -- parsing ------------------------------------------------------------------------------------

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> int:
    """Milliseconds of ``30s``, ``5m``, ``1h30m``, ``2d``, ``250ms``, ``1.5h`` or plain seconds.

    >>> parse_duration("2d"), parse_duration("1.5h")
    (172800000, 5400000)
    """
    spec = text.strip().lower().replace(" ", "")
    if not spec:
        raise ValueError("empty duration")
    try:
        seconds = float(spec)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"duration must be finite, got {text!r}")
        return round(seconds * 1000)
    pos, total = 0, 0.0
    for match in _PART.finditer(spec):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS_MS[match.group(2)]
        pos = match.end()
    if pos != len(spec) or pos == 0:
        raise ValueError(f"bad duration {text!r}: use e.g. 30s, 5m, 1h30m, 2d, 250ms")
    return round(total)


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
            raise ValueError(f"bad relative time {text!r}: use e.g. +10m, -1h, +1h30m, +2d") from exc
        return now + delta if spec[0] == "+" else now - delta
    when: Any = spec
    if re.fullmatch(r"\d+(\.\d*)?|\.\d+", spec):
        when = float(spec)
    try:
        return due_ms_from_eta(when, app, naive_in_zone=True)
    except (ScheduleError, ValueError, TypeError) as exc:
        raise ValueError(
            f"bad time {text!r} ({exc}): use ISO-8601 (2026-12-01T09:00:00+01:00), UNIX seconds, "
            "'now', or a time relative to now such as +10m or -1h"
        ) from exc


def _when(text: str, s: Session, what: str) -> int:
    """:func:`parse_when` for the command line: ``now``, ``+10m`` and ``-1h`` count from the
    Redis server's clock (as the beat does), not this machine's."""
    spec = text.strip()
    relative = spec.lower() == "now" or spec[:1] in ("+", "-")
    try:
        return parse_when(text, s.app, s.store.server_now_ms() if relative else None)
    except ValueError as exc:
        usage(f"{what}: {exc}")


def _json_value(text: str | None, what: str, kind: type) -> Any:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        usage(f"{what} must be JSON: {exc} in {text!r}")
    if not isinstance(value, kind):
        usage(f"{what} must be a JSON {'array' if kind is list else 'object'}, got {text!r}")
    return value


# -- formatting ---------------------------------------------------------------------------------


def iso(ms: int | float | None) -> str | None:
    """ISO-8601 in UTC (JSON output), None stays None."""
    return (
        None if ms is None else ms_to_datetime(ms).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def ago(ms: float) -> str:
    """``ms`` as a short span: ``4m12s``, ``3h``, ``2d5h``.

    >>> ago(252_000), ago(3 * 3_600_000), ago(0.5), ago(2 * 86_400_000 + 5 * 3_600_000)
    ('4m12s', '3h', '0s', '2d5h')
    """
    s = int(abs(ms) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60}m" if s % 3600 // 60 else f"{s // 3600}h"
    return f"{s // 86_400}d{s % 86_400 // 3600}h" if s % 86_400 // 3600 else f"{s // 86_400}d"


def relative(ms: float, now_ms: float) -> str:
    if abs(ms - now_ms) < 1000:
        return "now"
    return f"in {ago(ms - now_ms)}" if ms >= now_ms else f"{ago(now_ms - ms)} ago"


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
            self._store = _cli_store(self.app)
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
        stream = sys.stdout
        width = None if stream.isatty() else 160  # piped or captured: do not cut lines at 80
        return Console(
            file=cast(IO[str], _Trimmed(stream)),
            width=width,
            highlight=False,
            no_color=self.no_color,
            soft_wrap=False,
            emoji=False,
        )

    def when(self, ms: int | float | None) -> str:
        """A time for humans, in the app's timezone: ``2026-11-21 15:03:07Z``."""
        if ms is None:
            return "-"
        local = ms_to_datetime(ms).astimezone(self.tz)
        text = local.strftime("%Y-%m-%d %H:%M:%S")
        offset = local.utcoffset() or timedelta(0)
        if not offset:
            return text + "Z"
        return text + local.strftime("%z")[:3] + ":" + local.strftime("%z")[3:]

    def hhmm(self, ms: int | float) -> str:
        return ms_to_datetime(ms).astimezone(self.tz).strftime("%H:%M")

    def emit_json(self, data: Any) -> None:
        click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


_PADDING = re.compile(r" +((?:\x1b\[[0-9;]*m)*)\n")


class _Trimmed:
    """A text stream that drops the spaces rich pads table rows with at the end of each line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            done, self.pending = self.pending.rsplit("\n", 1)
            self.stream.write(_PADDING.sub(r"\1\n", done + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _cli_store(app: Any) -> Store:
    existing = app.__dict__.get("_delayq_store")
    if isinstance(existing, Store):
        return existing
    config = DelayQConfig.from_app(app)
    options: dict[str, Any] = dict(
        decode_responses=True,
        encoding_errors="surrogateescape",
        health_check_interval=30,
        socket_connect_timeout=CONNECT_TIMEOUT,
    )
    try:
        if config.cluster:
            from redis.cluster import RedisCluster

            client: Any = RedisCluster.from_url(config.url, **options)
        else:
            client = redis.Redis.from_url(config.url, **options)
    except (ValueError, TypeError) as exc:
        name = setting_name(app, "delayq_url")
        raise StoreProblem(f"bad {name} {redact_url(config.url)!r}: {exc}") from exc
    store = Store(config, client)
    app.__dict__["_delayq_store"] = store
    return store


def session(ctx: click.Context) -> Session:
    obj = ctx.find_object(Session)
    if obj is None:  # pragma: no cover - the group always makes one
        raise click.UsageError("run as `celery -A proj delayq ...`")
    return obj


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(f)


# -- the group ----------------------------------------------------------------------------------


class DelayqGroup(click.Group):
    """Turns the errors users cause into one line on stderr and an exit code (no traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except ScheduleNotFound as exc:
            raise CliError(str(exc)) from exc
        except ScheduleExists as exc:
            taken = str(exc).replace("; use upsert() or update()", "")
            raise CliError(
                f"{taken}: change it with `schedules update`, or `schedules add --replace`"
            ) from exc
        except UnknownTask as exc:
            raise UsageProblem(
                f"{str(exc).replace(', or pass check_task=False', '')} (or pass --no-check-task)"
            ) from exc
        except ScheduleError as exc:
            raise UsageProblem(str(exc)) from exc
        except ConfigurationError as exc:
            _no_app(ctx, exc)
            raise StoreProblem(f"configuration: {exc}") from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            _no_app(ctx, exc)
            url = _url_of(ctx)
            raise StoreProblem(f"cannot reach Redis at {url}: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise StoreProblem(f"Redis at {_url_of(ctx)} answered: {exc}") from exc
        except StoreError as exc:
            raise StoreProblem(str(exc)) from exc


def _no_app(ctx: click.Context, exc: Exception) -> None:
    """Raise the hint to pass ``-A`` when no app was named (the store error is its consequence)."""
    obj = ctx.find_object(Session)
    if obj is not None and not obj.app_given:
        words, inner = [ctx.invoked_subcommand or "status"], ctx
        while inner.parent is not None and isinstance(inner.parent.command, DelayqGroup):
            words.insert(0, inner.info_name or "")
            inner = inner.parent
        command = " ".join(words)
        raise StoreProblem(
            f"no Celery app: pass -A/--app proj, as in `celery -A proj delayq {command}` "
            f"(Celery's default app cannot be used: {exc})"
        ) from exc


def _url_of(ctx: click.Context) -> str:
    obj = ctx.find_object(Session)
    try:
        return obj.url if obj is not None else "?"
    except ConfigurationError:
        return "?"


@click.group(cls=DelayqGroup)
@click.pass_context
def delayq(ctx: click.Context) -> None:
    """Look at and manage delayq jobs, recurring schedules and dead letters.

    Exit codes: 0 done, 1 not found / not done, 2 usage error, 3 Redis unreachable or a
    bad delayq_* setting.
    """
    parent = ctx.obj
    app = getattr(parent, "app", None)
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()
    # Under `celery`, the root command's -A/--app (or CELERY_APP); in-process callers pass the app.
    root = ctx.find_root()
    given = root is ctx or root.params.get("app") is not None
    ctx.obj = Session(app, no_color=bool(getattr(parent, "no_color", False)), app_given=given)


# -- jobs: views --------------------------------------------------------------------------------


def _args_of(envelope: Any) -> tuple[Any, Any]:
    """Decoded args/kwargs of a JSON message, else Celery's argsrepr/kwargsrepr strings."""
    if envelope.content_type == "application/json":
        try:
            args, kwargs, _ = json.loads(envelope.body.decode(envelope.content_encoding or "utf-8"))
            return args, kwargs
        except (ValueError, TypeError, LookupError):
            pass
    return envelope.headers.get("argsrepr"), envelope.headers.get("kwargsrepr")


def job_view(record: JobRecord, default_queue: str, detail: bool = False) -> dict[str, Any]:
    """The JSON of one job (stable keys; ``detail`` adds the message's options and headers)."""
    out: dict[str, Any] = {
        "id": record.id,
        "state": record.state,
        "task": None,
        "shard": record.shard,
        "due": iso(record.due_ms),
        "due_ms": record.due_ms,
        "queue": None,
        "args": None,
        "kwargs": None,
        "tries": record.tries,
        "lease_until": iso(record.lease_until_ms),
        "schedule": None,
    }
    envelope = None
    error = None
    try:
        envelope = decode_envelope(record.envelope)
    except ValueError as exc:
        error = str(exc)
    if envelope is not None:
        queue = envelope.route.get("queue")
        args, kwargs = _args_of(envelope)
        out.update(
            task=envelope.task,
            queue=queue if isinstance(queue, str) else default_queue,
            args=args,
            kwargs=kwargs,
            schedule=envelope.schedule[0] if envelope.schedule else None,
        )
    if detail:
        out.update(
            created=iso(envelope.created_ms) if envelope and envelope.created_ms else None,
            expires=iso(envelope.expires_ms) if envelope and envelope.expires_ms is not None else None,
            options=dict(envelope.route) if envelope else None,
            headers=dict(envelope.headers) if envelope else None,
            properties=dict(envelope.props) if envelope else None,
            content_type=envelope.content_type if envelope else None,
            content_encoding=envelope.content_encoding if envelope else None,
            envelope_error=error,
            dead=None,
        )
    elif error:
        out["task"] = "<corrupt envelope>"
    return out


def _short(value: Any, width: int = 48) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def _call_text(view: dict[str, Any]) -> str:
    args, kwargs = view["args"], view["kwargs"]
    parts = []
    if args not in (None, [], "()"):
        parts.append(_short(args, 40))
    if kwargs not in (None, {}, "{}"):
        parts.append(_short(kwargs, 40))
    return " ".join(parts)


def _add(table: Table, *cells: str, style: str | None = None) -> None:
    """A row of plain text (ids, task names and arguments are never read as rich markup)."""
    table.add_row(*(Text(cell) for cell in cells), style=style)


def _kv_table(title: str, rows: Sequence[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        if value is None:
            text = "-"
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, ensure_ascii=False, default=str)
        table.add_row(key, Text(text))
    return table


# -- jobs: commands -----------------------------------------------------------------------------


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def _cursor_text(record: JobRecord) -> str:
    return f"{record.lease_until_ms or record.due_ms}:{record.shard}:{record.id}"


def _parse_cursor(text: str) -> tuple[int, int, bytes]:
    try:
        score, shard, job_id = text.split(":", 2)
        return int(score), int(shard), job_id.encode("utf-8", "surrogateescape")
    except ValueError:
        usage(f"bad --cursor {text!r}: pass the next_cursor an earlier `ls` printed")


def _order(record: JobRecord) -> tuple[int, int, bytes]:
    """Where a record stands in ``Store.scan``'s order: score, shard, then id bytes (Redis
    orders members of equal score by their bytes; the merge keeps shards in index order)."""
    return record.lease_until_ms or record.due_ms, record.shard, record.id.encode("utf-8", "surrogateescape")


@delayq.command("ls", short_help="List stored jobs in due order.")
@click.option("--task", help="Only jobs of this task (name).")
@click.option(
    "--from", "start", metavar="WHEN", help="Due at or after WHEN (ISO-8601, UNIX s, now, +10m, -1h)."
)
@click.option("--until", "end", metavar="WHEN", help="Due at or before WHEN.")
@click.option("--queue", help="Only jobs routed to this queue.")
@click.option("--state", type=click.Choice(["waiting", "leased"]), help="Only waiting or leased jobs.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Most jobs shown.")
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Skip this many matching jobs first.")
@click.option("--cursor", help="Go on after the job an earlier `ls` named in its next_cursor.")
@json_option
@click.pass_context
def ls_jobs(
    ctx: click.Context,
    task: str | None,
    start: str | None,
    end: str | None,
    queue: str | None,
    state: str | None,
    limit: int,
    offset: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """Stored jobs in due order (a job being delivered is ordered by its lease expiry)."""
    s = session(ctx)
    start_ms = _when(start, s, "--from") if start else None
    end_ms = _when(end, s, "--until") if end else None
    after = _parse_cursor(cursor) if cursor else None
    if after is not None:
        start_ms = after[0] if start_ms is None else max(start_ms, after[0])
    default_queue = s.app.conf.task_default_queue
    filtered = bool(task or queue or state)
    page = 500 if filtered else max(10, min(500, limit + offset + 2))
    shown: list[tuple[JobRecord, dict[str, Any]]] = []
    more = False
    skipped = 0
    # A task name any JSON encoder writes as it is: an envelope without it quoted is not of it,
    # and is passed over without being decoded (a --task scan reads every job in the window).
    needle = json.dumps(task) if task and _PLAIN_NAME.fullmatch(task) else None
    for record in s.store.scan(start_ms, end_ms, page=page):
        if after is not None and _order(record) <= after:
            continue
        if state and record.state != state:
            continue
        if needle is not None and needle not in record.envelope:
            continue
        if task or queue:
            try:
                envelope = decode_envelope(record.envelope)
            except ValueError:
                continue  # listed only without --task/--queue, as "<corrupt envelope>"
            if task and envelope.task != task:
                continue
            route_queue = envelope.route.get("queue")
            if queue and (route_queue if isinstance(route_queue, str) else default_queue) != queue:
                continue
        if skipped < offset:
            skipped += 1
            continue
        if len(shown) == limit:
            more = True
            break
        shown.append((record, job_view(record, default_queue)))
    next_cursor = _cursor_text(shown[-1][0]) if more and shown else None
    if as_json:
        s.emit_json({"jobs": [v for _, v in shown], "count": len(shown), "next_cursor": next_cursor})
        return
    console = s.console()
    if not shown:
        console.print("no jobs match" if (filtered or start or end or offset or cursor) else "no jobs stored")
        return
    now = time.time() * 1000
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("ID", "STATE", "DUE", "", "TASK", "QUEUE", "ARGS"):
        table.add_column(name, no_wrap=name != "ARGS", overflow="ellipsis")
    for record, view in shown:
        _add(
            table,
            record.id,
            record.state,
            s.when(record.due_ms),
            relative(record.due_ms, now),
            view["task"] or "?",
            view["queue"] or "",
            _call_text(view),
        )
    console.print(table)
    if next_cursor:
        console.print(Text(f"{len(shown)} shown; more with: --cursor '{next_cursor}'"))


def _job_detail(s: Session, job_id: str) -> dict[str, Any] | None:
    record = s.store.get(job_id)
    if record is None:
        return None
    view = job_view(record, s.app.conf.task_default_queue, detail=True)
    if record.state == "dead":
        dead = s.store.dead_record(job_id) or {}
        view["dead"] = {k: dead.get(k) for k in ("reason", "beat")}
        view["dead"]["dead_at"] = iso(dead["dead_at"]) if dead.get("dead_at") else None
    return view


def _print_job(s: Session, view: dict[str, Any]) -> None:
    now = time.time() * 1000

    def when(text: str | None) -> str | None:
        if text is None:
            return None
        ms = datetime.fromisoformat(text).timestamp() * 1000
        return f"{s.when(ms)} ({relative(ms, now)})"

    rows: list[tuple[str, Any]] = [
        ("id", view["id"]),
        ("state", view["state"]),
        ("task", view["task"]),
        ("due", f"{s.when(view['due_ms'])} ({relative(view['due_ms'], now)})"),
        ("shard", str(view["shard"])),
        ("queue", view["queue"]),
        ("args", view["args"]),
        ("kwargs", view["kwargs"]),
        ("tries", str(view["tries"])),
    ]
    if view["lease_until"]:
        rows.append(("lease until", when(view["lease_until"])))
    if view["schedule"]:
        rows.append(("schedule", view["schedule"]))
    if view.get("dead"):
        rows.append(("dead reason", view["dead"]["reason"]))
        rows.append(("dead at", when(view["dead"]["dead_at"])))
        rows.append(("buried by", view["dead"]["beat"]))
    rows += [
        ("created", when(view["created"])),
        ("expires", when(view["expires"])),
        ("options", view["options"]),
        ("headers", view["headers"]),
        ("properties", view["properties"]),
        ("content", f"{view['content_type']} ({view['content_encoding']})" if view["content_type"] else None),
    ]
    if view["envelope_error"]:
        rows.append(("envelope error", view["envelope_error"]))
    s.console().print(_kv_table(f"job {view['id']}", rows))


@delayq.command("show", short_help="Everything about one job.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def show_job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Everything about one job (waiting, being delivered, or dead-lettered)."""
    s = session(ctx)
    view = _job_detail(s, job_id)
    if view is None:
        raise CliError(f"no job with id {job_id!r}")
    if as_json:
        s.emit_json(view)
    else:
        _print_job(s, view)


_CANCEL_TEXT = {
    CANCELLED: "cancelled",
    DELIVERING: "removed, but a beat was delivering it at that moment: it may already be in the broker",
}


def _point_refusal(s: Session, job_id: str, what: str) -> str | None:
    name = s.dq.is_schedule_point(job_id)
    if name is None:
        return None
    return (
        f"{job_id!r} is the next run of schedule {name!r}: {what} it with "
        f"`delayq schedules pause|update|rm|run-now {name}`"
    )


def _missing_text(s: Session, job_id: str) -> str:
    if s.store.dead_record(job_id) is not None:
        return f"no waiting job {job_id!r}: it is dead-lettered (see `delayq dead show {job_id}`)"
    return f"no job with id {job_id!r}"


def _report(s: Session, results: list[dict[str, Any]], ok: set[str], as_json: bool) -> None:
    """Print per-id outcomes; exit 1 when one of them is not in ``ok``."""
    failed = [r for r in results if r["outcome"] not in ok]
    if as_json:
        s.emit_json({"results": results})
    else:
        for r in results:
            if r["outcome"] in ok:
                click.echo(f"{r['id']}: {r['message']}")
    for r in failed:
        click.echo(f"Error: {r['message']}", err=True)
    if failed:
        raise click.exceptions.Exit(EXIT_NOT_DONE)


@delayq.command("cancel", short_help="Remove waiting jobs so that they never run.")
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True)
@json_option
@click.pass_context
def cancel_jobs(ctx: click.Context, job_ids: tuple[str, ...], as_json: bool) -> None:
    """Remove waiting jobs so that they never run. Exit 1 when one was not found, was being
    delivered (removed, but it may run), or is a schedule's next run."""
    s = session(ctx)
    results = []
    for job_id in job_ids:
        refusal = _point_refusal(s, job_id, "cancel")
        if refusal:
            results.append({"id": job_id, "outcome": "schedule-point", "message": refusal})
            continue
        outcome = s.dq.cancel_outcome(job_id)
        message = _CANCEL_TEXT.get(outcome) or _missing_text(s, job_id)
        if outcome == DELIVERING:
            message = f"{job_id!r} {message}"
        results.append({"id": job_id, "outcome": outcome, "message": message})
    _report(s, results, {CANCELLED}, as_json)


def _move(ctx: click.Context, job_id: str, due_ms: int, as_json: bool, what: str) -> None:
    s = session(ctx)
    refusal = _point_refusal(s, job_id, what)
    if refusal:
        _report(s, [{"id": job_id, "outcome": "schedule-point", "message": refusal}], {MOVED}, as_json)
        return
    outcome = s.dq.reschedule_outcome(job_id, due_ms / 1000.0)
    if outcome == MOVED:
        message = f"due {s.when(due_ms)} ({relative(due_ms, time.time() * 1000)})"
    elif outcome == DELIVERING:
        message = f"{job_id!r} not moved: a beat is delivering it now"
    else:
        message = _missing_text(s, job_id)
    result = {"id": job_id, "outcome": outcome, "message": message, "due": iso(due_ms)}
    _report(s, [result], {MOVED}, as_json)


@delayq.command("reschedule", short_help="Move a waiting job to another time.")
@click.argument("job_id", metavar="ID")
@click.argument("when", metavar="WHEN")
@json_option
@click.pass_context
def reschedule_job(ctx: click.Context, job_id: str, when: str, as_json: bool) -> None:
    """Move a waiting job to WHEN (ISO-8601, UNIX seconds, now, +10m, -1h)."""
    _move(ctx, job_id, _when(when, session(ctx), "WHEN"), as_json, "reschedule")


@delayq.command("run-now", short_help="Make a waiting job due now.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def run_now_job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Make a waiting job due now (a beat publishes it within moments)."""
    _move(ctx, job_id, session(ctx).store.server_now_ms(), as_json, "run")


@delayq.command("purge", short_help="Delete every pending one-off job (asks first).")
@click.option("--task", help="Only the jobs of this task.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def purge_jobs(ctx: click.Context, task: str | None, yes: bool, as_json: bool) -> None:
    """Delete every pending one-off job of this app's key prefix (asks first).

    Recurring schedules and their next runs are kept (see `schedules rm`), and so are dead
    letters (see `dead rm --all`). Other prefixes are never touched.
    """
    s = session(ctx)
    store = s.store
    stored = store.count()
    what = f"every pending job of task {task!r}" if task else "every pending one-off job"
    if not yes:
        click.confirm(
            f"Delete {what} (of {stored:,} stored) under prefix {store.config.prefix!r} "
            f"at {s.url}? Schedules and dead letters are kept.",
            abort=True,
            err=True,
        )
    counts = s.dq.purge(task=task)
    if as_json:
        s.emit_json({"removed": counts[CANCELLED] + counts[DELIVERING], **counts})
        return
    line = f"removed {counts[CANCELLED]:,} job(s)"
    if counts[DELIVERING]:
        line += f", and {counts[DELIVERING]:,} a beat was delivering (they may already be in the broker)"
    if counts["kept_points"]:
        line += f"; kept {counts['kept_points']:,} schedule point(s)"
    click.echo(line)


# -- status -------------------------------------------------------------------------------------

_EIGHTHS = " ▁▂▃▄▅▆▇█"


def chart_lines(counts: Sequence[int], labels: Sequence[str], height: int = 8, indent: int = 8) -> list[str]:
    """A column chart: one column per count, ``height`` rows of eighth blocks, a time axis.

    >>> print("\\n".join(chart_lines([0, 4, 8, 2], ["a", "b", "c", "d"], height=2, indent=3)))
    8 ┤    ██
      │  ████▄▄
    0 └────────
       a
    """
    peak = max(counts) if counts else 0
    cell = 1 if len(counts) > 40 else 2
    levels = [0 if not peak or not c else max(1, round(c / peak * height * 8)) for c in counts]
    lines = []
    for row in range(height, 0, -1):
        base = (row - 1) * 8
        bars = "".join(_EIGHTHS[min(8, max(0, lv - base))] * cell for lv in levels)
        label = f"{peak:,}" if row == height else ""
        lines.append(f"{label:>{indent - 2}} {'┤' if row == height else '│'}{bars}")
    lines.append(f"{'0':>{indent - 2}} └{'─' * (len(counts) * cell)}")
    step = next((n for n in (1, 5, 10, 15, 30, 60) if n * cell >= 8), 60)
    axis = [" "] * (len(counts) * cell + 8)
    for i in range(0, len(counts), step):
        for j, ch in enumerate(labels[i]):
            axis[i * cell + j] = ch
    lines.append(" " * indent + "".join(axis).rstrip())
    return [line.rstrip() for line in lines]


def _bucket_ms(window_ms: int) -> int:
    """One minute, or more for long windows (at most 60 columns), in whole minutes."""
    return max(60_000, math.ceil(window_ms / 60 / 60_000) * 60_000)


def _lateness_view(snap: lateness.Snapshot) -> dict[str, Any]:
    def finite(v: float | None) -> float | None:
        return v if v is not None and math.isfinite(v) else None

    return {
        "count": snap.count,
        "mean_ms": round(snap.mean_ms, 3) if snap.mean_ms is not None else None,
        "p50_ms": finite(snap.quantile(0.5)),
        "p99_ms": finite(snap.quantile(0.99)),
        "buckets": [
            {"le_ms": bound if math.isfinite(bound) else None, "count": n}
            for bound, n in zip((*lateness.BOUNDS, math.inf), snap.buckets, strict=True)
        ],
    }


def _beat_view(token: str, raw: Any, now_ms: int) -> dict[str, Any]:
    entry = raw if isinstance(raw, dict) else {}
    keys = ("host", "pid", "started_ms", "seen_ms", "passes", "published", "dead_lettered", "errors")
    out: dict[str, Any] = {"token": token, **{k: entry.get(k) for k in keys}}
    seen = entry.get("seen_ms")
    seen_ok = isinstance(seen, int | float) and not isinstance(seen, bool)
    out["alive"] = bool(seen_ok and now_ms - float(seen or 0) <= BEAT_ALIVE_MS)
    out["seen"] = iso(seen) if seen_ok else None
    started = entry.get("started_ms")
    out["started"] = (
        iso(started) if isinstance(started, int | float) and not isinstance(started, bool) else None
    )
    if not isinstance(raw, dict):
        out["error"] = f"unreadable heartbeat {str(raw)[:60]!r}"
    return out


def _shard_view(st: ShardStats) -> dict[str, Any]:
    return {
        "shard": st.shard,
        "waiting": st.waiting,
        "leased": st.leased,
        "dead": st.dead,
        "overdue": st.overdue,
        "oldest_overdue": iso(st.head_due_ms),
        "oldest_overdue_id": st.head_id,
        "next_due": iso(st.next_due_ms),
        "next_due_id": st.next_id,
        "schedules": st.schedules,
    }


@delayq.command("status", short_help="Shards, beats, lateness, jobs due soon.")
@click.option(
    "--window", default="1h", show_default=True, metavar="DURATION",
    help="How far ahead the chart of jobs due looks (30m, 1h, 6h, 1d; 0: no chart).",
)  # fmt: skip
@click.option("--all-shards", is_flag=True, help=f"One row per shard even past {SHARD_ROWS} shards.")
@json_option
@click.pass_context
def status(ctx: click.Context, window: str, all_shards: bool, as_json: bool) -> None:
    """Shards, totals, beats, lateness, and a chart of the jobs due soon."""
    s = session(ctx)
    try:
        window_ms = parse_duration(window)
    except ValueError as exc:
        usage(f"--window: {exc}")
    if window_ms < 0 or window_ms > 31 * 86_400_000:
        usage(f"--window must be between 0 and 31d, got {window!r}")
    store = s.store
    stats = store.shard_stats()
    now = stats[0].now_ms
    bucket = _bucket_ms(window_ms)
    buckets = math.ceil(window_ms / bucket) if window_ms else 0
    counts = store.due_counts(now, bucket, buckets)
    beats = sorted(
        (_beat_view(token, raw, now) for token, raw in store.beats().items()),
        key=lambda b: (not b["alive"], -(b["seen_ms"] or 0) if isinstance(b["seen_ms"], int | float) else 0),
    )
    late = {
        kind: _lateness_view(lateness.read(store.client, store.config.prefix, kind))
        for kind in ("publish", "start")
    }
    heads = [st for st in stats if st.head_due_ms is not None]
    nexts = [st for st in stats if st.next_due_ms is not None]
    oldest = min(heads, key=lambda st: st.head_due_ms or 0) if heads else None
    soonest = min(nexts, key=lambda st: st.next_due_ms or 0) if nexts else None
    totals = {
        "waiting": sum(st.waiting for st in stats),
        "leased": sum(st.leased for st in stats),
        "dead": sum(st.dead for st in stats),
        "overdue": sum(st.overdue for st in stats),
        "schedules": sum(st.schedules for st in stats),
        "oldest_overdue": iso(oldest.head_due_ms) if oldest else None,
        "oldest_overdue_id": oldest.head_id if oldest else None,
        "next_due": iso(soonest.next_due_ms) if soonest else None,
        "next_due_id": soonest.next_id if soonest else None,
    }
    if as_json:
        s.emit_json(
            {
                "prefix": store.config.prefix,
                "url": s.url,
                "now": iso(now),
                "shards": [_shard_view(st) for st in stats],
                "totals": totals,
                "beats": beats,
                "lateness": late,
                "due": {"start": iso(now), "bucket_seconds": bucket // 1000, "counts": counts},
            }
        )
        return
    console = s.console()
    header = Text.assemble(
        ("delayq", "bold"), " prefix ", (store.config.prefix, "bold"),
        f", {len(stats)} shards at {s.url} (server time {s.when(now)})",
    )  # fmt: skip
    console.print(header)
    console.print()
    _print_shards(s, console, stats, totals, now, all_shards)
    console.print()
    _print_beats(s, console, beats, now)
    console.print()
    _print_lateness(console, late)
    if buckets:
        console.print()
        total = sum(counts)
        unit = "minute" if bucket == 60_000 else f"{bucket // 60_000} minutes"
        console.print(
            f"[bold]Jobs due per {unit}[/], next {ago(window_ms)}: {total:,} "
            f"(peak {max(counts):,} per {unit})"
        )
        labels = [s.hhmm(now + i * bucket) for i in range(buckets)]
        for line in chart_lines(counts, labels):
            console.print(Text(line))


def _print_shards(
    s: Session, console: Console, stats: list[ShardStats], totals: dict[str, Any], now: int, all_shards: bool
) -> None:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("SHARD", "WAITING", "LEASED", "DEAD", "OVERDUE"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("OLDEST OVERDUE", no_wrap=True)
    table.add_column("NEXT DUE", no_wrap=True)
    rows = stats
    hidden = 0
    if len(stats) > SHARD_ROWS and not all_shards:
        rows = [st for st in stats if st.stored or st.dead]
        hidden = len(stats) - len(rows)

    def late(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({ago(now - ms)} late)"

    def soon(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({relative(ms, now)})"

    for st in rows:
        _add(
            table,
            str(st.shard), f"{st.waiting:,}", f"{st.leased:,}", f"{st.dead:,}", f"{st.overdue:,}",
            late(st.head_due_ms), soon(st.next_due_ms),
        )  # fmt: skip
    oldest = min((st.head_due_ms for st in stats if st.head_due_ms is not None), default=None)
    soonest = min((st.next_due_ms for st in stats if st.next_due_ms is not None), default=None)
    table.add_section()
    _add(
        table,
        "total", f"{totals['waiting']:,}", f"{totals['leased']:,}", f"{totals['dead']:,}",
        f"{totals['overdue']:,}", late(oldest), soon(soonest), style="bold",
    )  # fmt: skip
    console.print(table)
    if hidden:
        console.print(f"({hidden} empty shards not shown; --all-shards shows them)")
    console.print(f"recurring schedules: {totals['schedules']:,}")


def _print_beats(s: Session, console: Console, beats: list[dict[str, Any]], now: int) -> None:
    if not beats:
        console.print("[bold]Beats[/]: no beat seen")
        return
    alive = sum(1 for b in beats if b["alive"])
    console.print(f"[bold]Beats[/]: {alive} alive, {len(beats) - alive} stale (alive: seen in the last 60 s)")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("BEAT", "STATE", "SEEN", "UP", "PASSES", "PUBLISHED", "DEAD", "ERRORS"):
        table.add_column(
            name,
            no_wrap=True,
            justify="right" if name in ("PASSES", "PUBLISHED", "DEAD", "ERRORS") else "left",
        )

    def num(v: Any) -> str:
        return f"{v:,}" if isinstance(v, int) else "-"

    for b in beats:
        seen, started = b["seen_ms"], b["started_ms"]
        _add(
            table,
            b["token"],
            "alive" if b["alive"] else ("unreadable" if b.get("error") else "stale"),
            f"{ago(now - seen)} ago" if isinstance(seen, int | float) else "-",
            ago(now - started) if isinstance(started, int | float) else "-",
            num(b["passes"]), num(b["published"]), num(b["dead_lettered"]), num(b["errors"]),
        )  # fmt: skip
    console.print(table)


def _print_lateness(console: Console, late: dict[str, dict[str, Any]]) -> None:
    console.print("[bold]Lateness[/] (histogram buckets: p50 ≤ 5 ms means at most 5 ms)")

    def ms(v: float | None) -> str:
        if v is None:
            return f"> {lateness.BOUNDS[-1] / 1000:g} s"
        return f"≤ {v:g} ms" if v < 1000 else f"≤ {v / 1000:g} s"

    for kind, label in (("publish", "due → publish"), ("start", "due → start  ")):
        view = late[kind]
        n, mean = view["count"], view["mean_ms"]
        if not n:
            hint = "" if kind == "publish" else " (workers record it with delayq_record_lateness)"
            console.print(Text(f"  {label}  none recorded{hint}"))
            continue
        average = f"{mean:.1f} ms" if mean < 1000 else f"{mean / 1000:.2f} s"
        console.print(
            Text(
                f"  {label}  p50 {ms(view['p50_ms'])}  p99 {ms(view['p99_ms'])}  mean {average}  ({n:,} jobs)"
            )
        )


# -- schedules ----------------------------------------------------------------------------------


@delayq.group("schedules", cls=DelayqGroup, short_help="Recurring schedules.")
def schedules_group() -> None:
    """Recurring schedules: ls, show, add, update, pause, resume, rm, run-now."""


def _schedule_rows(s: Session, sch: Schedule) -> list[tuple[str, Any]]:
    now = time.time() * 1000

    def when(dt: datetime | None) -> str | None:
        if dt is None:
            return None
        ms = dt.timestamp() * 1000
        return f"{s.when(ms)} ({relative(ms, now)})"

    return [
        ("name", sch.name),
        ("task", sch.task),
        ("rule", sch.rule.describe()),
        ("timezone", sch.tz),
        ("state", "active" if sch.enabled else "paused"),
        ("next run", when(sch.next_run)),
        ("last run", when(sch.last_run)),
        ("last task id", sch.last_task_id),
        ("runs", str(sch.run_count)),
        ("args", sch.args),
        ("kwargs", sch.kwargs),
        ("options", sch.options),
        ("missed", f"{sch.missed} (max {sch.max_missed}, grace {sch.grace:g} s)"),
        ("origin", sch.origin),
        ("created", s.when(sch.created.timestamp() * 1000)),
        ("updated", s.when(sch.updated.timestamp() * 1000)),
    ]


def schedule_json(sch: Schedule) -> dict[str, Any]:
    """``Schedule.to_json()`` with its times as the CLI writes every time (UTC, ms, ``Z``)."""
    out = sch.to_json()
    for name in ("created", "updated", "last_run", "next_run"):
        value = getattr(sch, name)
        out[name] = iso(value.timestamp() * 1000) if value is not None else None
    return out


def _print_schedule(s: Session, sch: Schedule, as_json: bool, title: str | None = None) -> None:
    if as_json:
        s.emit_json(schedule_json(sch))
    else:
        s.console().print(_kv_table(title or f"schedule {sch.name}", _schedule_rows(s, sch)))


@schedules_group.command("ls", short_help="List the schedules.")
@click.option("--task", help="Only the schedules of this task.")
@click.option("--paused/--active", "paused", default=None, help="Only paused (or only active) schedules.")
@json_option
@click.pass_context
def schedules_ls(ctx: click.Context, task: str | None, paused: bool | None, as_json: bool) -> None:
    """Every recurring schedule, by name."""
    s = session(ctx)
    enabled = None if paused is None else not paused
    found = sorted(s.schedules.list(task=task, enabled=enabled), key=lambda x: x.name)
    if as_json:
        s.emit_json({"schedules": [schedule_json(x) for x in found], "count": len(found)})
        return
    console = s.console()
    if not found:
        console.print("no schedules")
        return
    now = time.time() * 1000
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("NAME", "TASK", "RULE", "STATE", "NEXT RUN", "", "LAST RUN", "RUNS"):
        table.add_column(name, no_wrap=True, justify="right" if name == "RUNS" else "left")
    for x in found:
        nxt = x.next_run.timestamp() * 1000 if x.next_run else None
        last = x.last_run.timestamp() * 1000 if x.last_run else None
        _add(
            table,
            x.name, x.task, x.rule.describe(), "active" if x.enabled else "paused",
            s.when(nxt), relative(nxt, now) if nxt else "", s.when(last), f"{x.run_count:,}",
        )  # fmt: skip
    console.print(table)


@schedules_group.command("show", short_help="Everything about one schedule.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Everything about one schedule, with its run history."""
    s = session(ctx)
    sch = s.schedules.get(name)
    if sch is None:
        raise CliError(f"no schedule named {name!r}")
    _print_schedule(s, sch, as_json)


def _rule_of(s: Session, cron: str | None, every: str | None, at: str | None, required: bool) -> Any:
    given = [x for x in (cron, every, at) if x is not None]
    if len(given) > 1:
        usage("give one of --cron, --every or --at")
    if not given:
        if required:
            usage("give the rule: --cron '0 9 * * 1-5', --every 30s or --at 2026-12-01T09:00:00Z")
        return None
    if cron is not None:
        return cron
    if every is not None:
        try:
            every_ms = parse_duration(every)
        except ValueError as exc:
            usage(f"--every: {exc}")
        if every_ms <= 0:
            usage(f"--every must be longer than 0, got {every!r}")
        return timedelta(milliseconds=every_ms)
    assert at is not None
    return ms_to_datetime(_when(at, s, "--at"))


def _schedule_options(f: F) -> F:
    decorators = [
        click.option("--cron", metavar="EXPR", help="Cron expression: 5 fields, or 6 with seconds last."),
        click.option("--every", metavar="DURATION", help="Fixed interval: 30s, 5m, 1h30m, 1d."),
        click.option("--at", metavar="WHEN", help="Once, at WHEN (ISO-8601, UNIX seconds, +10m)."),
        click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON array."),
        click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, a JSON object."),
        click.option("--tz", help="IANA timezone of a cron rule (default: the app's timezone, else UTC)."),
        click.option("--queue", help="Queue to publish to (an apply_async option)."),
        click.option("--options", "options_json", metavar="JSON", help="apply_async options, a JSON object."),
        click.option("--missed", type=click.Choice(["once", "skip", "all"]), help="Missed-run policy."),
        click.option("--max-missed", type=click.IntRange(min=1), help="Most missed runs made (missed=all)."),
        click.option("--grace", type=click.FloatRange(min=0), help="Seconds late before a run is missed."),
    ]
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _options_value(options_json: str | None, queue: str | None, base: dict[str, Any] | None) -> Any:
    options = _json_value(options_json, "--options", dict)
    if options is None and queue is None:
        return None
    merged = dict(base or {}) if options is None else dict(options)
    if queue is not None:
        merged["queue"] = queue
    return merged


@schedules_group.command("add", short_help="Create a schedule.")
@click.argument("name")
@click.argument("task")
@_schedule_options
@click.option("--paused", is_flag=True, help="Store it paused (resume starts it).")
@click.option("--no-check-task", is_flag=True, help="Accept a task this app does not know.")
@click.option("--replace", is_flag=True, help="Replace a schedule of that name (keeps its run history).")
@json_option
@click.pass_context
def schedules_add(
    ctx: click.Context,
    name: str,
    task: str,
    cron: str | None,
    every: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    tz: str | None,
    queue: str | None,
    options_json: str | None,
    missed: str | None,
    max_missed: int | None,
    grace: float | None,
    paused: bool,
    no_check_task: bool,
    replace: bool,
    as_json: bool,
) -> None:
    """Create schedule NAME running TASK on a rule (--cron, --every or --at)."""
    s = session(ctx)
    rule = _rule_of(s, cron, every, at, required=True)
    args = _json_value(args_json, "--args", list)
    kwargs = _json_value(kwargs_json, "--kwargs", dict)
    options = _options_value(options_json, queue, None)
    if not no_check_task:
        s.app.loader.import_default_modules()  # the modules in `imports`/`include`, as a worker does
    settings: dict[str, Any] = {
        "tz": tz,
        "enabled": not paused,
        "options": options,
        "check_task": not no_check_task,
    }
    if missed is not None:
        settings["missed"] = missed
    if max_missed is not None:
        settings["max_missed"] = max_missed
    if grace is not None:
        settings["grace"] = grace
    schedules = s.schedules
    call = schedules.upsert if replace else schedules.add
    try:
        sch = call(name, task, rule, args, kwargs, **settings)
    except TypeError as exc:  # Celery's check of the arguments against the task's signature
        if isinstance(exc, ScheduleError):
            raise
        usage(f"the arguments do not fit task {task!r}: {exc}")
    _print_schedule(s, sch, as_json, title=f"schedule {sch.name} stored")


@schedules_group.command("update", short_help="Change a schedule.")
@click.argument("name")
@_schedule_options
@click.option("--task", help="Run this task instead.")
@json_option
@click.pass_context
def schedules_update(
    ctx: click.Context,
    name: str,
    cron: str | None,
    every: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    tz: str | None,
    queue: str | None,
    options_json: str | None,
    missed: str | None,
    max_missed: int | None,
    grace: float | None,
    task: str | None,
    as_json: bool,
) -> None:
    """Change some fields of schedule NAME; a new rule counts from now."""
    s = session(ctx)
    changes: dict[str, Any] = {}
    rule = _rule_of(s, cron, every, at, required=False)
    if rule is not None:
        changes["rule"] = rule
    if args_json is not None:
        changes["args"] = _json_value(args_json, "--args", list)
    if kwargs_json is not None:
        changes["kwargs"] = _json_value(kwargs_json, "--kwargs", dict)
    if tz is not None:
        changes["tz"] = tz
    if task is not None:
        changes["task"] = task
    for key, value in (("missed", missed), ("max_missed", max_missed), ("grace", grace)):
        if value is not None:
            changes[key] = value
    schedules = s.schedules
    if options_json is not None or queue is not None:
        current = schedules.get(name)
        if current is None:
            raise CliError(f"no schedule named {name!r}")
        changes["options"] = _options_value(options_json, queue, current.options)
    if not changes:
        usage("nothing to change: give --cron/--every/--at, --args, --kwargs, --tz, --queue, --options, ...")
    if task is not None:
        s.app.loader.import_default_modules()
    try:
        sch = schedules.update(name, **changes)
    except TypeError as exc:
        if isinstance(exc, ScheduleError):
            raise
        usage(f"the arguments do not fit the task of schedule {name!r}: {exc}")
    _print_schedule(s, sch, as_json, title=f"schedule {sch.name} updated")


@schedules_group.command("pause", short_help="Stop running a schedule.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_pause(ctx: click.Context, name: str, as_json: bool) -> None:
    """Stop running schedule NAME (its waiting run is removed)."""
    s = session(ctx)
    _print_schedule(s, s.schedules.pause(name), as_json, title=f"schedule {name} paused")


@schedules_group.command("resume", short_help="Run a paused schedule again.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Run schedule NAME again, from now on."""
    s = session(ctx)
    _print_schedule(s, s.schedules.resume(name), as_json, title=f"schedule {name} resumed")


@schedules_group.command("rm", short_help="Delete schedules.")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
@json_option
@click.pass_context
def schedules_rm(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Delete schedules and their waiting runs."""
    s = session(ctx)
    results = []
    for name in names:
        gone = s.schedules.delete(name)
        results.append(
            {"name": name, "outcome": "deleted" if gone else MISSING,
             "message": "deleted" if gone else f"no schedule named {name!r}"}
        )  # fmt: skip
    _report_named(s, results, as_json)


def _report_named(s: Session, results: list[dict[str, Any]], as_json: bool) -> None:
    failed = [r for r in results if r["outcome"] == MISSING]
    if as_json:
        s.emit_json({"results": results})
    else:
        for r in results:
            if r["outcome"] != MISSING:
                click.echo(f"{r['name']}: {r['message']}")
    for r in failed:
        click.echo(f"Error: {r['message']}", err=True)
    if failed:
        raise click.exceptions.Exit(EXIT_NOT_DONE)


@schedules_group.command("run-now", short_help="Run a schedule's task once, now.")
@click.argument("name")
@json_option
@click.pass_context
def schedules_run_now(ctx: click.Context, name: str, as_json: bool) -> None:
    """Run schedule NAME's task once now, outside its rule (the schedule is unchanged)."""
    s = session(ctx)
    result = s.schedules.run_now(name)
    due_ms = result.due.timestamp() * 1000 if result.due else None
    if as_json:
        s.emit_json({"name": name, "id": result.id, "due": iso(due_ms), "created": result.created})
    else:
        click.echo(f"{name}: stored {result.id}, due {s.when(due_ms)}")


# -- dead letters -------------------------------------------------------------------------------


@delayq.group("dead", cls=DelayqGroup, short_help="Dead-lettered jobs.")
def dead_group() -> None:
    """Dead-lettered jobs (a beat could not publish them): ls, show, requeue, rm."""


def _dead_view(s: Session, job_id: str, record: dict[str, Any], detail: bool = False) -> dict[str, Any]:
    envelope_text = record.get("envelope") or ""
    job = JobRecord(
        job_id,
        s.store.keys.shard_of(job_id),
        int(record.get("due") or 0),
        loaded_form(job_id, envelope_text) if isinstance(envelope_text, str) else "",
        "dead",
        int(record.get("tries") or 0),
    )
    view = job_view(job, s.app.conf.task_default_queue, detail=detail)
    if view["task"] in (None, "<corrupt envelope>") and record.get("task"):
        view["task"] = record["task"]
    dead_at = record.get("dead_at")
    dead = {
        "reason": record.get("reason"),
        "dead_at": iso(dead_at) if isinstance(dead_at, int | float) else None,
        "beat": record.get("beat"),
    }
    if detail:
        view["dead"] = dead
    else:
        view.update(reason=dead["reason"], dead_at=dead["dead_at"], dead_at_ms=dead_at)
    return view


@dead_group.command("ls", short_help="List dead letters, newest first.")
@click.option("--task", help="Only the dead letters of this task.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0)
@json_option
@click.pass_context
def dead_ls(ctx: click.Context, task: str | None, limit: int, offset: int, as_json: bool) -> None:
    """Dead letters, newest first (reads them all: HSCAN of each shard)."""
    s = session(ctx)
    views = [_dead_view(s, job_id, record) for job_id, record in s.dq.dead()]
    if task:
        views = [v for v in views if v["task"] == task]
    views.sort(key=lambda v: (-(v["dead_at_ms"] or 0), v["id"]))
    total = len(views)
    page = views[offset : offset + limit]
    if as_json:
        s.emit_json({"dead": page, "count": len(page), "total": total})
        return
    console = s.console()
    if not page:
        console.print("no dead letters")
        return
    now = time.time() * 1000
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("ID", "TASK", "DEAD", "DUE", "TRIES", "REASON"):
        table.add_column(name, no_wrap=name != "REASON", overflow="fold" if name == "REASON" else "ellipsis")
    for v in page:
        dead_ms = v["dead_at_ms"]
        _add(
            table,
            v["id"], v["task"] or "?", f"{ago(now - dead_ms)} ago" if dead_ms else "-",
            s.when(v["due_ms"]), str(v["tries"]), _short(v["reason"] or "", 80),
        )  # fmt: skip
    console.print(table)
    if total > offset + len(page):
        console.print(f"{len(page)} of {total} shown; more with --offset {offset + len(page)}")


@dead_group.command("show", short_help="Everything about one dead letter.")
@click.argument("job_id", metavar="ID")
@json_option
@click.pass_context
def dead_show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Everything about one dead letter: why, when, and the message it holds."""
    s = session(ctx)
    record = s.store.dead_record(job_id)
    if record is None:
        raise CliError(f"no dead letter with id {job_id!r}")
    view = _dead_view(s, job_id, record, detail=True)
    if as_json:
        s.emit_json(view)
    else:
        _print_job(s, view)


@dead_group.command("requeue", short_help="Put dead letters back as waiting jobs.")
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True)
@click.option("--at", "when", metavar="WHEN", help="Due at WHEN instead of now.")
@json_option
@click.pass_context
def dead_requeue(ctx: click.Context, job_ids: tuple[str, ...], when: str | None, as_json: bool) -> None:
    """Put dead letters back as waiting jobs (due now, or --at WHEN); their dead letters go."""
    s = session(ctx)
    due_ms = _when(when, s, "--at") if when else None
    texts = {
        MISSING: "no dead letter with id {id!r}",
        "stored": "{id!r} not requeued: a job with this id is stored (see `delayq show {id}`)",
        NO_ENVELOPE: "{id!r} not requeued: its dead letter holds no message",
    }
    results = []
    for job_id in job_ids:
        at = due_ms if due_ms is not None else s.store.server_now_ms()
        outcome = s.dq.requeue_dead(job_id, at / 1000.0)
        message = f"requeued, due {s.when(at)}" if outcome == REQUEUED else texts[outcome].format(id=job_id)
        results.append({"id": job_id, "outcome": outcome, "message": message, "due": iso(at)})
    _report(s, results, {REQUEUED}, as_json)


@dead_group.command("rm", short_help="Forget dead letters.")
@click.argument("job_ids", metavar="ID...", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of this prefix (asks first).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (--all).")
@json_option
@click.pass_context
def dead_rm(ctx: click.Context, job_ids: tuple[str, ...], all_: bool, yes: bool, as_json: bool) -> None:
    """Forget dead letters (the jobs are not run)."""
    s = session(ctx)
    if all_ == bool(job_ids):
        usage("give dead letter ids, or --all")
    if all_:
        total = s.store.count_dead()
        if not yes:
            click.confirm(
                f"Delete all {total:,} dead letters under prefix {s.store.config.prefix!r} at {s.url}?",
                abort=True,
                err=True,
            )
        removed = s.dq.delete_all_dead()
        if as_json:
            s.emit_json({"removed": removed})
        else:
            click.echo(f"removed {removed:,} dead letter(s)")
        return
    results = []
    for job_id in job_ids:
        gone = s.dq.delete_dead(job_id)
        results.append(
            {"id": job_id, "outcome": "deleted" if gone else MISSING,
             "message": "deleted" if gone else f"no dead letter with id {job_id!r}"}
        )  # fmt: skip
    _report(s, results, {"deleted"}, as_json)


def iter_commands(group: click.Group = delayq, prefix: str = "") -> Iterator[str]:
    """Every command path of the CLI (``ls``, ``schedules add``, ...), for the docs test.

    >>> "dead requeue" in list(iter_commands())
    True
    """
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from iter_commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name
