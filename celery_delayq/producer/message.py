"""The route and the Celery message of a delayed job, as ``apply_async`` makes them: execution
options, expiry, router, serializer (:func:`resolve_route`, a :class:`Route`), then the message
by Celery's own ``create_task_message`` (:func:`create_message`), with the parent and root ids
``apply_async`` gives a job sent from inside a task (:func:`parents_of`).

The options reach it checked by :mod:`.options`; :mod:`.build` calls these for one job at a
time and for a plan shared by many jobs alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery import Celery
from celery import _state as celery_state
from celery.app.amqp import AMQP
from celery.app.routes import MapRoute, Router
from celery.app.task import Task
from celery.utils.functional import maybe_list
from celery.utils.threads import Local
from kombu.entity import Exchange, Queue

from ..due import MAX_DUE_MS, due_iso, due_ms_from_eta
from ..exceptions import InvalidDueTime, InvalidOptions
from .options import check_options, short_repr

__all__ = ["Route", "create_message", "current_worker_task", "parents_of", "resolve_route"]


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
    message: execution options, expiry, route, serializer. A plan (see :mod:`.plans`) keeps
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
