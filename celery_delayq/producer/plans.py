"""Plans: what building many envelopes of one task and one set of options shares, worked out
once and kept per app (:func:`plan_for`, a :class:`Plan`), so that :mod:`.build` fills in per
job only its id, arguments and times.

A plan is Celery's own message for a stand-in job (:func:`~.message.create_message` by the
:class:`~.message.Route` of the task and options), turned into the envelope parts every job
shares. Routes are kept per app by task and options (a hashable key of the options' JSON,
:func:`frozen_options`), plans per route by the call's context (parent ids, process), in the
app's :class:`AppState` (:func:`app_state`, a part of the app's extension, made anew when its
settings change). A route that could make a message depend on its arguments in another way
has no plan: :mod:`.build` builds each job on its own then.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kombu.utils.json as kombu_json
from kombu.serialization import registry

from ..config import extension
from ..store.envelope import JSON_CT, UTF8
from ..store.envelope_writing import Pieces, is_plain_embed, shared_pieces
from .message import Route, create_message, parents_of, resolve_route

__all__ = ["AppState", "Plan", "app_state", "frozen_options", "plan_for"]


# -- many jobs: one plan per task and options ---------------------------------------------------
#
# Celery's message for a task and options is made once per app (the route, then the plan) and
# kept while the app's settings are unchanged (app_state); each job then only fills in its id,
# arguments and times. What this buys a one-job apply_at, on the bench's apply_at row (a job of
# the real shape; ``BENCH_APPLY_AT_WITHOUT=plans python -m bench --only apply_at``, both in the
# same halves, a busy 2-core VM): 124 µs a call with it, 287 without; 119 vs 259; 142 vs 241;
# 138 vs 242 (four runs). apply_at_many builds every job of a batch by one plan.

#: Stand for the job's id and expires header in a plan's template message.
_ID = "\x00delayq:id\x00"
_EXPIRES = "\x00delayq:expires\x00"
#: Most (task, options) routes, and plans per route, kept per app.
_ROUTES_KEPT = 256
_PLANS_KEPT = 64
_KEYABLE = frozenset((str, int, bool, type(None)))
_MISSING: Any = object()
_CONTAINERS = (dict, list, tuple)


@dataclass(eq=False)
class AppState:
    """What delayq keeps per app between calls, in the app's extension
    (:func:`~celery_delayq.config.extension`), made anew with it when the app's settings change."""

    always_eager: bool
    json_codec: Any
    json_encoder: Any
    routes: dict[Any, Any] = field(default_factory=dict)


def app_state(app: Any) -> AppState:
    """The app's :class:`AppState`: its extension's (:func:`~celery_delayq.config.extension`)."""
    ext = extension(app)
    state: AppState | None = ext.parts.get("state")
    if state is None:
        state = ext.part("state", lambda: _new_state(app))
    if not _state_is_current(state):  # kombu's JSON codec was replaced
        state = ext.parts["state"] = _new_state(app)
    return state


def _state_is_current(state: AppState) -> bool:
    """Whether kombu's JSON codec is still the one ``state`` was made with."""
    return state.json_codec is getattr(registry, "_encoders", {}).get("json")


def _new_state(app: Any) -> AppState:
    codec = getattr(registry, "_encoders", {}).get("json")
    return AppState(
        always_eager=bool(app.conf.task_always_eager),
        json_codec=codec,
        json_encoder=_stock_json_encoder(codec),
    )


def _stock_json_encoder(codec: Any) -> Any:
    """kombu's JSON encoder when the ``json`` serializer is kombu's own, else None.

    kombu serializes with ``json.dumps(body, cls=JSONEncoder)``, which is
    ``JSONEncoder().encode(body)``: the same encoder, kept instead of made per job.
    """
    if codec is None or tuple(codec) != (JSON_CT, UTF8, kombu_json.dumps):
        return None
    defaults = kombu_json.dumps.__defaults__ or ()
    if len(defaults) != 3 or defaults[0] is not json.dumps or defaults[2]:
        return None
    cls = defaults[1]
    if not (isinstance(cls, type) and issubclass(cls, json.JSONEncoder)):
        return None
    if cls.__init__ is not json.JSONEncoder.__init__:
        return None
    return cls()


def _frozen(value: Any, depth: int = 0) -> Any:
    """A hashable stand-in for an option value, equal only for values that are the same JSON
    (types kept apart: 1, 1.0 and True differ), or ``_MISSING`` when it has none. A dict
    with string keys, a list or a tuple (a message's ``headers``: a gated job's carry its
    gate) stands for its items, to a depth of 4."""
    kind = type(value)
    if kind in _KEYABLE:
        return (kind, value)
    if kind is float:
        return (kind, repr(value))  # -0.0 == 0.0 and nan != nan, but not as text
    if (kind is dict or kind is list or kind is tuple) and depth < 4:
        items = value.items() if kind is dict else enumerate(value)
        out = []
        for key, item in items:
            frozen = _frozen(item, depth + 1)
            if frozen is _MISSING or (kind is dict and type(key) is not str):
                return _MISSING
            out.append((key, frozen))
        return (kind, tuple(out))
    return _MISSING


