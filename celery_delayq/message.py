"""The stored envelope: a Celery message built at schedule time, published later.

At schedule time :func:`build_envelope` does what ``Task.apply_async`` and
``Celery.send_task`` do before they publish: argument check against the task's
signature, the task's execution options, the router (queue, exchange, routing
key, priority), the protocol-2 headers and the body, serialized with the task's
serializer. What ``apply_async`` would have published is stored, less the
``eta`` (the worker must run it at once) and with ``expires`` made absolute.

At dispatch :func:`publish` hands that message to Celery's own
``app.amqp.send_task_message`` (so ``before_task_publish``/``after_task_publish``
fire at the moment it really enters the broker) with the body already
serialized: kombu publishes the stored bytes as they are.

The envelope is JSON::

    {"v": 1, "task": name, "headers": {...}, "props": {...},
     "body": text, "b64": false, "ct": content type, "ce": content encoding,
     "route": {"queue": name, "exchange": ..., "routing_key": ..., ...},
     "expires": absolute ms or null, "created": ms}
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.app.amqp import task_message
from celery.utils.functional import maybe_list
from kombu.entity import Exchange, Queue
from kombu.serialization import dumps

from .exceptions import InvalidDueTime, InvalidOptions, PayloadTooLarge, SerializationError

__all__ = [
    "DUE_HEADER",
    "Envelope",
    "build_envelope",
    "decode_envelope",
    "due_ms_from_delay",
    "due_ms_from_eta",
    "ms_to_datetime",
    "publish",
]

ENVELOPE_VERSION = 1

#: Header added at publish: the job's due time, seconds since the epoch (float).
DUE_HEADER = "delayq_due"

# The latest due time accepted: the last millisecond of year 9999 (datetime's limit).
MAX_DUE_MS = 253_402_300_799_999

# Options apply_async takes that make no sense for a stored job.
_REFUSED = {
    "producer": "a producer cannot be stored; the beat publishes with its own",
    "connection": "a connection cannot be stored; the beat publishes with its own",
    "publisher": "a producer cannot be stored; the beat publishes with its own",
    "router": "a router object cannot be stored; use task_routes or queue=",
}
# Options that only steer this call and are never part of the message.
_CALL_ONLY = ("add_to_parent", "result_cls")


def _now_ms() -> int:
    return int(time.time() * 1000)


def ms_to_datetime(ms: float) -> datetime:
    """UTC-aware datetime of ``ms`` milliseconds since the epoch.

    >>> ms_to_datetime(1_700_000_000_000).isoformat()
    '2023-11-14T22:13:20+00:00'
    """
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


def _check_ms(ms: float, what: str) -> int:
    if not math.isfinite(ms):
        raise InvalidDueTime(f"{what} must be finite, got {ms / 1000.0!r}")
    if ms < 0:
        raise InvalidDueTime(f"{what} must not be before 1970-01-01T00:00:00Z, got {ms / 1000.0!r} s")
    if ms > MAX_DUE_MS:
        raise InvalidDueTime(f"{what} is past year 9999: {ms / 1000.0!r} s since the epoch")
    return round(ms)


def due_ms_from_eta(eta: Any, app: Any) -> int:
    """Milliseconds since the epoch for an ``apply_at`` due time.

    ``eta`` is an aware ``datetime``, a UNIX timestamp in seconds (int or
    float), or an ISO-8601 string. A naive datetime (or string) follows
    Celery's rule for ``eta``: it is read in the app's timezone
    (``app.conf.timezone``; UTC when unset and ``enable_utc`` is on, the
    default). When ``enable_utc`` is off and no ``timezone`` is set, Celery
    would read it as the machine's local time; delayq refuses it instead.

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
        conf = app.conf
        if not conf.timezone and not conf.enable_utc:
            raise InvalidDueTime(
                f"naive datetime {eta.isoformat()} refused: enable_utc is off and no timezone is "
                "set, so it could only mean this machine's local time; pass an aware datetime "
                "or set app.conf.timezone"
            )
        eta = eta.replace(tzinfo=app.timezone)
    try:
        seconds = eta.timestamp()
    except (OverflowError, ValueError, OSError) as exc:
        raise InvalidDueTime(f"eta {eta!r} is out of range") from exc
    return _check_ms(seconds * 1000.0, "eta")


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
    args = tuple(args) if args is not None else ()
    kwargs = dict(kwargs) if kwargs is not None else {}
    options = dict(options or {})
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

    if isinstance(task, str):
        task = _UnregisteredTask(app, task)
    if task.typing:
        header = getattr(task, "__header__", None)
        if header is not None:
            header(*args, **kwargs)
    shadow = options.pop("shadow", None) or task.shadow_name(args, kwargs, options)
    options = dict(task._get_exec_options(), **options)
    options.setdefault("ignore_result", task.ignore_result)
    name = task.name

    expires = _expires_ms(options.pop("expires", None), due_ms, app)
    time_limit = options.pop("time_limit", None)
    soft_time_limit = options.pop("soft_time_limit", None)
    ignore_result = options.pop("ignore_result", None)
    link = options.pop("link", None)
    link_error = options.pop("link_error", None)
    route_name = options.pop("route_name", None)
    try:
        options = dict(app.amqp.router.route(options, route_name or name, args, kwargs, task))
    except Exception as exc:  # QueueNotFound, a router raising: refuse now, not in beat
        raise InvalidOptions(f"cannot route task {name!r}: {exc}") from exc

    root_id = options.pop("root_id", None)
    parent_id = options.pop("parent_id", None)
    if not root_id or not parent_id:
        parent = app.current_worker_task
        if parent:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
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
        raise SerializationError(
            f"cannot serialize the arguments of {name!r} with {serializer!r}: {exc}"
        ) from exc
    if isinstance(payload, bytes):
        text, b64 = base64.b64encode(payload).decode("ascii"), True
    else:
        text, b64 = payload, False

    route = {key: _name(value) for key, value in options.items() if value is not None}
    envelope = {
        "v": ENVELOPE_VERSION,
        "task": name,
        "headers": headers,
        "props": props,
        "body": text,
        "b64": b64,
        "ct": content_type,
        "ce": content_encoding,
        "route": route,
        "expires": expires,
        "created": _now_ms(),
    }
    if schedule is not None:
        envelope["sched"] = [schedule[0], schedule[1]]
    try:
        encoded = json.dumps(envelope, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in route.items() if not _json_ok(v)]
        raise InvalidOptions(
            f"options {bad or list(route)} of {name!r} cannot be stored "
            f"(they must be JSON-serializable): {exc}"
        ) from exc
    if max_payload is not None and len(encoded) > max_payload:
        raise PayloadTooLarge(
            f"job {task_id!r} of {name!r} is {len(encoded)} bytes, over delayq_max_payload "
            f"({max_payload}); store large data elsewhere and pass a reference"
        )
    return encoded


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


