"""Writing the stored envelope (the format: :mod:`.envelope`): one job's
(:func:`encode_envelope`), or many jobs' of one task and one set of options from the
:class:`Pieces` they share (:func:`shared_pieces`, :func:`envelope_from_pieces`: the same text
:func:`encode_envelope` writes, built by joining strings).

Each drops what :func:`.envelope.decode_envelope` rebuilds (a header or property equal to its
default, or to a value stored anyway), puts the job's own fields first when it can (see
:mod:`.envelope`), and checks the result: at most ``delayq_max_payload`` long
(:class:`~..exceptions.PayloadTooLarge`), options that are JSON and not nested deeper than the
beat reads (:class:`~..exceptions.InvalidOptions`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _jstr
from typing import Any

from ..due import local_now_ms
from ..exceptions import CorruptData, InvalidOptions, PayloadTooLarge
from .bounded import MAX_DEPTH, check_depth
from .envelope import ENVELOPE_VERSION, JSON_CT, PLAIN_TAIL, UTF8

__all__ = [
    "JobBody",
    "Pieces",
    "body_members",
    "encode_envelope",
    "envelope_from_pieces",
    "is_plain_embed",
    "plain_body",
    "schedule_member",
    "shared_pieces",
]

#: Protocol-2 headers in the order Celery's ``as_task_v2`` builds them.
_HEADER_ORDER = (
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps",
)  # fmt: skip
_PROPS_ORDER = ("correlation_id", "reply_to")
_NONE_HEADERS = frozenset(("shadow", "eta", "group", "group_index", "parent_id", "stamped_headers"))
_ZERO_HEADERS = frozenset(("retries", "replaced_task_nesting"))
#: Headers with a short field of their own when they are strings: (field, value left out).
_SHORT_HEADERS = {"argsrepr": ("a", "()"), "kwargsrepr": ("k", "{}"), "origin": ("o", None)}


def _header_is_default(key: str, value: Any, job_id: str, name: str, expires_iso: str | None) -> bool:
    """True when decode_envelope rebuilds ``value`` for header ``key`` (types compared too:
    0, False and 0.0 are different JSON)."""
    if key in _NONE_HEADERS:
        return value is None
    if key in _ZERO_HEADERS:
        return type(value) is int and value == 0
    if key == "lang":
        return type(value) is str and value == "py"
    if key == "task":
        return type(value) is str and value == name
    if key == "id" or key == "root_id":
        return type(value) is str and value == job_id
    if key == "expires":
        return value is None if expires_iso is None else (type(value) is str and value == expires_iso)
    if key == "timelimit":
        return type(value) in (list, tuple) and len(value) == 2 and value[0] is None and value[1] is None
    if key == "ignore_result":
        return value is False
    if key == "stamps":
        return type(value) is dict and not value
    return False


def _compact_headers(
    headers: dict[str, Any], job_id: str, name: str, expires_iso: str | None
) -> dict[str, Any]:
    """The envelope fields that hold ``headers``: ``a``, ``k``, ``o``, ``h``; or ``H`` (all of
    them) when their keys are not in Celery's order."""
    if tuple(headers)[: len(_HEADER_ORDER)] != _HEADER_ORDER:
        return {"H": headers}
    short: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in headers.items():
        if key in _SHORT_HEADERS and type(value) is str:
            field_, default = _SHORT_HEADERS[key]
            if value != default:
                short[field_] = value
        elif not _header_is_default(key, value, job_id, name, expires_iso):
            other[key] = value
    out: dict[str, Any] = {f: short[f] for f in ("a", "k", "o") if f in short}
    if other:
        out["h"] = other
    return out


def _compact_props(props: dict[str, Any], job_id: str) -> dict[str, Any]:
    """The envelope fields that hold ``props``: ``r``, ``p``; or ``P`` when not in Celery's order."""
    if tuple(props)[: len(_PROPS_ORDER)] != _PROPS_ORDER:
        return {"P": props}
    out: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in props.items():
        if key == "correlation_id" and type(value) is str and value == job_id:
            continue
        if key == "reply_to" and type(value) is str:
            if value:
                out["r"] = value
            continue
        other[key] = value
    if other:
        out["p"] = other
    return out


