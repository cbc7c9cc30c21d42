"""The options of a ``delayq`` Spark write and read, parsed and checked on the driver: where
the jobs live (:class:`StoreOptions`: a Redis URL, or the Celery app whose ``delayq_*``
settings to use), which task and columns a write takes (:class:`WriteOptions`), and which
due window and shards a read lists (:class:`ReadOptions`). Spark hands options over as
strings, case-insensitively; every mistake raises :class:`~celery_delayq.exceptions.ConfigurationError`
here, with a message that names the option as the user spelled it.

>>> opts = WriteOptions.parse({"url": "redis://127.0.0.1:6390/0", "task": "t.remind",
...                            "kwargs": "user_id", "idTemplate": "r:{user_id}:{day}"})
>>> opts.kwargs, opts.id_fields
(('user_id',), ('day', 'user_id'))
>>> opts.job_id({"user_id": 7, "day": "2026-11-21"})
'r:7:2026-11-21'
"""

from __future__ import annotations

import json
import math
import string
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import DEFAULTS, DelayQConfig, setting_name
from ..due import MAX_DUE_MS, due_ms_from_eta
from ..exceptions import ConfigurationError, InvalidDueTime, InvalidOptions, UnknownTask
from ..producer.build import build_envelopes
from ..producer.options import unique_window_ms

__all__ = ["ReadOptions", "StoreOptions", "WriteOptions"]

# Options the two sides take (Spark hands them over case-insensitively; so does parse()).
_STORE_OPTIONS = ("url", "app", "prefix", "shards", "cluster", "timezone")
_WRITE_ONLY = (
    "task", "duecolumn", "args", "kwargs", "argscolumn", "kwargscolumn", "idcolumn", "idtemplate",
    "queue", "priority", "routingkey", "expires", "options", "replace", "batchsize", "uniquefor",
)  # fmt: skip
_READ_ONLY = ("duefrom", "dueuntil", "includedead", "pagesize")
_SPELLING = {
    name.lower(): name
    for name in (
        "dueColumn", "argsColumn", "kwargsColumn", "idColumn", "idTemplate", "routingKey",
        "batchSize", "dueFrom", "dueUntil", "includeDead", "pageSize", "uniqueFor", "checkpointLocation",
    )
}  # fmt: skip
_NUMERIC = ("tinyint", "smallint", "int", "bigint", "float", "double", "decimal")


def _spelled(name: str) -> str:
    return _SPELLING.get(name, name)


