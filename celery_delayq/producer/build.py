"""Envelopes built at schedule time, the way ``apply_async`` builds the message.

:func:`build_envelope` (one job) and :func:`build_envelopes` (many jobs of one task and
one set of options) do what ``Task.apply_async`` and ``Celery.send_task`` do before they
publish: argument check against the task's signature, the task's execution options, the
router (queue, exchange, routing key, priority), the protocol-2 headers and the body,
serialized with the task's serializer (the option handling is :mod:`.options`'). What
``apply_async`` would have published is stored (:mod:`..store.envelope` writes it), less the
``eta`` (the worker must run it at once) and with ``expires`` made absolute.

Building many jobs goes through a *plan*: everything that depends only on the task and
the options (the :class:`~.options.Route`, the headers and properties Celery would build,
their compact JSON) is worked out once, by Celery's own ``create_task_message``, and kept
per app; per job only the id, the arguments (signature check, ``argsrepr``/``kwargsrepr``,
body) and the expiry are computed. When anything could make a message depend on its
arguments in another way (a task overriding ``shadow_name``, a router function, a custom
``create_task_message``), each job is built on its own, the way ``apply_async`` does it:
the same route and message steps, with the job's own arguments.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kombu.utils.json as kombu_json
from celery.utils.saferepr import saferepr
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, registry

from ..config import extension
from ..due import MAX_DUE_MS, ms_to_datetime
from ..exceptions import InvalidOptions, SerializationError
from ..store.envelope import (
    JSON_CT,
    UTF8,
    Pieces,
    body_members,
    encode_envelope,
    envelope_from_pieces,
    is_plain_embed,
    plain_body,
    schedule_member,
    shared_pieces,
)
from .options import (
    MAX_TASK_ID_LENGTH,
    Route,
    check_signature,
    check_task_id,
    clean_options,
    create_message,
    job_args,
    job_kwargs,
    job_label,
    parents_of,
    resolve_route,
)

__all__ = ["app_state", "build_envelope", "build_envelopes", "frozen_options", "new_task_ids"]


# -- task ids ---------------------------------------------------------------------------------
# The variant nibble of a version-4 UUID: "10" then the two random low bits of the byte.
_VARIANT = {f"{n:x}": f"{8 | (n & 3):x}" for n in range(16)}


def new_task_ids(count: int) -> list[str]:
    """``count`` random task ids, in the form of Celery's ``uuid()`` (``str(uuid.uuid4())``).

    Made from one ``os.urandom`` call, with the version and variant bits of
    ``uuid4``, so each id is what ``uuid4()`` could have returned.

    >>> import uuid
    >>> [u.version for u in map(uuid.UUID, new_task_ids(3))]
    [4, 4, 4]
    """
    h = os.urandom(16 * count).hex()
    v = _VARIANT
    return [
        f"{h[i : i + 8]}-{h[i + 8 : i + 12]}-4{h[i + 13 : i + 16]}-"
        f"{v[h[i + 16]]}{h[i + 17 : i + 20]}-{h[i + 20 : i + 32]}"
        for i in range(0, 32 * count, 32)
    ]


# -- argsrepr / kwargsrepr ----------------------------------------------------------------------


def _scalar_repr(value: Any) -> str | None:
    """What ``saferepr`` writes for a plain scalar (untruncated), or None for anything else."""
    kind = type(value)
    if kind is str:
        return "'" + str.replace(value, "'", "\\'") + "'"
    if kind is int or kind is bool or kind is float:
        return str(value)  # float: str is repr
    if value is None:
        return "None"
    return None


def _quick_saferepr(value: Any, maxlen: int | None) -> str | None:
    """``saferepr(value, maxlen)`` of a tuple or dict of plain scalars, or None when not that simple.

    Celery's ``saferepr`` writes numbers with ``str``, ``None`` with ``repr``
    and strings between single quotes with only ``'`` escaped; nothing is
    truncated while the whole text is shorter than ``maxlen``. A flat
    container stays within any ``maxlevels``.
    """
    kind = type(value)
    if kind is tuple:
        if not value:
            text = "()"
        else:
            parts = []
            for item in value:
                part = _scalar_repr(item)
                if part is None:
                    return None
                parts.append(part)
            text = "(" + ", ".join(parts) + (",)" if len(parts) == 1 else ")")
    elif kind is dict:
        if not value:
            text = "{}"
        else:
            parts = []
            for key, item in value.items():
                key_part = _scalar_repr(key)
                part = _scalar_repr(item)
                if key_part is None or part is None:
                    return None
                parts.append(key_part + ": " + part)
            text = "{" + ", ".join(parts) + "}"
    else:
        return None
    if maxlen is not None and len(text) >= maxlen:
        return None
    return text


def _saferepr(value: Any, maxlen: int | None, maxlevels: Any) -> str:
    """Celery's ``saferepr``, by the short way when the value is simple enough."""
    try:
        quick = _quick_saferepr(value, maxlen)
    except Exception:  # whatever it was, saferepr says it the same way (or raises the same)
        quick = None
    if quick is not None:
        return quick
    text: str = saferepr(value, maxlen, maxlevels=maxlevels)
    return text


