"""Envelopes built at schedule time, the way ``apply_async`` builds the message.

:func:`build_envelope` (one job) and :func:`build_envelopes` (many jobs of one task and
one set of options) do what ``Task.apply_async`` and ``Celery.send_task`` do before they
publish: argument check against the task's signature, the task's execution options, the
router (queue, exchange, routing key, priority), the protocol-2 headers and the body,
serialized with the task's serializer (the option handling is :mod:`.options`', the route
and message :mod:`.message`'s). What
``apply_async`` would have published is stored (:mod:`..store.envelope_writing` writes it), less the
``eta`` (the worker must run it at once) and with ``expires`` made absolute.

Building many jobs goes through a *plan* (:mod:`.plans`): everything that depends only on the task and
the options (the :class:`~.message.Route`, the headers and properties Celery would build,
their compact JSON) is worked out once, by Celery's own ``create_task_message``, and kept
per app; per job only the id, the arguments (signature check, ``argsrepr``/``kwargsrepr``,
body) and the expiry are computed. When anything could make a message depend on its
arguments in another way (a task overriding ``shadow_name``, a router function, a custom
``create_task_message``), each job is built on its own, the way ``apply_async`` does it:
the same route and message steps, with the job's own arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery.utils.saferepr import saferepr
from kombu.exceptions import EncodeError
from kombu.serialization import dumps

from ..due import MAX_DUE_MS, ms_to_datetime
from ..exceptions import InvalidOptions, SerializationError
from ..store.envelope import JSON_CT, UTF8
from ..store.envelope_writing import (
    body_members,
    encode_envelope,
    envelope_from_pieces,
    plain_body,
    schedule_member,
)
from .message import create_message, parents_of, resolve_route
from .options import (
    MAX_TASK_ID_LENGTH,
    check_kwargs_keys,
    check_signature,
    check_task_id,
    clean_options,
    job_args,
    job_kwargs,
    job_label,
)
from .plans import AppState, Plan, plan_for

__all__ = ["build_envelope", "build_envelopes", "new_task_ids"]


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


# -- many jobs: by one plan (:mod:`.plans`) ------------------------------------------------------


def _build_planned(
    plan: Plan,
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
        elif kwargs:
            try:
                "".join(kwargs)  # every key a string (inline: a call costs a third more per job)
            except TypeError:
                check_kwargs_keys(kwargs, task_id, name)
        if header is not None and index:
            header(*args, **kwargs)
        if (
            type(task_id) is not str
            or not 0 < len(task_id) <= MAX_TASK_ID_LENGTH
            or not task_id.isascii()
            or not task_id.isprintable()  # (a control character: refused by check_task_id)
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
    state: AppState | None = None,
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
        plan = plan_for(app, task, options, first_args, first_kwargs, state)
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
