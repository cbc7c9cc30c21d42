"""The stored envelope: its format (version 3; version 2 is still read), written and read; and the one view of
a stored job (task, args, kwargs, queue, priority: :class:`Envelope`) that every reader
(``DelayQ.pending``, the CLI's job lists, Spark's reader) shares.

An envelope is the Celery message ``apply_async`` would have published, built at schedule
time (:mod:`..producer.build` makes it, :mod:`..beat.publish` sends it), stored as compact JSON
(version 3). It stores only what cannot be rebuilt: a header or property equal to its
default, or to a value that is stored anyway (the id, the task name, the absolute expiry),
is left out, and :func:`decode_envelope` puts it back, in Celery's order::

    {"v": 3, "i": task id, "a": argsrepr, "k": kwargsrepr,
     "j": JSON body less its plain tail | "b": body text,
     "t": task name, "o": origin, "h": {other headers},
     "r": reply_to, "p": {other properties},
     "z": base64 body, "ct": content type, "ce": content encoding,
     "q": queue name | {routed options},
     "x": absolute expiry ms, "c": created ms, "s": [schedule name, point ms]}

*Encoded once, at enqueue.* The job's own parts of its broker message (the argument reprs and
the body) come first, in this order, as JSON strings: their text between the quotes is already
what kombu's Redis transport writes for them in a message (``json`` with ``ensure_ascii``, the
body unencoded: :mod:`..beat.wire`). ``lua/push.lua`` cuts them out of the stored envelope and joins
them into the message with no decoding or encoding of its own: each ends at the first ``","``
after it, as JSON-escaped text never holds that (every ``"`` in it follows a backslash). They
come first whenever the headers are in Celery's order and the body is text (``j`` or ``b``);
otherwise (``H``, ``P``, a binary body ``z``) ``a``/``k`` follow ``t``, when not ``()``/``{}``,
and the beat delivers the job. Version 2 (the same fields in the order ``i, t, a, k, o, h, r,
p, j|b|z, ct, ce, q, x, c, s``) is still read; no released version wrote version 1.

Who else reads the format, and what of it (nothing else knows it):

* the ``jobs`` hash keeps an envelope stored under its own id without its ``"i"``
  (:func:`stored_form`, :func:`loaded_form`; :class:`~.facade.Store` calls them);
* ``lua/requeue.lua`` stores a requeued envelope the same way: it cuts the opening
  ``{"v":3,"i":<id>,`` (:func:`id_opening`, passed in ARGV[3]) down to ``{"v":3,``;
* ``lua/push.lua`` cuts ``a``, ``k``, ``j``/``b`` out (above), the shape (the
  text from ``t`` to ``c``) as the key of its message template, and ``c`` as the last field;
  every other script stores, returns or moves envelopes as opaque strings;
* :mod:`..beat.wire` makes the message templates from :func:`template_fields`: the id, the
  argument reprs and the body of an envelope whose other fields (its *shape*) are shared.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _jstr
from typing import Any

from ..due import local_now_ms, ms_to_datetime
from ..exceptions import CorruptData, InvalidOptions, PayloadTooLarge
from .bounded import MAX_DEPTH, check_depth, load_json

__all__ = [
    "CLAIM_HEADER",
    "DUE_HEADER",
    "ENVELOPE_VERSION",
    "JSON_CT",
    "PLAIN_TAIL",
    "SHAPE_ID_LENGTH",
    "UTF8",
    "Envelope",
    "JobBody",
    "Pieces",
    "body_members",
    "decode_envelope",
    "encode_envelope",
    "envelope_from_pieces",
    "id_opening",
    "is_plain_embed",
    "joined_form",
    "loaded_form",
    "plain_body",
    "schedule_member",
    "shape_envelope",
    "shape_id_of",
    "shared_form",
    "shared_pieces",
    "stored_form",
    "template_fields",
]

ENVELOPE_VERSION = 3

#: Header added at publish: the job's due time, ms since the epoch (a whole number).
DUE_HEADER = "delayq_due"

#: Header added when a beat publishes a job through kombu: its claim (see :mod:`..worker.starts`).
CLAIM_HEADER = "delayq_claim"


@dataclass(frozen=True)
class Envelope:
    """A decoded envelope, ready to publish; and the one view of the job it holds."""

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

    @property
    def queue(self) -> str | None:
        """The queue the job is routed to; None: the app's default queue."""
        queue = self.route.get("queue")
        return queue if isinstance(queue, str) else None

    @property
    def priority(self) -> Any:
        """The message priority the job is routed with, or None."""
        return self.route.get("priority")

    @property
    def json_body(self) -> bool:
        """True when the body is JSON: :meth:`arguments` decodes it."""
        return self.content_type == JSON_CT

    def arguments(self, *, reprs_if_unreadable: bool = False) -> tuple[Any, Any]:
        """The job's ``(args, kwargs)``: decoded from a JSON body; for a body a reader must
        not decode (pickle...), Celery's ``argsrepr``/``kwargsrepr`` strings.

        A JSON body that does not read raises :class:`~..exceptions.CorruptData`, or with
        ``reprs_if_unreadable`` gives the reprs too.

        >>> Envelope("t", {"argsrepr": "(1,)"}, {}, b'[[1], {}, {}]', JSON_CT, UTF8, {}, None, 0).arguments()
        ([1], {})
        >>> Envelope("t", {"argsrepr": "(1,)"}, {}, b"\\x80", "application/x-python-serialize",
        ...          "binary", {}, None, 0).arguments()
        ('(1,)', None)
        """
        if self.json_body:
            try:
                args, kwargs, _ = json.loads(self.body.decode(self.content_encoding or UTF8))
                return args, kwargs
            except (ValueError, TypeError, LookupError, RecursionError) as exc:
                if not reprs_if_unreadable:
                    raise CorruptData(f"the JSON body of the envelope does not read: {exc!r}") from exc
        return self.headers.get("argsrepr"), self.headers.get("kwargsrepr")