def _serialization_error(name: str, serializer: Any, exc: BaseException) -> SerializationError:
    return SerializationError(f"cannot serialize the arguments of {name!r} with {serializer!r}: {exc}")


# -- one job, the way apply_async builds it ----------------------------------------------------


def _build_one(
    app: Any,
    task: Any,
    task_id: str,
    due_ms: int,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    max_payload: int | None,
    schedule: tuple[str, int] | None,
    appended: tuple[Any, ...] = (),
) -> str:
    """One envelope, every step as ``apply_async`` takes it (``options`` already cleaned)."""
    task_name = task if isinstance(task, str) else task.name
    check_task_id(task_id, task_name)
    args = job_args(args, task_id, task_name)
    kwargs = job_kwargs(kwargs, task_id, task_name)
    if not isinstance(task, str):
        check_signature(task, (*args, *appended), kwargs)
    route = resolve_route(app, task, options, args, kwargs)
    assert route is not None  # (only a shared route may be refused)
    name = route.name
    expires = route.expires_at(due_ms)
    root_id, parent_id = parents_of(app, route.root_id, route.parent_id)
    expires_iso = ms_to_datetime(expires).isoformat() if expires is not None else None
    parents = (root_id, parent_id, route.reply_to or app.thread_oid)
    message, _, routed = create_message(app, route, (task_id, args, kwargs), expires_iso, parents)
    headers, props, body, _ = message
    try:
        encoded = dumps(body, serializer=route.serializer)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise _serialization_error(name, route.serializer, exc) from exc
    expiry = None if expires is None or expires_iso is None else (expires, expires_iso)
    return encode_envelope(task_id, name, (headers, props), encoded, routed, expiry, schedule, max_payload)


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
class _AppState:
    """What delayq keeps per app between calls, in the app's extension
    (:func:`~celery_delayq.config.extension`), made anew with it when the app's settings change."""

    always_eager: bool
    json_codec: Any
    json_encoder: Any
    routes: dict[Any, Any] = field(default_factory=dict)


def app_state(app: Any) -> _AppState:
    """The app's :class:`_AppState`: its extension's (:func:`~celery_delayq.config.extension`)."""
    ext = extension(app)
    state: _AppState | None = ext.parts.get("state")
    if state is None:
        state = ext.part("state", lambda: _new_state(app))
    if not _state_is_current(state):  # kombu's JSON codec was replaced
        state = ext.parts["state"] = _new_state(app)
    return state


def _state_is_current(state: _AppState) -> bool:
    """Whether kombu's JSON codec is still the one ``state`` was made with."""
    return state.json_codec is getattr(registry, "_encoders", {}).get("json")


