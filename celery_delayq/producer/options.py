"""``apply_async``'s option handling, written once: what a caller may give a delayed job
(options, task id, args, kwargs, ``apply_at_many`` items), checked as Celery checks it
(or refused where a stored job cannot carry it), and the route and Celery message those
options make (:func:`resolve_route`, :func:`create_message`).

:mod:`.build` calls these for one job at a time and for a plan shared by many jobs alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import kombu.compression
from celery import Celery
from celery import _state as celery_state
from celery.app.amqp import AMQP
from celery.app.routes import MapRoute, Router
from celery.app.task import Task
from celery.utils.functional import maybe_list
from celery.utils.saferepr import saferepr
from celery.utils.threads import Local
from kombu.entity import DELIVERY_MODES, Exchange, Queue

from ..due import MAX_DUE_MS, due_iso, due_ms_from_eta
from ..exceptions import InvalidArguments, InvalidDueTime, InvalidOptions, InvalidTaskId
from ..store.envelope import CLAIM_HEADER, DUE_HEADER

__all__ = [
    "MAX_TASK_ID_LENGTH",
    "TRANSPORT_OPTIONS",
    "Route",
    "check_options",
    "check_signature",
    "check_task_id",
    "clean_options",
    "create_message",
    "due_item",
    "job_args",
    "job_kwargs",
    "job_label",
    "parents_of",
    "resolve_route",
    "short_repr",
]

#: ``apply_async`` options naming a transport object. apply_at refuses them; the intercepted
#: ``apply_async`` drops them (Celery's canvas passes its producer to every member).
TRANSPORT_OPTIONS = ("producer", "connection", "publisher")

# Options apply_async takes that make no sense for a stored job.
_REFUSED = {
    "producer": "a producer cannot be stored; the beat publishes with its own",
    "connection": "a connection cannot be stored; the beat publishes with its own",
    "publisher": "a producer cannot be stored; the beat publishes with its own",
    "router": "a router object cannot be stored; use task_routes or queue=",
    "content_type": "the content type is the serializer's; use serializer=",
    "content_encoding": "the content encoding is the serializer's; use serializer=",
}
# Options that only steer this call and are never part of the message.
_CALL_ONLY = ("add_to_parent", "result_cls")

#: The longest task id a producer may store, in characters. A Celery id is 36; a schedule
#: point's id is at most 220 (a name of at most 200, ``@`` and the point's time).
MAX_TASK_ID_LENGTH = 512


# -- options, ids and arguments ------------------------------------------------------------


def clean_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` less what never reaches the message; raise on what is refused."""
    if not options:
        return {}
    options = dict(options)
    for name, why in _REFUSED.items():
        if options.get(name) is not None:
            raise InvalidOptions(f"option {name!r} is not supported by apply_at: {why}")
        options.pop(name, None)
    for name in ("eta", "countdown"):
        if options.get(name) is not None:
            raise InvalidOptions(f"option {name!r} conflicts with the due time given to apply_at")
        options.pop(name, None)
    for name in _CALL_ONLY:
        options.pop(name, None)
    headers = options.get("headers")
    if isinstance(headers, Mapping) and (DUE_HEADER in headers or CLAIM_HEADER in headers):
        # A retry (``self.retry``) passes the request's headers on, with the due time and the
        # claim of the attempt that is running; the beat sets the new job's own at publish.
        options["headers"] = {k: v for k, v in headers.items() if k not in (DUE_HEADER, CLAIM_HEADER)}
    return options


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to a length an error message can carry."""
    text: str = saferepr(value, 60)
    return text if len(text) <= 80 else text[:77] + "..."


def job_label(task_id: Any, name: str) -> str:
    return f"job {short_repr(task_id)} of {name!r}"


def check_task_id(task_id: Any, name: str) -> str:
    """``task_id`` if a job of task ``name`` may be stored under it, else :class:`InvalidTaskId`:
    a non-empty string of at most :data:`MAX_TASK_ID_LENGTH` characters, UTF-8 encodable.

    >>> check_task_id("invoice-42", "proj.remind")
    'invoice-42'
    >>> check_task_id(42, "proj.remind")
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidTaskId: task_id of 'proj.remind' must be a string, got int: 42
    """
    if not isinstance(task_id, str):
        raise InvalidTaskId(
            f"task_id of {name!r} must be a string, got {type(task_id).__name__}: {short_repr(task_id)}"
        )
    if not task_id:
        raise InvalidTaskId(f"task_id of {name!r} must not be empty")
    if len(task_id) > MAX_TASK_ID_LENGTH:
        raise InvalidTaskId(
            f"task_id {short_repr(task_id)} of {name!r} is {len(task_id)} characters, over the limit "
            f"of {MAX_TASK_ID_LENGTH} (celery_delayq.producer.options.MAX_TASK_ID_LENGTH)"
        )
    if not task_id.isascii():
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTaskId(
                f"task_id {short_repr(task_id)} of {name!r} is not UTF-8 text ({exc.reason}: "
                f"{task_id[exc.start]!r} at position {exc.start}); Redis cannot store it"
            ) from None
    return task_id


def job_args(args: Any, task_id: Any, name: str) -> tuple[Any, ...]:
    """A job's ``args`` as a tuple; as in Celery, anything false is none, and anything
    else must be a list or tuple (a string is not split into characters)."""
    if type(args) is tuple:
        return args
    if isinstance(args, list | tuple):
        return tuple(args)
    try:
        empty = args is None or not args
    except Exception:  # a value whose truth is an error: refused below
        empty = False
    if empty:
        return ()
    raise InvalidArguments(
        f"{job_label(task_id, name)}: args must be a list or tuple, got {type(args).__name__}: "
        f"{short_repr(args)}"
    )


def job_kwargs(kwargs: Any, task_id: Any, name: str) -> dict[str, Any]:
    """A job's ``kwargs`` as a dict; as in Celery, anything false is none, else a mapping."""
    if type(kwargs) is dict or isinstance(kwargs, Mapping):  # (a dict without the ABC check)
        return dict(kwargs)
    try:
        empty = kwargs is None or not kwargs
    except Exception:  # (as above)
        empty = False
    if empty:
        return {}
    raise InvalidArguments(
        f"{job_label(task_id, name)}: kwargs must be a mapping (a dict), got {type(kwargs).__name__}: "
        f"{short_repr(kwargs)}"
    )


