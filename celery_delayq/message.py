"""The stored envelope: a Celery message built at schedule time, published later.

At schedule time :func:`build_envelope` (one job) and :func:`build_envelopes`
(many jobs of one task and one set of options) do what ``Task.apply_async``
and ``Celery.send_task`` do before they publish: argument check against the
task's signature, the task's execution options, the router (queue, exchange,
routing key, priority), the protocol-2 headers and the body, serialized with
the task's serializer. What ``apply_async`` would have published is stored,
less the ``eta`` (the worker must run it at once) and with ``expires`` made
absolute.

At dispatch :func:`.routing.send_task` hands that message to Celery's own
``app.amqp.send_task_message`` (so ``before_task_publish``/``after_task_publish``
fire at the moment it really enters the broker) with the body already
serialized: kombu publishes the stored bytes as they are.

The envelope is compact JSON (version 2). It stores only what cannot be
rebuilt: a header or property equal to its default, or to a value that is
stored anyway (the id, the task name, the absolute expiry), is left out, and
:func:`decode_envelope` puts it back, in Celery's order::

    {"v": 2, "i": task id, "t": task name,
     "a": argsrepr, "k": kwargsrepr, "o": origin, "h": {other headers},
     "r": reply_to, "p": {other properties},
     "j": JSON body less its plain tail | "b": body text | "z": base64 body,
     "ct": content type, "ce": content encoding,
     "q": queue name | {routed options},
     "x": absolute expiry ms, "c": created ms, "s": [schedule name, point ms]}

Version 1 envelopes (every header and property in full) are still read.

Building many jobs goes through a *plan*: everything that depends only on the
task and the options (execution options, route, serializer, the headers and
properties Celery would build, their compact JSON) is worked out once, by
Celery's own ``create_task_message``, and kept per app; per job only the id,
the arguments (signature check, ``argsrepr``/``kwargsrepr``, body) and the
expiry are computed. When anything could make a message depend on its
arguments in another way (a task overriding ``shadow_name``, a router
function, a custom ``create_task_message``), each job is built on its own, the
way ``apply_async`` does it.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from json.encoder import encode_basestring_ascii as _jstr
from typing import Any

import kombu.compression
import kombu.utils.json as kombu_json
from celery.app.amqp import AMQP
from celery.app.routes import MapRoute
from celery.utils.functional import maybe_list
from celery.utils.saferepr import saferepr
from kombu.entity import DELIVERY_MODES, Exchange, Queue
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, registry

from .bounded import MAX_DEPTH, check_depth, load_json
from .exceptions import (
    CorruptData,
    InvalidArguments,
    InvalidDueTime,
    InvalidOptions,
    InvalidTaskId,
    PayloadTooLarge,
    SerializationError,
)

__all__ = [
    "DUE_HEADER",
    "MAX_TASK_ID_LENGTH",
    "Envelope",
    "build_envelope",
    "build_envelopes",
    "celery_naive_as_utc",
    "decode_envelope",
    "due_iso",
    "due_item",
    "due_ms_from_delay",
    "due_ms_from_eta",
    "ms_to_datetime",
    "new_task_ids",
]

ENVELOPE_VERSION = 2

#: Header added at publish: the job's due time, seconds since the epoch (float).
DUE_HEADER = "delayq_due"

# The latest due time accepted: the last millisecond of year 9999 (datetime's limit).
MAX_DUE_MS = 253_402_300_799_999

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

def _now_ms() -> int:
    return int(time.time() * 1000)


def ms_to_datetime(ms: float) -> datetime:
    """UTC-aware datetime of ``ms`` milliseconds since the epoch.

    >>> ms_to_datetime(1_700_000_000_000).isoformat()
    '2023-11-14T22:13:20+00:00'
    """
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def due_iso(due_ms: int) -> str:
    """The ``eta`` header of a job due at ``due_ms`` (``delayq_publish_eta``): the UTC time,
    exact to the millisecond, as Celery's ``as_task_v2`` writes an aware ``eta``
    (``datetime.isoformat()``, so no fraction when it is a whole second).

    >>> due_iso(1_700_000_000_123), due_iso(1_700_000_000_000)
    ('2023-11-14T22:13:20.123000+00:00', '2023-11-14T22:13:20+00:00')
    """
    return (_EPOCH + timedelta(milliseconds=due_ms)).isoformat()


def _check_ms(ms: float, what: str) -> int:
    if not math.isfinite(ms):
        raise InvalidDueTime(f"{what} must be finite, got {ms / 1000.0!r}")
    if ms < 0:
        raise InvalidDueTime(f"{what} must not be before 1970-01-01T00:00:00Z, got {ms / 1000.0!r} s")
    if ms > MAX_DUE_MS:
        raise InvalidDueTime(f"{what} is past year 9999: {ms / 1000.0!r} s since the epoch")
    return round(ms)


def celery_naive_as_utc(value: Any) -> Any:
    """``value`` (an ``eta`` or ``expires`` given to ``apply_async``) as Celery reads it.

    Celery's worker reads a naive datetime, or an ISO-8601 string without an
    offset, as UTC, whatever ``timezone`` and ``enable_utc`` say
    (``maybe_make_aware(..., naive_as_utc=True)`` in ``celery.worker.request``;
    the same in Celery 5.4 to 5.7). Such a value comes back aware, in UTC;
    anything else comes back as it is.

    >>> celery_naive_as_utc(datetime(2030, 1, 1, 9)).isoformat()
    '2030-01-01T09:00:00+00:00'
    >>> celery_naive_as_utc("2030-01-01T09:00:00").isoformat()
    '2030-01-01T09:00:00+00:00'
    >>> celery_naive_as_utc("2030-01-01T09:00:00+01:00")
    '2030-01-01T09:00:00+01:00'
    """
    parsed = value
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return value  # due_ms_from_eta says what is wrong with it
    if isinstance(parsed, datetime) and (parsed.tzinfo is None or parsed.utcoffset() is None):
        return parsed.replace(tzinfo=UTC)
    return value


def celery_expires(value: Any, now: datetime | None = None) -> Any:
    """An ``expires`` given to an intercepted ``apply_async``, as Celery reads it.

    Celery counts a number of seconds from the call, not from the due time
    (``as_task_v2``), so a task due in an hour with ``expires=600`` expires
    before it is due; it comes back as that absolute, aware time. A naive
    datetime (or ISO string) is UTC (:func:`celery_naive_as_utc`). Anything
    else comes back as it is, for :func:`build_envelopes` to check.

    >>> celery_expires(600, now=datetime(2030, 1, 1, tzinfo=UTC)).isoformat()
    '2030-01-01T00:10:00+00:00'
    >>> celery_expires(None) is None
    True
    """
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < 1e10
    ):
        return (now or datetime.now(UTC)) + timedelta(seconds=value)
    return celery_naive_as_utc(value)


def due_ms_from_eta(eta: Any, app: Any, *, naive_in_zone: bool = False) -> int:
    """Milliseconds since the epoch for a due time.

    ``eta`` is an aware ``datetime``, a UNIX timestamp in seconds (int or
    float), or an ISO-8601 string. A naive datetime (or string without an
    offset) is read:

    * with ``naive_in_zone=True`` (the command line, Spark): in the app's timezone
      (``app.conf.timezone``; UTC when unset and ``enable_utc`` is on, the
      default). When ``enable_utc`` is off and no ``timezone`` is set, it could
      only mean this machine's local time: refused.
    * by default (``apply_at``, ``celery_delayq.apply_at`` and the :class:`~celery_delayq.DelayQ` API): as
      UTC, Celery's rule for a naive ``eta``, when the app's timezone is UTC
      (where every reading agrees); refused otherwise, since there the app's
      zone and Celery's rule name different instants.

    An intercepted ``apply_async(eta=...)`` first makes a naive value aware
    by Celery's rule (:func:`celery_naive_as_utc`).

    >>> from celery import Celery
    >>> due_ms_from_eta(1_700_000_000.5, Celery())
    1700000000500
    >>> due_ms_from_eta(datetime(2030, 1, 1), Celery())  # naive: UTC by default
    1893456000000
    """
    if isinstance(eta, bool):
        raise InvalidDueTime(f"eta must be a datetime or a UNIX timestamp, got {eta!r}")
    if isinstance(eta, int | float):
        try:
            seconds = float(eta)
        except OverflowError as exc:
            raise InvalidDueTime(f"eta is out of range: {eta!r}") from exc
        return _check_ms(seconds * 1000.0, "eta")
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError as exc:
            raise InvalidDueTime(f"eta string is not ISO-8601: {eta!r}") from exc
    if not isinstance(eta, datetime):
        raise InvalidDueTime(
            f"eta must be an aware datetime or a UNIX timestamp in seconds, got {type(eta).__name__}"
        )
    if eta.tzinfo is None or eta.tzinfo.utcoffset(eta) is None:
        eta = eta.replace(tzinfo=_naive_zone(eta, app, naive_in_zone))
    try:
        seconds = eta.timestamp()
    except (OverflowError, ValueError, OSError) as exc:
        raise InvalidDueTime(f"eta {eta!r} is out of range") from exc
    return _check_ms(seconds * 1000.0, "eta")


def _naive_zone(eta: datetime, app: Any, in_zone: bool) -> Any:
    """The zone a naive ``eta`` is read in (see :func:`due_ms_from_eta`), or InvalidDueTime."""
    conf = app.conf
    if in_zone:
        if not conf.timezone and not conf.enable_utc:
            raise InvalidDueTime(
                f"naive datetime {eta.isoformat()} refused: enable_utc is off and no timezone is "
                "set, so it could only mean this machine's local time; pass an aware datetime "
                "or set app.conf.timezone"
            )
        return app.timezone
    if (app.uses_utc_timezone() if conf.timezone else conf.enable_utc):
        return UTC  # (the local zone is refused even on a machine in UTC: the same code elsewhere is not)
    zone = conf.timezone or "this machine's local time (enable_utc is off, no timezone set)"
    raise InvalidDueTime(
        f"naive datetime {eta.isoformat()} refused: Celery reads a naive eta as UTC, but this "
        f"app's timezone is {zone}, so it is ambiguous; pass an aware datetime "
        "(tzinfo=ZoneInfo(...) or timezone.utc) or a UNIX timestamp"
    )


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
        f"apply_at_many item {index} must be an (eta, args, kwargs) tuple, got {kind}: {_short(item)}"
    )


def due_ms_from_delay(delay: Any, now_ms: int | None = None) -> int:
    """Milliseconds since the epoch for an ``apply_in`` delay (seconds or timedelta).

    >>> due_ms_from_delay(1.5, now_ms=1000)
    2500
    """
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError as exc:
            raise InvalidDueTime(f"delay is out of range: {delay!r}") from exc
    else:
        raise InvalidDueTime(f"delay must be seconds or a timedelta, got {type(delay).__name__}")
    if not math.isfinite(seconds):
        raise InvalidDueTime(f"delay must be finite, got {seconds!r}")
    if seconds < 0:
        raise InvalidDueTime(f"delay must not be negative, got {seconds!r} s")
    base = _now_ms() if now_ms is None else now_ms
    return _check_ms(base + seconds * 1000.0, "now + delay")


def _expires_ms(expires: Any, due_ms: int, app: Any) -> int | None:
    """``expires`` as absolute ms: seconds/timedelta count from the due time."""
    if expires is None:
        return None
    if isinstance(expires, timedelta):
        return due_ms + int(expires.total_seconds() * 1000)
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        if not math.isfinite(expires) or expires < 0:
            raise InvalidOptions(f"expires must be a finite number of seconds >= 0, got {expires!r}")
        return due_ms + int(expires * 1000)
    try:
        return due_ms_from_eta(expires, app)
    except InvalidDueTime as exc:
        raise InvalidOptions(f"expires: {exc}") from exc


def _name(value: Any) -> Any:
    if isinstance(value, Queue | Exchange):
        return value.name
    return value


@dataclass(frozen=True)
class Envelope:
    """A decoded envelope, ready to publish."""

    task: str
    headers: dict[str, Any]
    props: dict[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    route: dict[str, Any]
    expires_ms: int | None
    created_ms: int
    #: For a recurring schedule's execution point: (schedule name, point ms).
    schedule: tuple[str, int] | None = None


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
        f"{h[i:i + 8]}-{h[i + 8:i + 12]}-4{h[i + 13:i + 16]}-"
        f"{v[h[i + 16]]}{h[i + 17:i + 20]}-{h[i + 20:i + 32]}"
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


# -- the compact (version 2) fields -----------------------------------------------------------

#: Celery's body ``embed`` with no callbacks, errbacks, chain or chord, as kombu's JSON writes
#: it at the end of a body: a JSON body ending so is stored without this tail (field ``j``).
_PLAIN_TAIL = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
_JSON_CT = "application/json"
_UTF8 = "utf-8"

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
    elif payload.endswith(_PLAIN_TAIL):
        out["j"] = payload[: -len(_PLAIN_TAIL)]
    else:
        out["b"] = payload
    if not (type(content_type) is str and content_type == _JSON_CT):
        out["ct"] = content_type
    if not (type(content_encoding) is str and content_encoding == _UTF8):
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
    try:
        return json.dumps(envelope, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in route.items() if not _json_ok(v)]
        raise InvalidOptions(
            f"options {bad or list(route)} of {name!r} cannot be stored "
            f"(they must be JSON-serializable): {exc}"
        ) from exc


def _check_size(encoded: str, max_payload: int | None, task_id: str, name: str) -> str:
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


def _serialization_error(name: str, serializer: Any, exc: BaseException) -> SerializationError:
    return SerializationError(f"cannot serialize the arguments of {name!r} with {serializer!r}: {exc}")


# -- options ------------------------------------------------------------------------------------


def _clean_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
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
    if isinstance(headers, Mapping) and DUE_HEADER in headers:
        # A retry (``self.retry``) passes the request's headers on, with the due time of the
        # attempt that is running; the beat sets the new job's own at publish.
        options["headers"] = {k: v for k, v in headers.items() if k != DUE_HEADER}
    return options


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length an error message can carry."""
    text: str = saferepr(value, 60)
    return text if len(text) <= 80 else text[:77] + "..."