def frozen_options(options: Mapping[str, Any]) -> Any:
    """A hashable key, equal for two option mappings only when they are the same JSON (see
    :func:`_frozen`); None when an option has none (an object).

    >>> given = {"queue": "q", "headers": {"x": [1]}}
    >>> frozen_options(given) == frozen_options({"queue": "q", "headers": {"x": [1]}})
    True
    >>> frozen_options({"priority": 1}) == frozen_options({"priority": True}), frozen_options({"x": object()})
    (False, None)
    """
    frozen = _frozen(dict(options))
    return None if frozen is _MISSING else frozen


def _options_key(options: dict[str, Any]) -> tuple[tuple[Any, ...], bool] | None:
    """A dict key for ``options`` (see :func:`_frozen`), and whether a value is a container
    (then the route is made from a copy: the kept route must not change with the caller's
    dict); None when an option has no key."""
    items = []
    containers = False
    for key, value in options.items():
        frozen = _frozen(value)
        if frozen is _MISSING:
            return None
        containers = containers or frozen[0] in _CONTAINERS
        items.append((key, frozen))
    return tuple(items), containers


@dataclass(eq=False)
class Plan:
    """Everything about a job's envelope but its id, arguments, expiry and creation time."""

    pieces: Pieces
    header: Callable[..., Any] | None
    argsrepr: str | None
    kwargsrepr: str | None
    args_max: Any
    kwargs_max: Any
    maxlevels: Any
    encoder: Any
    plain: bool
    embed: Any
    serializer: Any
    expires_at: Callable[[int], int | None]
    root_id: Any


def _make_plan(
    app: Any, state: AppState, route: Route, root_id: Any, parent_id: Any, reply_to: Any
) -> Plan | None:
    """Celery's message for a stand-in job, turned into the envelope parts every job shares."""
    expires_iso = _EXPIRES if route.expires is not None else None
    message, (argsrepr, kwargsrepr), routed = create_message(
        app, route, (_ID, (), {}), expires_iso, (root_id, parent_id, reply_to)
    )
    if not (argsrepr is None or type(argsrepr) is str) or not (kwargsrepr is None or type(kwargsrepr) is str):
        return None
    headers, props, body, _ = message
    if not (type(body) is tuple and len(body) == 3):
        return None
    pieces = shared_pieces(route.name, (headers, props), (_ID, expires_iso), routed)
    if pieces is None:
        return None  # built the long way, which says what cannot be stored
    embed = body[2]
    serializer = route.serializer
    encoder = state.json_encoder if type(serializer) is str and serializer == "json" else None
    plain = False
    if encoder is not None:
        try:
            plain = is_plain_embed(encoder.encode(embed))
        except Exception:
            encoder = None  # kombu will say what is wrong, job by job
    amqp = app.amqp
    return Plan(
        pieces=pieces,
        header=route.header,
        argsrepr=argsrepr,
        kwargsrepr=kwargsrepr,
        args_max=amqp.argsrepr_maxsize,
        kwargs_max=amqp.kwargsrepr_maxsize,
        maxlevels=app.conf.task_repr_maxlevels,
        encoder=encoder,
        plain=plain,
        embed=embed,
        serializer=serializer,
        expires_at=route.expires_at,
        root_id=root_id if type(root_id) is str else None,
    )


def plan_for(
    app: Any, task: Any, options: dict[str, Any], args: Any, kwargs: Any, state: AppState | None = None
) -> Plan | None:
    """The plan for ``task`` with (cleaned) ``options`` in this call's context, or None."""
    if state is None:
        state = app_state(app)
    keyed = _options_key(options)
    route_key = None if keyed is None else ((task if isinstance(task, str) else id(task)), keyed[0])
    route = _MISSING if route_key is None else state.routes.get(route_key, _MISSING)
    if route is not _MISSING and route is not None and not isinstance(task, str) and route.task is not task:
        route = _MISSING
    if route is _MISSING:
        if keyed is not None and keyed[1]:
            options = copy.deepcopy(options)
        route = resolve_route(app, task, options, args, kwargs, shared=True)
        if route_key is not None:
            if len(state.routes) >= _ROUTES_KEPT:
                state.routes.clear()
            state.routes[route_key] = route
    if route is None:
        return None
    root_id, parent_id = parents_of(app, route.root_id, route.parent_id)
    reply_to = route.reply_to or app.thread_oid
    context = (root_id, parent_id, reply_to, os.getpid())
    try:
        plan: Plan | None = route.plans.get(context, _MISSING)
    except TypeError:  # an unhashable id: no keeping
        return _make_plan(app, state, route, root_id, parent_id, reply_to)
    if plan is _MISSING:
        plan = _make_plan(app, state, route, root_id, parent_id, reply_to)
        if len(route.plans) >= _PLANS_KEPT:
            route.plans.clear()
        route.plans[context] = plan
    return plan