# -- the compact (version 2) fields, written ---------------------------------------------

#: Celery's body ``embed`` with no callbacks, errbacks, chain or chord, as kombu's JSON writes
#: it at the end of a body: a JSON body ending so is stored without this tail (field ``j``).
PLAIN_TAIL = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
JSON_CT = "application/json"
UTF8 = "utf-8"

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


# -- reading ------------------------------------------------------------------------------------


def decode_envelope(raw: str, max_bytes: int | None = None) -> Envelope:
    """Parse a stored envelope; ``ValueError`` (:class:`~..exceptions.CorruptData`) says what
    is wrong with a corrupt one: not JSON, not an object, nested deeper than
    :data:`~.bounded.MAX_DEPTH`, longer than ``max_bytes``, a field missing or malformed, or
    an empty queue name (``"q": ""``: no worker reads it)."""
    data = load_json(raw, "envelope", dict, max_bytes)
    version = data.get("v")
    if "S" in data and "t" not in data:
        raise CorruptData(f"the shape {data['S']!r} of this job is missing from the store (its shapes hash)")
    if version != 3 and version != 2:
        raise CorruptData(f"unknown envelope version {version!r}")
    try:
        envelope = _decode(data)
    except (KeyError, TypeError, ValueError, LookupError, OverflowError, OSError) as exc:
        raise CorruptData(f"envelope field missing or malformed: {exc!r}") from exc
    if envelope.route.get("queue") == "":
        raise CorruptData("the envelope's queue name is empty: no worker reads a queue named ''")
    return envelope


def _decode(data: dict[str, Any]) -> Envelope:
    """Versions 3 and 2 (the same fields)."""
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
    content_encoding = data.get("ce", UTF8)
    if "j" in data:
        body = (data["j"] + PLAIN_TAIL).encode(content_encoding)
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
        content_type=str(data.get("ct", JSON_CT)),
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


# -- cut for wire.py's message templates -------------------------------------------------------