def _job(task_id: Any, name: str) -> str:
    return f"job {_short(task_id)} of {name!r}"


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
            f"task_id of {name!r} must be a string, got {type(task_id).__name__}: {_short(task_id)}"
        )
    if not task_id:
        raise InvalidTaskId(f"task_id of {name!r} must not be empty")
    if len(task_id) > MAX_TASK_ID_LENGTH:
        raise InvalidTaskId(
            f"task_id {_short(task_id)} of {name!r} is {len(task_id)} characters, over the limit "
            f"of {MAX_TASK_ID_LENGTH} (celery_delayq.message.MAX_TASK_ID_LENGTH)"
        )
    if not task_id.isascii():
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTaskId(
                f"task_id {_short(task_id)} of {name!r} is not UTF-8 text ({exc.reason}: "
                f"{task_id[exc.start]!r} at position {exc.start}); Redis cannot store it"
            ) from None
    return task_id


def _job_args(args: Any, task_id: Any, name: str) -> tuple[Any, ...]:
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
        f"{_job(task_id, name)}: args must be a list or tuple, got {type(args).__name__}: {_short(args)}"
    )


def _job_kwargs(kwargs: Any, task_id: Any, name: str) -> dict[str, Any]:
    """A job's ``kwargs`` as a dict; as in Celery, anything false is none, else a mapping."""
    if isinstance(kwargs, Mapping):
        return dict(kwargs)
    try:
        empty = kwargs is None or not kwargs
    except Exception:  # (as above)
        empty = False
    if empty:
        return {}
    raise InvalidArguments(
        f"{_job(task_id, name)}: kwargs must be a mapping (a dict), got {type(kwargs).__name__}: "
        f"{_short(kwargs)}"
    )