def _new_state(app: Any) -> _AppState:
    codec = getattr(registry, "_encoders", {}).get("json")
    return _AppState(
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
class _Plan:
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
    app: Any, state: _AppState, route: Route, root_id: Any, parent_id: Any, reply_to: Any
) -> _Plan | None:
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
    return _Plan(
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


def _plan_for(
    app: Any, task: Any, options: dict[str, Any], args: Any, kwargs: Any, state: _AppState | None = None
) -> _Plan | None:
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
        plan: _Plan | None = route.plans.get(context, _MISSING)
    except TypeError:  # an unhashable id: no keeping
        return _make_plan(app, state, route, root_id, parent_id, reply_to)
    if plan is _MISSING:
        plan = _make_plan(app, state, route, root_id, parent_id, reply_to)
        if len(route.plans) >= _PLANS_KEPT:
            route.plans.clear()
        route.plans[context] = plan
    return plan


def _build_planned(
    plan: _Plan,
    jobs: Sequence[tuple[str, int, Any, Any]],
    max_payload: int | None,
    schedule: tuple[str, int] | None,
    long_way: Callable[[str, int, Any, Any], str],
) -> list[str]:
    """The envelopes of ``jobs`` by ``plan``: per job its id, arguments, expiry, creation time.

    The signature of the first job was checked before the plan was made.
    """
    pieces = plan.pieces
    name = pieces.name
    header = plan.header
    given_args, given_kwargs = plan.argsrepr, plan.kwargsrepr
    args_max, kwargs_max, maxlevels = plan.args_max, plan.kwargs_max, plan.maxlevels
    encoder, plain, embed, serializer = plan.encoder, plan.plain, plan.embed, plan.serializer
    expires_at, root_id = plan.expires_at, plan.root_id
    sched = schedule_member(schedule)
    out: list[str] = []
    for index, (task_id, due_ms, args, kwargs) in enumerate(jobs):
        if type(args) is not tuple:
            args = () if args is None else job_args(args, task_id, name)
        if type(kwargs) is not dict:
            kwargs = {} if kwargs is None else job_kwargs(kwargs, task_id, name)
        if header is not None and index:
            header(*args, **kwargs)
        if (
            type(task_id) is not str
            or not 0 < len(task_id) <= MAX_TASK_ID_LENGTH
            or not task_id.isascii()
            or task_id == root_id
        ):  # the long way checks the id
            out.append(long_way(task_id, due_ms, args, kwargs))
            continue
        expires = expires_at(due_ms)
        if expires is not None and not 0 <= expires <= MAX_DUE_MS:
            ms_to_datetime(expires).isoformat()  # raises as the expires header would
        argsrepr = given_args if given_args is not None else _saferepr(args, args_max, maxlevels)
        kwargsrepr = given_kwargs if given_kwargs is not None else _saferepr(kwargs, kwargs_max, maxlevels)
        if plain:
            try:
                text = encoder.encode((args, kwargs))
            except Exception as exc:
                error = EncodeError(exc)  # what kombu's dumps raises
                raise _serialization_error(name, serializer, error) from error
            body = plain_body(text)
        else:
            try:
                if encoder is not None:
                    encoded = (JSON_CT, UTF8, encoder.encode((args, kwargs, embed)))
                else:
                    encoded = dumps((args, kwargs, embed), serializer=serializer)  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise _serialization_error(name, serializer, exc) from exc
            body = body_members(*encoded)
        reprs = (argsrepr, kwargsrepr)
        out.append(envelope_from_pieces(pieces, task_id, reprs, body, expires, sched, max_payload))
    return out


def build_envelopes(
    app: Any,
    task: Any,
    jobs: Sequence[tuple[str, int, Any, Any]],
    options: Mapping[str, Any] | None = None,
    max_payload: int | None = None,
    schedule: tuple[str, int] | None = None,
    *,
    state: _AppState | None = None,
    appended: tuple[Any, ...] = (),
) -> list[str]:
    """The envelopes of ``jobs`` (``(task id, due ms, args, kwargs)``), all of ``task`` with ``options``.

    Each is exactly what :func:`build_envelope` returns for that job, and is
    checked the same way (in the same order: a bad job raises what
    ``build_envelope`` would raise for it). See :func:`build_envelope`.
    ``state`` is :func:`app_state` of ``app`` when the caller just got it. ``appended``:
    arguments added to each job's when it is sent (a batch's completion job gets the batch id
    and counts), checked against the task's signature with the others but not stored.
    """
    if not jobs:
        return []
    name = task if isinstance(task, str) else task.name
    try:
        options = clean_options(options)
        first_id, first_due, first_args, first_kwargs = jobs[0]
        first_args = job_args(first_args, first_id, name)
        first_kwargs = job_kwargs(first_kwargs, first_id, name)
        jobs = [(first_id, first_due, first_args, first_kwargs), *jobs[1:]]

        def long_way(task_id: str, due_ms: int, args: Any, kwargs: Any) -> str:
            return _build_one(
                app, task, task_id, due_ms, args, kwargs, options, max_payload, schedule, appended
            )

        if not isinstance(task, str):
            check_signature(task, (*first_args, *appended), first_kwargs)
        plan = _plan_for(app, task, options, first_args, first_kwargs, state)
        if plan is None:
            return [long_way(*job) for job in jobs]
        return _build_planned(plan, jobs, max_payload, schedule, long_way)
    except InvalidOptions as exc:
        if repr(name) in str(exc):
            raise
        # Name the job (or jobs) in the messages of checks that do not know it.
        what = job_label(jobs[0][0], name) if len(jobs) == 1 else f"the {len(jobs)} jobs of {name!r}"
        raise type(exc)(f"{exc} ({what})") from exc


def build_envelope(
    app: Any,
    task: Any,
    task_id: str,
    due_ms: int,
    args: Any = None,
    kwargs: Any = None,
    options: Mapping[str, Any] | None = None,
    max_payload: int | None = None,
    schedule: tuple[str, int] | None = None,
) -> str:
    """Build the JSON envelope of one job, exactly as ``apply_async`` would build the message.

    ``task`` is the registered task object, or its name when this app does not
    have it (as ``send_task`` allows: no signature check, the app's defaults).
    ``schedule`` marks an execution point of a recurring schedule.

    Raises :class:`~celery_delayq.exceptions.ScheduleError` subclasses (and
    ``TypeError`` for arguments that do not fit the task's signature) before
    anything is stored.
    """
    return build_envelopes(app, task, [(task_id, due_ms, args, kwargs)], options, max_payload, schedule)[0]