def decode_envelope(raw: str) -> Envelope:
    """Parse a stored envelope; ``ValueError`` says what is wrong with a corrupt one."""
    try:
        data = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"envelope is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("envelope is not a JSON object")
    if data.get("v") != ENVELOPE_VERSION:
        raise ValueError(f"unknown envelope version {data.get('v')!r}")
    try:
        body_text = data["body"]
        body = base64.b64decode(body_text) if data["b64"] else body_text.encode(data["ce"])
        envelope = Envelope(
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
    except (KeyError, TypeError, ValueError, LookupError) as exc:
        raise ValueError(f"envelope field missing or malformed: {exc!r}") from exc
    return envelope


def publish(app: Any, producer: Any, envelope: Envelope, due_ms: int, now_ms: int | None = None) -> None:
    """Publish one job through Celery's ``send_task_message``, as ``apply_async`` would."""
    headers = dict(envelope.headers)
    headers[DUE_HEADER] = due_ms / 1000.0
    props = dict(envelope.props)
    route = dict(envelope.route)
    if envelope.expires_ms is not None:
        now = _now_ms() if now_ms is None else now_ms
        route["expiration"] = max(0.0, (envelope.expires_ms - now) / 1000.0)
    sent_event = None
    if app.conf.task_send_sent_event:
        sent_event = {
            "uuid": headers["id"],
            "root_id": headers.get("root_id"),
            "parent_id": headers.get("parent_id"),
            "name": envelope.task,
            "args": headers.get("argsrepr"),
            "kwargs": headers.get("kwargsrepr"),
            "retries": headers.get("retries"),
            "eta": None,
            "expires": headers.get("expires"),
        }
    message = task_message(headers=headers, properties=props, body=envelope.body, sent_event=sent_event)
    app.amqp.send_task_message(
        producer,
        envelope.task,
        message,
        content_type=envelope.content_type,
        content_encoding=envelope.content_encoding,
        **route,
    )