#: Fields of a version-2 envelope a template can take (others go the reference way).
_TEMPLATE_FIELDS = frozenset({"v", "i", "t", "a", "k", "o", "h", "r", "p", "j", "b", "ct", "ce", "q", "c"})


def template_fields(raw: str) -> tuple[tuple[bool, str], dict[str, Any], str, str, str, str] | None:
    """The envelope ``raw`` cut for :mod:`..beat.wire`: ``(shape key, shape, job id, argsrepr,
    kwargsrepr, body text)``. The *shape* is every field but those and the creation time:
    what jobs of one task scheduled with the same options share. None for an envelope with a
    field a template cannot take, or one that does not read (decode_envelope says why).

    >>> _, shape, job_id, args, kwargs, body = template_fields(
    ...     '{"v":3,"i":"a","a":"(1,)","k":"{}","j":"[[1], {}","t":"t.add","c":1}')
    >>> shape, job_id, args, kwargs, body.startswith('[[1], {}, {"callbacks": null')
    ({'v': 3, 't': 't.add'}, 'a', '(1,)', '{}', True)
    """
    try:
        data = load_json(raw, "envelope")
    except ValueError:  # not JSON, nested too deeply: decode_envelope says why
        return None
    if type(data) is not dict or data.get("v") not in (2, 3) or not _TEMPLATE_FIELDS.issuperset(data):
        return None
    data["v"] = 3  # (a version-2 envelope has the same shape)
    job_id = data.pop("i", None)
    args = data.pop("a", "()")
    kwargs = data.pop("k", "{}")
    data.pop("c", None)
    if "j" in data:
        text = data.pop("j")
        plain = True
    else:
        text = data.pop("b", None)
        plain = False
    if not (type(job_id) is str and type(args) is str and type(kwargs) is str and type(text) is str):
        return None
    return (plain, repr(data)), data, job_id, args, kwargs, text + PLAIN_TAIL if plain else text


def shape_envelope(shape: dict[str, Any], job_id: str, reprs: tuple[str, str], body: bytes) -> Envelope:
    """The decoded envelope of a job of ``shape`` (see :func:`template_fields`) with this id,
    these argument reprs and this body; ``LookupError``/``UnicodeError`` when the shape's
    content encoding cannot hold the body, else what :func:`decode_envelope` raises."""
    text = body.decode(shape.get("ce", UTF8))
    fields = {"v": 2, "i": job_id, **shape, "a": reprs[0], "k": reprs[1], "b": text}
    return decode_envelope(json.dumps(fields))


# -- as the jobs hash keeps it -----------------------------------------------------------------

# An envelope opens with its task id. Stored under that same id it is kept without it (the
# hash field holds it: about 45 bytes less a job) and given it back whenever it is read: claim,
# get, scan. decode_envelope always sees whole envelopes. (Version 2 was kept the same way.)
_OPENINGS = ('{"v":3,', '{"v":2,')


def id_opening(job_id: str) -> str:
    """How an envelope of ``job_id`` opens (``lua/requeue.lua`` gets it as ARGV[3]).

    >>> id_opening("a")
    '{"v":3,"i":"a",'
    """
    return '{"v":3,"i":' + _jstr(job_id) + ","


def stored_form(job_id: str, envelope: str) -> str:
    """``envelope`` as the ``jobs`` hash keeps it under ``job_id``: without its id when it is
    an envelope of that very id, else unchanged.

    >>> stored_form("a", '{"v":3,"i":"a","t":"t.add","c":1}')
    '{"v":3,"t":"t.add","c":1}'
    >>> stored_form("b", '{"v":3,"i":"a","t":"t.add","c":1}')
    '{"v":3,"i":"a","t":"t.add","c":1}'
    """
    for opening in _OPENINGS:
        prefix = opening + '"i":' + _jstr(job_id) + ","
        if envelope.startswith(prefix):
            return opening + envelope[len(prefix) :]
    return envelope