def _body_fields(content_type: Any, content_encoding: Any, payload: Any) -> dict[str, Any]:
    """``j``/``b``/``z`` and, unless JSON in UTF-8, ``ct``/``ce``."""
    out: dict[str, Any] = {}
    if isinstance(payload, bytes | bytearray | memoryview):
        out["z"] = base64.b64encode(payload).decode("ascii")
    elif payload.endswith(PLAIN_TAIL):
        out["j"] = payload[: -len(PLAIN_TAIL)]
    else:
        out["b"] = payload
    if not (type(content_type) is str and content_type == JSON_CT):
        out["ct"] = content_type
    if not (type(content_encoding) is str and content_encoding == UTF8):
        out["ce"] = content_encoding
    return out


def _route_field(route: dict[str, Any]) -> dict[str, Any]:
    """``q``: the queue name alone when that is the whole route."""
    if not route:
        return {}
    if len(route) == 1 and type(route.get("queue")) is str:
        return {"q": route["queue"]}
    return {"q": route}


def _dump(envelope: dict[str, Any], name: str, route: dict[str, Any]) -> str:
    """``envelope`` as compact JSON; :class:`InvalidOptions` naming what is not JSON."""
    try:
        return json.dumps(envelope, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in route.items() if not _json_ok(v)]
        raise InvalidOptions(
            f"options {bad or list(route)} of {name!r} cannot be stored "
            f"(they must be JSON-serializable): {exc}"
        ) from exc


def _check_size(encoded: str, max_payload: int | None, task_id: str, name: str) -> str:
    """``encoded`` when the beat will read it: at most ``max_payload`` long, not nested too deep."""
    if max_payload is not None and len(encoded) > max_payload:
        raise PayloadTooLarge(
            f"job {task_id!r} of {name!r} is {len(encoded)} bytes, over delayq_max_payload "
            f"({max_payload}); store large data elsewhere and pass a reference"
        )
    try:
        check_depth(encoded, "envelope")
    except CorruptData:
        raise InvalidOptions(
            f"job {task_id!r} of {name!r} nests its options or headers more than {MAX_DEPTH} "
            "levels deep; the beat would refuse it"
        ) from None
    return encoded


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _members(fields: dict[str, Any]) -> str:
    """``fields`` as JSON object _members, each after a comma: ``,"a":1,"b":2``."""
    if not fields:
        return ""
    return "," + json.dumps(fields, separators=(",", ":"))[1:-1]


def encode_envelope(
    task_id: str,
    name: str,
    message: tuple[dict[str, Any], dict[str, Any]],
    body: tuple[Any, Any, Any],
    route: dict[str, Any],
    expires: tuple[int, str] | None,
    schedule: tuple[str, int] | None,
    max_payload: int | None,
) -> str:
    """The envelope of one job: ``message`` is the ``(headers, properties)`` Celery built for
    it, ``body`` its ``(content type, content encoding, serialized body)``, ``route`` the
    routed options left, ``expires`` its absolute expiry in ms and as the header gives it;
    created now. Checked by :func:`_check_size`."""
    headers, props = message
    expires_ms, expires_iso = (None, None) if expires is None else expires
    envelope: dict[str, Any] = {"v": ENVELOPE_VERSION, "i": task_id}
    header_fields = _compact_headers(headers, task_id, name, expires_iso)
    body_fields = _body_fields(*body)
    envelope.update(_job_fields(header_fields, body_fields))
    envelope["t"] = name
    envelope.update(header_fields)
    envelope.update(_compact_props(props, task_id))
    envelope.update(body_fields)
    envelope.update(_route_field(route))
    if expires_ms is not None:
        envelope["x"] = expires_ms
    envelope["c"] = local_now_ms()
    if schedule is not None:
        envelope["s"] = [schedule[0], schedule[1]]
    return _check_size(_dump(envelope, name, route), max_payload, task_id, name)


def _job_fields(header_fields: dict[str, Any], body_fields: dict[str, Any]) -> dict[str, Any]:
    """The job's own fields, taken out of ``header_fields`` and ``body_fields``: ``a``, ``k``
    and ``j`` or ``b``, in this order; none for headers not in Celery's order or a binary body
    (see the module's docstring)."""
    if "H" in header_fields or "z" in body_fields:
        return {}
    field = "j" if "j" in body_fields else "b"
    argsrepr = header_fields.pop("a", "()")
    kwargsrepr = header_fields.pop("k", "{}")
    text = body_fields.pop(field)
    return {"a": argsrepr, "k": kwargsrepr, field: text}