def _time_limit_ok(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int past float's range
        return False


def _compression_ok(value: Any) -> bool:
    try:
        kombu.compression.get_encoder(value)  # type: ignore[no-untyped-call]
    except (KeyError, TypeError):
        return False
    return True


#: Options Celery's ``apply_async`` refuses (or that cannot work at the worker) when of the
#: wrong kind, checked once per call: (option, test, what it must be). ``None`` always passes.
_OPTION_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("queue", lambda v: isinstance(v, str | Queue), "a queue name or a kombu Queue"),
    ("headers", lambda v: isinstance(v, Mapping), "a dict (a mapping)"),
    ("compression", _compression_ok,
     f"a compression kombu knows ({', '.join(sorted(kombu.compression._aliases))})"),
    # (Any other number: RabbitMQ closes the channel, PRECONDITION_FAILED delivery_mode_unknown.)
    ("delivery_mode",
     lambda v: (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v in (1, 2))
     or (isinstance(v, str) and v in DELIVERY_MODES),
     "1, 2, 'transient' or 'persistent'"),
    ("time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("soft_time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("stamped_headers", lambda v: isinstance(v, list | tuple) and all(type(h) is str for h in v),
     "a list of option names"),
)  # fmt: skip


def check_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse, with :class:`InvalidOptions`, an option (given to the call, or else a default of
    the task) that Celery's ``apply_async`` would refuse or that cannot work. Called where the
    route is made: once per call (or per distinct options, when the route is kept)."""
    for option, test, must in _OPTION_CHECKS:
        value = options[option] if option in options else defaults.get(option)
        if value is not None and not test(value):
            where = "" if option in options else " (the task's default)"
            raise InvalidOptions(
                f"option {option!r}{where} must be {must}, got {type(value).__name__}: {short_repr(value)}"
            )
    stamps = options.get("stamped_headers")
    if stamps:
        missing = [h for h in stamps if h not in options]
        if missing:
            raise InvalidOptions(f"option 'stamped_headers' names options not given: {missing}")


def check_signature(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if task.typing:
        header = getattr(task, "__header__", None)
        if header is not None:
            header(*args, **kwargs)


def _route(
    app: Any, options: dict[str, Any], name: str, route_name: Any, args: Any, kwargs: Any, task: Any
) -> dict[str, Any]:
    try:
        return dict(app.amqp.router.route(options, route_name or name, args, kwargs, task))
    except Exception as exc:  # QueueNotFound, a router raising: refuse now, not in beat
        raise InvalidOptions(f"cannot route task {name!r}: {exc}") from exc


def current_worker_task(app: Any) -> Any:
    """``app.current_worker_task``: the task a worker is running in this thread, or None.

    Celery's task stack is a ``Local`` (``celery.utils.threads``): read in a thread that never
    pushed a task (any producer outside a worker), it raises and catches an AttributeError,
    about 1.5 µs of every ``apply_at``. Its storage says the same without one: no entry for
    this thread, or an empty stack, is no task. Anything else (a task on the stack, another
    stack class, an app class with its own ``current_worker_task``) asks Celery.
    """
    local: Any = getattr(celery_state._task_stack, "_local", None)
    if type(local) is Local and type(app).current_worker_task is Celery.current_worker_task:
        entry = local.__storage__.get(local.__ident_func__())
        if entry is None or not entry.get("stack"):
            return None
    return app.current_worker_task


def parents_of(app: Any, root_id: Any, parent_id: Any) -> tuple[Any, Any]:
    """``root_id``/``parent_id`` as ``apply_async`` completes them inside a worker task."""
    if not root_id or not parent_id:
        parent = current_worker_task(app)
        if parent:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
    return root_id, parent_id


def due_item(item: Any, index: int, app: Any) -> tuple[int, Any, Any]:
    """``apply_at_many``'s item number ``index``, ``(eta, args, kwargs)`` (a tuple or a list),
    as ``(due ms, args, kwargs)``; :class:`InvalidArguments` for anything else.

    >>> from celery import Celery
    >>> due_item((1_700_000_000, (1,), None), 0, Celery())
    (1700000000000, (1,), None)
    >>> due_item((1_700_000_000, (1,)), 3, Celery())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidArguments: apply_at_many item 3 must be an (eta, args, kwargs) ...
    """
    if (type(item) is tuple or type(item) is list) and len(item) == 3:
        return due_ms_from_eta(item[0], app), item[1], item[2]
    kind = type(item).__name__ + (f" of {len(item)}" if isinstance(item, tuple | list) else "")
    raise InvalidArguments(
        f"apply_at_many item {index} must be an (eta, args, kwargs) tuple, got {kind}: {short_repr(item)}"
    )


def _expires_ms(expires: Any, due_ms: int, app: Any) -> int | None:
    """``expires`` as absolute ms: seconds/timedelta count from the due time."""
    if expires is None:
        return None
    if isinstance(expires, timedelta) or (isinstance(expires, int | float) and not isinstance(expires, bool)):
        try:
            seconds = expires.total_seconds() if isinstance(expires, timedelta) else float(expires)
        except OverflowError:  # an int past float's range
            seconds = math.inf
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidOptions(
                f"expires must be a finite number of seconds >= 0, got {short_repr(expires)}"
            )
        if seconds * 1000 > MAX_DUE_MS:
            raise InvalidOptions(f"expires is past year 9999: {short_repr(expires)} after the due time")
        return due_ms + round(seconds * 1000)
    try:
        return due_ms_from_eta(expires, app)
    except InvalidDueTime as exc:
        raise InvalidOptions(f"expires: {exc}") from exc


def _name(value: Any) -> Any:
    if isinstance(value, Queue | Exchange):
        return value.name
    return value


class _UnregisteredTask:
    """What build_envelope needs of a task this app does not have: its name and app defaults."""

    typing = False

    def __init__(self, app: Any, name: str) -> None:
        self.name = name
        self.ignore_result = app.conf.task_ignore_result

    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> None:
        return None

    def _get_exec_options(self) -> dict[str, Any]:
        return {}


# -- the route and the message, as apply_async makes them ----------------------------------


def _expires_plan(expires: Any, app: Any) -> tuple[bool, int] | None:
    """``(relative, ms)``: the expiry is ``due + ms`` when relative, else ``ms``."""
    if expires is None:
        return None
    relative = isinstance(expires, timedelta) or (
        isinstance(expires, int | float) and not isinstance(expires, bool)
    )
    ms = _expires_ms(expires, 0, app)
    assert ms is not None
    return relative, ms


@dataclass(eq=False)
class Route:
    """What ``apply_async`` works out from the task and the options before it builds the
    message: execution options, expiry, route, serializer. A plan (see :mod:`.build`) keeps
    it, with its ``plans``, for every later job of the same task and options."""

    task: Any
    name: str
    header: Callable[..., Any] | None
    shadow: Any
    expires: tuple[bool, int] | None
    time_limit: Any
    soft_time_limit: Any
    ignore_result: Any
    link: Any
    link_error: Any
    routed: dict[str, Any]
    root_id: Any
    parent_id: Any
    reply_to: Any
    serializer: Any
    plans: dict[Any, Any] = field(default_factory=dict)

    def expires_at(self, due_ms: int) -> int | None:
        """The absolute expiry (ms) of a job of this route due at ``due_ms``, or None."""
        if self.expires is None:
            return None
        relative, ms = self.expires
        at = due_ms + ms if relative else ms
        if at > MAX_DUE_MS:
            raise InvalidOptions(
                f"expires is past year 9999: {ms / 1000.0!r} s after a job due at {due_iso(due_ms)}"
            )
        return at


def _is_plain_task(task: Any) -> bool:
    """True when nothing of the task makes its message depend on the arguments but the body."""
    if isinstance(task, _UnregisteredTask):
        return True
    return getattr(type(task), "shadow_name", None) is Task.shadow_name and "shadow_name" not in vars(task)


def _stock_messages(app: Any) -> bool:
    """True when the app builds and routes messages Celery's own way (no custom
    ``create_task_message``, only mapping routes): its messages depend on their arguments
    only through the body."""
    amqp = app.amqp
    create = amqp.create_task_message
    stock = getattr(create, "__func__", None) is AMQP.as_task_v2
    if not stock or getattr(create, "__self__", None) is not amqp:
        return False
    router = app.amqp.router
    return type(router) is Router and all(isinstance(r, MapRoute) for r in router.routes)


def resolve_route(
    app: Any, task: Any, options: dict[str, Any], args: Any, kwargs: Any, *, shared: bool = False
) -> Route | None:
    """Execution options, expiry and route of a job of ``task`` (an object, or a name this app
    does not have) with (cleaned) ``options`` and these arguments, as apply_async finds them.

    ``shared``: for every job of this task and options alike; None when they (or the
    message) could depend on the arguments: then each job is resolved on its own.
    """
    if shared and not _stock_messages(app):
        return None
    resolved = _UnregisteredTask(app, task) if isinstance(task, str) else task
    defaults = resolved._get_exec_options()
    check_options(options, defaults)
    options = dict(options)
    shadow = options.pop("shadow", None)
    if not shadow:
        if shared and not _is_plain_task(resolved):
            return None
        shadow = resolved.shadow_name(args, kwargs, options)
    options = dict(defaults, **options)
    options.setdefault("ignore_result", resolved.ignore_result)
    name = resolved.name
    expires = _expires_plan(options.pop("expires", None), app)
    time_limit = options.pop("time_limit", None)
    soft_time_limit = options.pop("soft_time_limit", None)
    ignore_result = options.pop("ignore_result", None)
    link = options.pop("link", None)
    link_error = options.pop("link_error", None)
    route_name = options.pop("route_name", None)
    routed = _route(app, options, name, route_name, args, kwargs, resolved)
    header = getattr(resolved, "__header__", None) if resolved.typing else None
    return Route(
        task=task,
        name=name,
        header=header,
        shadow=shadow,
        expires=expires,
        time_limit=time_limit,
        soft_time_limit=soft_time_limit,
        ignore_result=ignore_result,
        link=link,
        link_error=link_error,
        root_id=routed.pop("root_id", None),
        parent_id=routed.pop("parent_id", None),
        serializer=routed.pop("serializer", None) or app.conf.task_serializer,
        reply_to=routed.pop("reply_to", None),
        routed=routed,
    )


def create_message(
    app: Any,
    route: Route,
    job: tuple[Any, Any, Any],
    expires_iso: str | None,
    parents: tuple[Any, Any, Any],
) -> tuple[Any, tuple[Any, Any], dict[str, Any]]:
    """Celery's message for ``job`` (``(task id, args, kwargs)``) by ``route``, with
    ``parents`` (``(root id, parent id, reply_to)``, as :func:`parents_of` completes them).

    Returns the message, the ``argsrepr``/``kwargsrepr`` options given (or None), and the
    routed options left for the broker, queues and exchanges by name.
    """
    task_id, args, kwargs = job
    root_id, parent_id, reply_to = parents
    options = dict(route.routed)
    message = app.amqp.create_task_message(
        task_id,
        route.name,
        args,
        kwargs,
        None,
        None,
        options.pop("group_id", None),
        options.pop("group_index", None),
        expires_iso,
        options.pop("retries", 0),
        options.pop("chord", None),
        maybe_list(route.link),
        maybe_list(route.link_error),
        reply_to,
        route.time_limit,
        route.soft_time_limit,
        False,
        root_id,
        parent_id,
        route.shadow,
        options.pop("chain", None),
        ignore_result=route.ignore_result,
        replaced_task_nesting=options.pop("replaced_task_nesting", 0),
        **options,
    )
    for stamp in options.pop("stamped_headers", None) or []:
        options.pop(stamp, None)
    reprs = (options.pop("argsrepr", None), options.pop("kwargsrepr", None))
    options.pop("origin", None)
    routed = {key: _name(value) for key, value in options.items() if value is not None}
    return message, reprs, routed