def loaded_form(job_id: str, stored: str) -> str:
    """The envelope of ``job_id`` from what the ``jobs`` hash keeps (see :func:`stored_form`).

    >>> loaded_form("a", '{"v":3,"t":"t.add","c":1}')
    '{"v":3,"i":"a","t":"t.add","c":1}'
    >>> loaded_form("a", "anything else")
    'anything else'
    """
    for opening in _OPENINGS:
        if stored.startswith(opening) and not stored.startswith('"i":', len(opening)):
            return opening + '"i":' + _jstr(job_id) + "," + stored[len(opening) :]
    return stored


# -- a shape many stored jobs share ---------------------------------------------------------------
#
# Jobs of one task scheduled by one producer with the same options have the same text from "t" to
# "c" in their envelopes: their *shape* (task name, origin, reply_to, other headers and properties,
# queue). The jobs hash keeps such a job with the id of its shape in place of it, and the shard's
# shapes hash keeps the shape once (about 90 bytes less a job):
#
#     {"v":3,"a":"...","k":"...","j":"...","S":"<shape id: 16 hex digits>","c":...}
#
# lua/enqueue.lua writes both (it stores the job whole when the shard's shapes hash is full);
# lua/push.lua keys its message templates by the shape id; every other reader gets the envelope
# whole (:meth:`.Store` joins the shape back before loaded_form).

#: The length of a shape id (hex digits).
SHAPE_ID_LENGTH = 16
_PARTS_FIRST = '{"v":3,"a":"'
_SHAPE_AT = '","S":"'


def shared_form(stored: str, keep_whole: tuple[str, ...] = ()) -> tuple[str, str, str] | None:
    """``(shape id, shape, stored form with the shape's id)`` of an envelope as the jobs hash
    keeps it (:func:`stored_form`); None for one kept whole: not a version-3 envelope with the
    job's own parts first, an expiry, a schedule point, or a name of ``keep_whole`` in its shape.

    >>> shape_id, shape, shared = shared_form('{"v":3,"a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}')
    >>> shape_id, shape
    ('55795f21a2e23178', '"t":"t.add"')
    >>> shared
    '{"v":3,"a":"()","k":"{}","j":"[[], {}","S":"55795f21a2e23178","c":1}'
    """
    if not stored.startswith(_PARTS_FIRST):
        return None
    start = stored.find('","t":')  # (JSON-escaped texts hold no '","': the first is the shape's)
    end = stored.rfind(',"c":')
    if start < 0 or end < start or not stored.endswith("}") or not stored[end + 5 : -1].isdigit():
        return None
    shape = stored[start + 2 : end]
    if ',"x":' in shape:
        return None
    for name in keep_whole:  # (a loop, not any() over a generator: a µs less a job)
        if name in shape:
            return None
    shape_id = hashlib.blake2b(shape.encode(), digest_size=SHAPE_ID_LENGTH // 2).hexdigest()
    return shape_id, shape, stored[: start + 2] + '"S":"' + shape_id + '"' + stored[end:]


def shape_id_of(stored: str) -> str | None:
    """The id of the shape a stored envelope leaves to the shapes hash, or None."""
    if not stored.startswith(_PARTS_FIRST):
        return None
    at = stored.find(_SHAPE_AT)
    return None if at < 0 else stored[at + 7 : at + 7 + SHAPE_ID_LENGTH]


def joined_form(stored: str, shape: str | None) -> str:
    """A stored envelope with its ``shape`` back in place of the shape's id (unchanged when it
    has none, or ``shape`` is None: :func:`decode_envelope` then says the shape is missing).

    >>> joined_form('{"v":3,"a":"()","k":"{}","j":"[[], {}","S":"55795f21a2e23178","c":1}', '"t":"t.add"')
    '{"v":3,"a":"()","k":"{}","j":"[[], {}","t":"t.add","c":1}'
    """
    if shape is None or not stored.startswith(_PARTS_FIRST):
        return stored
    at = stored.find(_SHAPE_AT)
    if at < 0:
        return stored
    return stored[: at + 2] + shape + stored[at + 7 + SHAPE_ID_LENGTH + 1 :]