def _lower(options: Mapping[str, Any], allowed: Sequence[str], side: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in options.items():
        name = str(key).lower()
        if name not in allowed:
            known = ", ".join(sorted(_spelled(a) for a in allowed))
            raise ConfigurationError(f"delayq {side}: unknown option {key!r}; the options are: {known}")
        if value is not None:
            out[name] = str(value)
    return out


def _flag(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {_spelled(name)} must be true or false, got {value!r}")


def _integer(name: str, value: str | None, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(f"option {_spelled(name)} must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ConfigurationError(f"option {_spelled(name)} must be between {low} and {high}, got {number}")
    return number


def _columns(name: str, value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    names = tuple(part.strip() for part in value.split(","))
    if not all(names):
        raise ConfigurationError(
            f"option {_spelled(name)} must be comma-separated column names, got {value!r}"
        )
    return names


# -- the store and the app --------------------------------------------------------------------


@dataclass(frozen=True)
class StoreOptions:
    """Where the jobs live: a Redis URL and the app's prefix and shard count (or an app to read
    them from). Picklable: Spark ships it to every executor, which opens its own client."""

    url: str | None = None
    app: str | None = None
    prefix: str | None = None
    shards: int | None = None
    cluster: bool | None = None
    timezone: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> StoreOptions:
        shards = options.get("shards")
        cluster = options.get("cluster")
        made = cls(
            url=options.get("url"),
            app=options.get("app"),
            prefix=options.get("prefix"),
            shards=None if shards is None else _integer("shards", shards, 16, 1, 1 << 20),
            cluster=None if cluster is None else _flag("cluster", cluster, False),
            timezone=options.get("timezone"),
        )
        made.config()  # every mistake in these options is reported now, on the driver
        return made

    def celery_app(self) -> Any:
        """The Celery app the jobs are built with: the named one, or a bare app (a task it
        does not have is then scheduled by name, with the app's defaults, as ``send_task``)."""
        key = (self.app, self.timezone)
        with _APPS_LOCK:
            app = _APPS.get(key)
            if app is None:
                app = _load_app(self.app, self.timezone)
                _APPS[key] = app
        return app

    def config(self) -> DelayQConfig:
        app = self.celery_app()
        if self.app is None:
            if not self.url:
                raise ConfigurationError(
                    "delayq: option url is required (the store's Redis URL), or option app naming "
                    "the Celery app whose delayq_* settings to use, e.g. 'proj.celery:app'"
                )
            values: dict[str, Any] = {"delayq_url": self.url}
            if self.prefix is not None:
                values["delayq_prefix"] = self.prefix
            if self.shards is not None:
                values["delayq_shards"] = self.shards
            if self.cluster is not None:
                values["delayq_cluster"] = self.cluster
            return DelayQConfig.from_mapping(values)
        base = DelayQConfig.from_app(app)
        for name, given, own in (("prefix", self.prefix, base.prefix), ("shards", self.shards, base.shards)):
            if given is not None and given != own:
                raise ConfigurationError(
                    f"option {name}={given!r} does not match "
                    f"{setting_name(app, 'delayq_' + name)}={own!r} of app {self.app!r}: "
                    "jobs written with another prefix or shard count are never seen by its beats"
                )
        values = {f"delayq_{name}": getattr(base, name) for name in _CONFIG_NAMES}
        if self.url:
            values["delayq_url"] = self.url
        if self.cluster is not None:
            values["delayq_cluster"] = self.cluster
        return DelayQConfig.from_mapping(values)


_CONFIG_NAMES = tuple(name.removeprefix("delayq_") for name in DEFAULTS)
_APPS: dict[tuple[str | None, str | None], Any] = {}
_APPS_LOCK = threading.Lock()


def _load_app(ref: str | None, timezone: str | None) -> Any:
    from celery import Celery

    if ref is None:
        app = Celery("delayq-spark", set_as_current=False)
        if timezone:
            app.conf.timezone = timezone
        return app
    from celery.app.utils import find_app

    try:
        app = find_app(ref)
    except Exception as exc:
        raise ConfigurationError(
            f"option app={ref!r}: cannot load the Celery app ({type(exc).__name__}: {exc}); give "
            "'module:attribute' importable where Spark runs Python (the driver and every executor)"
        ) from exc
    if timezone:
        raise ConfigurationError("option timezone is taken from the app when option app is given")
    return app


# -- writing ------------------------------------------------------------------------------------

#: The streaming sink's default ``uniqueFor`` (7 days): how long a replayed micro-batch is
#: kept from storing its rows' jobs again, and how long the sink remembers each query's commits.
STREAM_UNIQUE_FOR = 7 * 86_400


@dataclass(frozen=True)
class WriteOptions:
    """A validated write: which task, which columns, which options (see ``docs/spark.md``)."""

    store: StoreOptions
    task: str
    due: str = "due"
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    args_column: str | None = None
    kwargs_column: str | None = None
    id_column: str | None = None
    id_template: str | None = None
    id_fields: tuple[str, ...] = ()
    call_options: tuple[tuple[str, Any], ...] = ()
    replace: bool = False
    batch_size: int = 5000
    unique_ms: int | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any], stream: bool = False) -> WriteOptions:
        """Read and check Spark's string options; every mistake raises ConfigurationError here.

        ``stream`` (``writeStream``): every write has a uniqueness window, ``uniqueFor``
        (:data:`STREAM_UNIQUE_FOR` when not given), and ids from the rows are optional (a row
        without one gets its place in the stream: query, micro-batch, partition, row);
        ``replace`` is refused (a replayed micro-batch would overwrite its own jobs)."""
        if stream:  # Spark adds checkpointLocation to a stream's options; the sink does not read it
            opts = _lower(options, (*_STORE_OPTIONS, *_WRITE_ONLY, "checkpointlocation"), "writeStream")
            opts.pop("checkpointlocation", None)
        else:
            opts = _lower(options, _STORE_OPTIONS + _WRITE_ONLY, "write")
        store = StoreOptions.parse(opts)
        task = opts.get("task", "").strip()
        if not task:
            raise ConfigurationError("delayq write: option task is required (the task's registered name)")
        args, kwargs = _columns("args", opts.get("args")), _columns("kwargs", opts.get("kwargs"))
        args_column, kwargs_column = opts.get("argscolumn"), opts.get("kwargscolumn")
        if args and args_column:
            raise ConfigurationError("options args and argsColumn exclude each other: give one")
        if kwargs and kwargs_column:
            raise ConfigurationError("options kwargs and kwargsColumn exclude each other: give one")
        id_column, id_template = opts.get("idcolumn"), opts.get("idtemplate")
        if id_column and id_template:
            raise ConfigurationError("options idColumn and idTemplate exclude each other: give one")
        id_fields: tuple[str, ...] = ()
        if id_template is not None:
            id_fields = _template_fields(id_template)
        call: dict[str, Any] = {}
        if "options" in opts:
            try:
                extra = json.loads(opts["options"])
            except ValueError as exc:
                raise ConfigurationError(f"option options must be a JSON object: {exc}") from None
            if not isinstance(extra, dict):
                raise ConfigurationError("option options must be a JSON object of apply_async options")
            call.update(extra)
        for name in ("task_id", "replace", "eta", "countdown", "unique_for", "debounce", "throttle"):
            if name in call:
                raise ConfigurationError(
                    f"option options may not set {name!r}: ids come from idColumn/idTemplate, the due "
                    "time from dueColumn, replace and uniqueFor are options of their own, and debounce and "
                    "throttle are apply_async's alone (one job a key at a time)"
                )
        if "queue" in opts:
            call["queue"] = opts["queue"]
        if "routingkey" in opts:
            call["routing_key"] = opts["routingkey"]
        if "priority" in opts:
            call["priority"] = _integer("priority", opts["priority"], 0, 0, 255)
        if "expires" in opts:
            try:
                expires = float(opts["expires"])
            except ValueError:
                expires = math.nan
            if not math.isfinite(expires) or expires < 0:
                raise ConfigurationError(
                    f"option expires must be seconds after the due time (>= 0), got {opts['expires']!r}"
                )
            call["expires"] = expires
        replace = _flag("replace", opts.get("replace"), False)
        if stream and replace:
            raise ConfigurationError(
                "delayq writeStream: option replace is refused: a micro-batch that Spark writes "
                "again after a failure would overwrite the jobs it stored the first time"
            )
        unique_ms = None
        if stream and "uniquefor" not in opts:
            opts["uniquefor"] = str(STREAM_UNIQUE_FOR)
        if "uniquefor" in opts:
            if not (id_column or id_template or stream):
                raise ConfigurationError(
                    "option uniqueFor needs the jobs' ids from the rows: give idColumn or idTemplate"
                )
            try:
                unique_ms = unique_window_ms(float(opts["uniquefor"]), "(rows' ids)", replace, task)
            except (ValueError, InvalidOptions) as exc:
                raise ConfigurationError(
                    f"option uniqueFor must be seconds > 0 (at most 10 years), without replace=true; "
                    f"got {opts['uniquefor']!r}"
                ) from exc
        made = cls(
            store=store,
            task=task,
            due=opts.get("duecolumn", "due"),
            args=args,
            kwargs=kwargs,
            args_column=args_column,
            kwargs_column=kwargs_column,
            id_column=id_column,
            id_template=id_template,
            id_fields=id_fields,
            call_options=tuple(sorted(call.items())),
            replace=replace,
            batch_size=_integer("batchSize", opts.get("batchsize"), 5000, 1, 1_000_000),
            unique_ms=unique_ms,
        )
        made.check_options()
        return made

    def columns_used(self) -> list[str]:
        """Every input column the write reads."""
        return list(dict.fromkeys([self.due, *self.row_columns()]))

    def row_columns(self) -> list[str]:
        """The columns read for a job's arguments and id (the due column among them when it is
        also an argument or an id field: the task gets its value as the row has it)."""
        names = [*self.args, *self.kwargs]
        names += [c for c in (self.args_column, self.kwargs_column, self.id_column) if c]
        names += self.id_fields
        return list(dict.fromkeys(names))

    def task_of(self, app: Any) -> Any:
        """The task object when an app was named (it must have the task), else the name."""
        if not self.store.app:
            return self.task
        task = app.tasks.get(self.task)
        if task is None:
            raise UnknownTask(
                f"app {self.store.app!r} has no task {self.task!r}; its tasks: "
                + ", ".join(sorted(name for name in app.tasks if not name.startswith("celery.")))
            )
        return task

    def check_options(self) -> None:
        """Build one envelope with these options (a bad queue, priority or option raises here)."""
        app = self.store.celery_app()
        task = self.task_of(app)
        try:
            build_envelopes(app, task, [("delayq-check", 0, None, None)], dict(self.call_options))
        except TypeError as exc:  # the task's signature: checked per row, not here
            if "argument" not in str(exc):
                raise

    def check_schema(self, types: Mapping[str, str]) -> None:
        """Refuse a DataFrame the write cannot read: ``types`` maps column name -> Spark type
        (``simpleString``). Called on the driver before any row is read."""
        missing = [name for name in self.columns_used() if name not in types]
        if missing:
            raise ConfigurationError(
                f"delayq write: no column {', '.join(map(repr, missing))} in the DataFrame "
                f"(its columns: {', '.join(types)})"
            )
        due = types[self.due]
        if not (due.startswith(("timestamp", "string")) or due.startswith(_NUMERIC)):
            raise ConfigurationError(
                f"due column {self.due!r} is {due}: it must be a timestamp, epoch seconds (a number) "
                "or an ISO-8601 string"
            )
        if self.args_column and not types[self.args_column].startswith(("array", "string")):
            raise ConfigurationError(
                f"argsColumn {self.args_column!r} is {types[self.args_column]}: it must be an array "
                "or a JSON string"
            )
        if self.kwargs_column and not types[self.kwargs_column].startswith(("struct", "map", "string")):
            raise ConfigurationError(
                f"kwargsColumn {self.kwargs_column!r} is {types[self.kwargs_column]}: it must be a "
                "struct, a map or a JSON string"
            )
        self._check_serializable(types)

    def _check_serializable(self, types: Mapping[str, str]) -> None:
        """Refuse an argument column of a type the task's serializer cannot carry: JSON has no
        interval (Python's ``timedelta``), so every row would fail in the executor."""
        app = self.store.celery_app()
        task = self.task_of(app)
        call = dict(self.call_options)
        serializer = call.get("serializer") or getattr(task, "serializer", None) or app.conf.task_serializer
        if serializer != "json":
            return
        columns = [*self.args, *self.kwargs, *(c for c in (self.args_column, self.kwargs_column) if c)]
        for name in dict.fromkeys(columns):
            if "interval" in types[name]:
                raise ConfigurationError(
                    f"delayq write: argument column {name!r} is {types[name]}, which the task's "
                    "serializer (json) cannot carry (a timedelta): pass it as a number of seconds "
                    "or as a string"
                )

    def job_id(self, row: Mapping[str, Any]) -> str | None:
        """The job id of ``row`` (None: a random one, as apply_at makes)."""
        if self.id_column is not None:
            value = row[self.id_column]
            if value is None:
                raise InvalidOptions(f"id column {self.id_column!r} is null")
            return str(value)
        if self.id_template is not None:
            return self.template_id({name: row[name] for name in self.id_fields})
        return None

    def template_id(self, values: Mapping[str, Any]) -> str:
        """``idTemplate`` filled with one row's ``values``; a value the template cannot format
        (``{due:%Y%m%d}`` of a number, ``{user.name}`` of a string) raises InvalidOptions."""
        assert self.id_template is not None
        try:
            return self.id_template.format_map(values)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            given = ", ".join(f"{name}={values[name]!r}" for name in self.id_fields)
            raise InvalidOptions(
                f"idTemplate {self.id_template!r} cannot format {given}: {type(exc).__name__}: {exc}"
            ) from None


def _template_fields(template: str) -> tuple[str, ...]:
    names: set[str] = set()
    try:
        for _, name, _, _ in string.Formatter().parse(template):
            if name is None:
                continue
            base = name.split(".", 1)[0].split("[", 1)[0]
            if not base or base.isdigit():
                raise ConfigurationError(
                    f"idTemplate {template!r}: every field must name a column, like {{user_id}}"
                )
            names.add(base)
    except ValueError as exc:
        raise ConfigurationError(f"idTemplate {template!r} is not a format string: {exc}") from None
    if not names:
        raise ConfigurationError(f"idTemplate {template!r} names no column: every row would get the same id")
    return tuple(sorted(names))


# -- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadOptions:
    """A validated read: the store, an optional due window (inclusive ms) and which shards."""

    store: StoreOptions
    due_from: int | None = None
    due_until: int | None = None
    include_dead: bool = True
    page_size: int = 5000
    shards: tuple[int, ...] | None = field(default=None)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> ReadOptions:
        opts = _lower(options, _STORE_OPTIONS + _READ_ONLY, "read")
        store = StoreOptions.parse(opts)
        app = store.celery_app()
        bounds: list[int | None] = []
        for name in ("duefrom", "dueuntil"):
            value = opts.get(name)
            if value is None:
                bounds.append(None)
                continue
            try:
                number: Any = float(value)
            except ValueError:
                number = value
            try:
                bounds.append(due_ms_from_eta(number, app, naive_in_zone=True))
            except InvalidDueTime as exc:
                raise ConfigurationError(f"option {_spelled(name)}: {exc}") from None
        return cls(
            store=store,
            due_from=bounds[0],
            due_until=bounds[1],
            include_dead=_flag("includedead", opts.get("includedead"), True),
            page_size=_integer("pageSize", opts.get("pagesize"), 5000, 1, 100_000),
        )

    def narrowed(self, low: int | None, high: int | None, shards: Iterable[int] | None) -> ReadOptions:
        """These options with the due window intersected with ``[low, high]`` and the shards
        limited to ``shards`` (what a pushed-down filter asks for)."""
        due_from = max(x for x in (low, self.due_from, -1) if x is not None)
        due_until = min(x for x in (high, self.due_until, MAX_DUE_MS) if x is not None)
        chosen = self.shards
        if shards is not None:
            wanted = set(shards)
            chosen = tuple(sorted(wanted if chosen is None else wanted.intersection(chosen)))
        return ReadOptions(
            self.store,
            None if due_from < 0 else due_from,
            None if due_until == MAX_DUE_MS else due_until,
            self.include_dead,
            self.page_size,
            chosen,
        )