def _time_limit_ok(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0


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
    ("delivery_mode",
     lambda v: isinstance(v, numbers.Integral) or (isinstance(v, str) and v in DELIVERY_MODES),
     "1, 2, 'transient' or 'persistent'"),
    ("time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("soft_time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("stamped_headers", lambda v: isinstance(v, list | tuple) and all(type(h) is str for h in v),
     "a list of option names"),
)  # fmt: skip


def _check_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse, with :class:`InvalidOptions`, an option (given to the call, or else a default of
    the task) that Celery's ``apply_async`` would refuse or that cannot work. Called where the
    route is made: once per call (or per distinct options, when the route is kept)."""
    for option, test, must in _OPTION_CHECKS:
        value = options[option] if option in options else defaults.get(option)
        if value is not None and not test(value):
            where = "" if option in options else " (the task's default)"
            raise InvalidOptions(
                f"option {option!r}{where} must be {must}, got {type(value).__name__}: {_short(value)}"
            )
    stamps = options.get("stamped_headers")
    if stamps:
        missing = [h for h in stamps if h not in options]
        if missing:
            raise InvalidOptions(f"option 'stamped_headers' names options not given: {missing}")


def _check_signature(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if task.typing:
        header = getattr(task, "__header__", None)
        if header is not None:
            header(*args, **kwargs)


def _route(app: Any, options: dict[str, Any], name: str, route_name: Any, args: Any, kwargs: Any,
           task: Any) -> dict[str, Any]:
    try:
        return dict(app.amqp.router.route(options, route_name or name, args, kwargs, task))
    except Exception as exc:  # QueueNotFound, a router raising: refuse now, not in beat
        raise InvalidOptions(f"cannot route task {name!r}: {exc}") from exc


def _parents(app: Any, root_id: Any, parent_id: Any) -> tuple[Any, Any]:
    """``root_id``/``parent_id`` as ``apply_async`` completes them inside a worker task."""
    if not root_id or not parent_id:
        parent = app.current_worker_task
        if parent:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
    return root_id, parent_id


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
) -> str:
    """One envelope, every step as ``apply_async`` takes it (``options`` already cleaned)."""
    task_name = task if isinstance(task, str) else task.name
    check_task_id(task_id, task_name)
    args = _job_args(args, task_id, task_name)
    kwargs = _job_kwargs(kwargs, task_id, task_name)
    options = dict(options)
    if isinstance(task, str):
        task = _UnregisteredTask(app, task)
    _check_signature(task, args, kwargs)
    defaults = task._get_exec_options()
    _check_options(options, defaults)
    shadow = options.pop("shadow", None) or task.shadow_name(args, kwargs, options)
    options = dict(defaults, **options)
    options.setdefault("ignore_result", task.ignore_result)
    name = task.name

    expires = _expires_ms(options.pop("expires", None), due_ms, app)
    time_limit = options.pop("time_limit", None)
    soft_time_limit = options.pop("soft_time_limit", None)
    ignore_result = options.pop("ignore_result", None)
    link = options.pop("link", None)
    link_error = options.pop("link_error", None)
    route_name = options.pop("route_name", None)
    options = _route(app, options, name, route_name, args, kwargs, task)

    root_id, parent_id = _parents(app, options.pop("root_id", None), options.pop("parent_id", None))
    serializer = options.pop("serializer", None) or app.conf.task_serializer
    expires_iso = ms_to_datetime(expires).isoformat() if expires is not None else None
    message = app.amqp.create_task_message(
        task_id,
        name,
        args,
        kwargs,
        None,
        None,
        options.pop("group_id", None),
        options.pop("group_index", None),
        expires_iso,
        options.pop("retries", 0),
        options.pop("chord", None),
        maybe_list(link),
        maybe_list(link_error),
        options.pop("reply_to", None) or app.thread_oid,
        time_limit,
        soft_time_limit,
        False,
        root_id,
        parent_id,
        shadow,
        options.pop("chain", None),
        ignore_result=ignore_result,
        replaced_task_nesting=options.pop("replaced_task_nesting", 0),
        **options,
    )
    for stamp in options.pop("stamped_headers", None) or []:
        options.pop(stamp, None)
    for name_ in ("argsrepr", "kwargsrepr", "origin"):
        options.pop(name_, None)
    headers, props, body, _ = message
    try:
        content_type, content_encoding, payload = dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise _serialization_error(name, serializer, exc) from exc

    route = {key: _name(value) for key, value in options.items() if value is not None}
    envelope: dict[str, Any] = {"v": ENVELOPE_VERSION, "i": task_id, "t": name}
    envelope.update(_compact_headers(headers, task_id, name, expires_iso))
    envelope.update(_compact_props(props, task_id))
    envelope.update(_body_fields(content_type, content_encoding, payload))
    envelope.update(_route_field(route))
    if expires is not None:
        envelope["x"] = expires
    envelope["c"] = _now_ms()
    if schedule is not None:
        envelope["s"] = [schedule[0], schedule[1]]
    return _check_size(_dump(envelope, name, route), max_payload, task_id, name)


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


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- many jobs: one plan per task and options ---------------------------------------------------

#: Stand for the job's id and expires header in a plan's template message.
_ID = "\x00delayq:id\x00"
_EXPIRES = "\x00delayq:expires\x00"
#: Most (task, options) routes, and plans per route, kept per app.
_ROUTES_KEPT = 256
_PLANS_KEPT = 64
_KEYABLE = frozenset((str, int, bool, type(None)))
_MISSING: Any = object()


@dataclass(eq=False)
class _AppState:
    """What delayq keeps per app between calls, valid while the app's settings are unchanged."""

    conf: Any
    changes: Any
    snapshot: dict[str, Any] | None
    maps: int
    always_eager: bool
    json_codec: Any
    json_encoder: Any
    routes: dict[Any, Any] = field(default_factory=dict)


def app_state(app: Any) -> _AppState:
    """The app's :class:`_AppState`, made anew when a setting changed since it was made.

    Every setting write (``app.conf.x = ...``, ``conf.update``) lands in
    ``conf.changes``; comparing it with a shallow copy is a C loop of identity
    checks, far cheaper than reading the settings again.
    """
    conf = app.conf
    state: _AppState | None = app.__dict__.get("_delayq_state")
    changes = getattr(conf, "changes", None)
    codec = getattr(registry, "_encoders", {}).get("json")
    if (
        state is not None
        and state.conf is conf
        and state.changes is changes
        and state.snapshot is not None
        and state.json_codec is codec
    ):
        try:
            if changes == state.snapshot and len(conf.maps) == state.maps:
                return state
        except Exception:  # a setting that cannot be compared: read everything again
            pass
    try:
        snapshot = dict(changes) if isinstance(changes, dict) else None
        maps = len(conf.maps)
    except Exception:
        snapshot, maps = None, 0
    state = _AppState(
        conf=conf,
        changes=changes,
        snapshot=snapshot,
        maps=maps,
        always_eager=bool(conf.task_always_eager),
        json_codec=codec,
        json_encoder=_stock_json_encoder(codec),
    )
    app.__dict__["_delayq_state"] = state
    return state


def _stock_json_encoder(codec: Any) -> Any:
    """kombu's JSON encoder when the ``json`` serializer is kombu's own, else None.

    kombu serializes with ``json.dumps(body, cls=JSONEncoder)``, which is
    ``JSONEncoder().encode(body)``: the same encoder, kept instead of made per job.
    """
    if codec is None or tuple(codec) != (_JSON_CT, _UTF8, kombu_json.dumps):
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


def _options_key(options: dict[str, Any]) -> tuple[Any, ...] | None:
    """A dict key for ``options`` (types kept apart: 1, 1.0 and True differ in JSON), or None."""
    items = []
    for key, value in options.items():
        kind = type(value)
        if kind is float:
            items.append((key, kind, repr(value)))  # -0.0 == 0.0 and nan != nan, but not as text
        elif kind in _KEYABLE:
            items.append((key, kind, value))
        else:
            return None
    return tuple(items)


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
class _Route:
    """The part of a plan that depends on the task and the options only."""

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


@dataclass(eq=False)
class _Plan:
    """Everything about a job's envelope but its id, arguments, expiry and creation time."""

    name: str
    header: Callable[..., Any] | None
    head: str
    argsrepr: str | None
    kwargsrepr: str | None
    args_max: Any
    kwargs_max: Any
    maxlevels: Any
    middle: str
    tail: str
    encoder: Any
    plain: bool
    embed: Any
    serializer: Any
    expires: tuple[bool, int] | None
    root_id: Any


def _is_plain_task(task: Any) -> bool:
    """True when nothing of the task makes its message depend on the arguments but the body."""
    if isinstance(task, _UnregisteredTask):
        return True
    from celery.app.task import Task

    return getattr(type(task), "shadow_name", None) is Task.shadow_name and "shadow_name" not in vars(task)


def _make_route(app: Any, task: Any, options: dict[str, Any], args: Any, kwargs: Any) -> _Route | None:
    """Execution options, expiry and route, as apply_async finds them; None when they (or the
    message) could depend on the arguments: then each job is built on its own."""
    from celery.app.routes import Router

    amqp = app.amqp
    create = amqp.create_task_message
    stock = getattr(create, "__func__", None) is AMQP.as_task_v2
    if not stock or getattr(create, "__self__", None) is not amqp:
        return None
    router = app.amqp.router
    if type(router) is not Router or not all(isinstance(r, MapRoute) for r in router.routes):
        return None
    resolved = _UnregisteredTask(app, task) if isinstance(task, str) else task
    defaults = resolved._get_exec_options()
    _check_options(options, defaults)
    options = dict(options)
    shadow = options.pop("shadow", None)
    if not shadow:
        if not _is_plain_task(resolved):
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
    return _Route(
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


def _members(fields: dict[str, Any]) -> str:
    """``fields`` as JSON object members, each after a comma: ``,"a":1,"b":2``."""
    if not fields:
        return ""
    return "," + json.dumps(fields, separators=(",", ":"))[1:-1]


def _make_plan(
    app: Any, state: _AppState, route: _Route, root_id: Any, parent_id: Any, reply_to: Any
) -> _Plan | None:
    """Celery's message for a stand-in job, turned into the envelope parts every job shares."""
    options = dict(route.routed)
    name = route.name
    expires_iso = _EXPIRES if route.expires is not None else None
    amqp = app.amqp
    message = amqp.create_task_message(
        _ID,
        name,
        (),
        {},
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
    argsrepr = options.pop("argsrepr", None)
    kwargsrepr = options.pop("kwargsrepr", None)
    options.pop("origin", None)
    if not (argsrepr is None or type(argsrepr) is str) or not (kwargsrepr is None or type(kwargsrepr) is str):
        return None
    headers, props, body, _ = message
    if not (type(body) is tuple and len(body) == 3):
        return None
    header_fields = _compact_headers(headers, _ID, name, expires_iso)
    prop_fields = _compact_props(props, _ID)
    if "H" in header_fields or "P" in prop_fields:
        return None
    header_fields.pop("a", None)  # per job
    header_fields.pop("k", None)
    route_out = {key: _name(value) for key, value in options.items() if value is not None}
    try:
        middle = _members({**header_fields, **prop_fields})
        tail = _members(_route_field(route_out))
    except (TypeError, ValueError):
        return None  # built the long way, which says what cannot be stored
    embed = body[2]
    serializer = route.serializer
    encoder = state.json_encoder if type(serializer) is str and serializer == "json" else None
    plain = False
    if encoder is not None:
        try:
            plain = encoder.encode(embed) == _PLAIN_TAIL[2:-1]
        except Exception:
            encoder = None  # kombu will say what is wrong, job by job
    return _Plan(
        name=name,
        header=route.header,
        head=',"t":' + _jstr(name),
        argsrepr=argsrepr,
        kwargsrepr=kwargsrepr,
        args_max=amqp.argsrepr_maxsize,
        kwargs_max=amqp.kwargsrepr_maxsize,
        maxlevels=app.conf.task_repr_maxlevels,
        middle=middle,
        tail=tail,
        encoder=encoder,
        plain=plain,
        embed=embed,
        serializer=serializer,
        expires=route.expires,
        root_id=root_id if type(root_id) is str else None,
    )


def _plan_for(
    app: Any, task: Any, options: dict[str, Any], args: Any, kwargs: Any, state: _AppState | None = None
) -> _Plan | None:
    """The plan for ``task`` with (cleaned) ``options`` in this call's context, or None."""
    if state is None:
        state = app_state(app)
    key = _options_key(options)
    route_key = None if key is None else ((task if isinstance(task, str) else id(task)), key)
    route = _MISSING if route_key is None else state.routes.get(route_key, _MISSING)
    if route is not _MISSING and route is not None and not isinstance(task, str) and route.task is not task:
        route = _MISSING
    if route is _MISSING:
        route = _make_route(app, task, options, args, kwargs)
        if route_key is not None:
            if len(state.routes) >= _ROUTES_KEPT:
                state.routes.clear()
            state.routes[route_key] = route
    if route is None:
        return None
    root_id, parent_id = _parents(app, route.root_id, route.parent_id)
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
    name = plan.name
    header = plan.header
    head, middle, tail = plan.head, plan.middle, plan.tail
    given_args, given_kwargs = plan.argsrepr, plan.kwargsrepr
    args_max, kwargs_max, maxlevels = plan.args_max, plan.kwargs_max, plan.maxlevels
    encoder, plain, embed, serializer = plan.encoder, plan.plain, plan.embed, plan.serializer
    expires_plan, root_id = plan.expires, plan.root_id
    sched = "" if schedule is None else _members({"s": [schedule[0], schedule[1]]})
    out: list[str] = []
    for index, (task_id, due_ms, args, kwargs) in enumerate(jobs):
        if type(args) is not tuple:
            args = () if args is None else _job_args(args, task_id, name)
        if type(kwargs) is not dict:
            kwargs = {} if kwargs is None else _job_kwargs(kwargs, task_id, name)
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
        expires = None
        if expires_plan is not None:
            expires = due_ms + expires_plan[1] if expires_plan[0] else expires_plan[1]
            if not 0 <= expires <= MAX_DUE_MS:
                ms_to_datetime(expires).isoformat()  # raises as the expires header would
        argsrepr = given_args if given_args is not None else _saferepr(args, args_max, maxlevels)
        kwargsrepr = given_kwargs if given_kwargs is not None else _saferepr(kwargs, kwargs_max, maxlevels)
        if plain:
            try:
                text = encoder.encode((args, kwargs))
            except Exception as exc:
                error = EncodeError(exc)  # what kombu's dumps raises
                raise _serialization_error(name, serializer, error) from error
            body = ',"j":' + _jstr(text[:-1])
        else:
            try:
                if encoder is not None:
                    fields = _body_fields(_JSON_CT, _UTF8, encoder.encode((args, kwargs, embed)))
                else:
                    fields = _body_fields(*dumps((args, kwargs, embed), serializer=serializer))  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise _serialization_error(name, serializer, exc) from exc
            body = _members(fields)
        parts = ['{"v":2,"i":', _jstr(task_id), head]
        if argsrepr != "()":
            parts += (',"a":', _jstr(argsrepr))
        if kwargsrepr != "{}":
            parts += (',"k":', _jstr(kwargsrepr))
        parts += (middle, body, tail)
        if expires is not None:
            parts += (',"x":', str(expires))
        parts += (',"c":', str(_now_ms()), sched, "}")
        out.append(_check_size("".join(parts), max_payload, task_id, name))
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
) -> list[str]:
    """The envelopes of ``jobs`` (``(task id, due ms, args, kwargs)``), all of ``task`` with ``options``.

    Each is exactly what :func:`build_envelope` returns for that job, and is
    checked the same way (in the same order: a bad job raises what
    ``build_envelope`` would raise for it). See :func:`build_envelope`.
    ``state`` is :func:`app_state` of ``app`` when the caller just got it.
    """
    if not jobs:
        return []
    name = task if isinstance(task, str) else task.name
    try:
        options = _clean_options(options)
        first_id, first_due, first_args, first_kwargs = jobs[0]
        first_args = _job_args(first_args, first_id, name)
        first_kwargs = _job_kwargs(first_kwargs, first_id, name)
        jobs = [(first_id, first_due, first_args, first_kwargs), *jobs[1:]]

        def long_way(task_id: str, due_ms: int, args: Any, kwargs: Any) -> str:
            return _build_one(app, task, task_id, due_ms, args, kwargs, options, max_payload, schedule)

        if not isinstance(task, str):
            _check_signature(task, first_args, first_kwargs)
        plan = _plan_for(app, task, options, first_args, first_kwargs, state)
        if plan is None:
            return [long_way(*job) for job in jobs]
        return _build_planned(plan, jobs, max_payload, schedule, long_way)
    except InvalidOptions as exc:
        if repr(name) in str(exc):
            raise
        # Name the job (or jobs) in the messages of checks that do not know it.
        what = _job(jobs[0][0], name) if len(jobs) == 1 else f"the {len(jobs)} jobs of {name!r}"
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


# -- reading ------------------------------------------------------------------------------------


def decode_envelope(raw: str, max_bytes: int | None = None) -> Envelope:
    """Parse a stored envelope; ``ValueError`` (:class:`~.exceptions.CorruptData`) says what
    is wrong with a corrupt one: not JSON, not an object, nested deeper than
    :data:`~.bounded.MAX_DEPTH`, longer than ``max_bytes``, or a field missing or malformed."""
    data = load_json(raw, "envelope", dict, max_bytes)
    version = data.get("v")
    if version != 2 and version != 1:
        raise CorruptData(f"unknown envelope version {version!r}")
    try:
        return _decode_v2(data) if version == 2 else _decode_v1(data)
    except (KeyError, TypeError, ValueError, LookupError, OverflowError, OSError) as exc:
        raise CorruptData(f"envelope field missing or malformed: {exc!r}") from exc


def _decode_v2(data: dict[str, Any]) -> Envelope:
    job_id = data["i"]
    name = data["t"]
    if type(job_id) is not str or type(name) is not str:
        raise TypeError("i and t must be strings")
    expires_ms: Any = data.get("x")
    if expires_ms is not None and (isinstance(expires_ms, bool) or not isinstance(expires_ms, int | float)):
        raise TypeError("x must be a number")
    if "H" in data:
        headers = dict(_object(data["H"], "H"))
    else:
        headers = {
            "lang": "py",
            "task": name,
            "id": job_id,
            "shadow": None,
            "eta": None,
            "expires": None if expires_ms is None else ms_to_datetime(expires_ms).isoformat(),
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": job_id,
            "parent_id": None,
            "argsrepr": data.get("a", "()"),
            "kwargsrepr": data.get("k", "{}"),
            "origin": data.get("o"),
            "ignore_result": False,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        }
        other = data.get("h")
        if other is not None:
            headers.update(_object(other, "h"))
    if "P" in data:
        props = dict(_object(data["P"], "P"))
    else:
        props = {"correlation_id": job_id, "reply_to": data.get("r", "")}
        other = data.get("p")
        if other is not None:
            props.update(_object(other, "p"))
    content_encoding = data.get("ce", _UTF8)
    if "j" in data:
        body = (data["j"] + _PLAIN_TAIL).encode(content_encoding)
    elif "b" in data:
        body = data["b"].encode(content_encoding)
    else:
        body = base64.b64decode(data["z"], validate=True)
    queue = data.get("q")
    route = {} if queue is None else {"queue": queue} if isinstance(queue, str) else dict(_object(queue, "q"))
    sched = data.get("s")
    return Envelope(
        task=name,
        headers=headers,
        props=props,
        body=body,
        content_type=str(data.get("ct", _JSON_CT)),
        content_encoding=str(content_encoding),
        route=route,
        expires_ms=data.get("x"),
        created_ms=int(data.get("c", 0)),
        schedule=(str(sched[0]), int(sched[1])) if sched else None,
    )


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object")
    return value


def _decode_v1(data: dict[str, Any]) -> Envelope:
    body_text = data["body"]
    body = base64.b64decode(body_text) if data["b64"] else body_text.encode(data["ce"])
    return Envelope(
        task=str(data["task"]),
        headers=dict(data["headers"]),
        props=dict(data["props"]),
        body=body,
        content_type=str(data["ct"]),
        content_encoding=str(data["ce"]),
        route=dict(data["route"]),
        expires_ms=data.get("expires"),
        created_ms=int(data.get("created", 0)),
        schedule=(str(data["sched"][0]), int(data["sched"][1])) if data.get("sched") else None,
    )