# -- the same, in pieces: for many jobs of one task and options (see .build) -----------------


@dataclass(frozen=True)
class Pieces:
    """What the envelopes of jobs of one task and one set of options share, as JSON text
    around the per-job fields (id, argument reprs, body, expiry, creation, schedule point)."""

    name: str
    head: str  # the task name member
    middle: str  # after the reprs, before the body: the other headers and properties
    tail: str  # after the body: the route


def shared_pieces(
    name: str, message: tuple[dict[str, Any], dict[str, Any]], stand_in: tuple[str, str | None],
    route: dict[str, Any],
) -> Pieces | None:  # fmt: skip
    """The :class:`Pieces` of the ``(headers, properties)`` Celery built for a stand-in job
    (``stand_in``: its id and expires header), or None when they cannot be shared: headers
    or properties not in Celery's order, or a route that is not JSON (the one-job way says
    why)."""
    headers, props = message
    job_id, expires_iso = stand_in
    header_fields = _compact_headers(headers, job_id, name, expires_iso)
    prop_fields = _compact_props(props, job_id)
    if "H" in header_fields or "P" in prop_fields:
        return None
    header_fields.pop("a", None)  # per job
    header_fields.pop("k", None)
    try:
        middle = _members({**header_fields, **prop_fields})
        tail = _members(_route_field(route))
    except (TypeError, ValueError):
        return None
    return Pieces(name=name, head=',"t":' + _jstr(name), middle=middle, tail=tail)


def is_plain_embed(encoded: str) -> bool:
    """True when ``encoded``, Celery's body ``embed`` as kombu's JSON writes it, is the plain
    one (no callbacks, errbacks, chain or chord): such a body is stored as ``j``."""
    return encoded == PLAIN_TAIL[2:-1]


#: A job's body for :func:`envelope_from_pieces`: ``(field, text, other members)``, the field
#: ``"j"`` or ``"b"`` with its text; or ``""`` and ``""`` and the body's members (binary).
JobBody = tuple[str, str, str]


def plain_body(encoded_args: str) -> JobBody:
    """The body of a plain JSON body, from ``[args, kwargs]`` as kombu's JSON writes it."""
    return ("j", encoded_args[:-1], "")


def body_members(content_type: Any, content_encoding: Any, payload: Any) -> JobBody:
    """The body of any other body (its content type and encoding when not JSON/UTF-8)."""
    fields = _body_fields(content_type, content_encoding, payload)
    for field in ("j", "b"):
        if field in fields:
            text = fields.pop(field)
            return (field, text, _members(fields))
    return ("", "", _members(fields))


def schedule_member(schedule: tuple[str, int] | None) -> str:
    """The member marking a schedule's execution point, or nothing."""
    return "" if schedule is None else _members({"s": [schedule[0], schedule[1]]})


def envelope_from_pieces(
    pieces: Pieces, task_id: str, reprs: tuple[str, str], body: JobBody, expires_ms: int | None,
    sched: str, max_payload: int | None,
) -> str:  # fmt: skip
    """One job's envelope from ``pieces``: exactly what :func:`encode_envelope` writes."""
    argsrepr, kwargsrepr = reprs
    field, text, members = body
    parts = ['{"v":3,"i":', _jstr(task_id)]
    if field:
        parts += (
            ',"a":',
            _jstr(argsrepr),
            ',"k":',
            _jstr(kwargsrepr),
            ',"',
            field,
            '":',
            _jstr(text),
            pieces.head,
        )
    else:
        parts.append(pieces.head)
        if argsrepr != "()":
            parts += (',"a":', _jstr(argsrepr))
        if kwargsrepr != "{}":
            parts += (',"k":', _jstr(kwargsrepr))
    parts += (pieces.middle, members, pieces.tail)
    if expires_ms is not None:
        parts += (',"x":', str(expires_ms))
    parts += (',"c":', str(local_now_ms()), sched, "}")
    return _check_size("".join(parts), max_payload, task_id, pieces.name)
