"""The stored envelope: its format (version 3; version 2 is still read), read
(:mod:`.envelope_writing` writes it); and the one view of a stored job (task, args, kwargs,
queue, priority: :class:`Envelope`) that every reader (``DelayQ.pending``, the CLI's job
lists, Spark's reader) shares.

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

* the ``jobs`` hash keeps an envelope stored under its own id without its ``"i"``, and its
  shape once per shard (:mod:`.stored_forms`; :class:`~.facade.Store` calls it);
* ``lua/requeue.lua`` stores a requeued envelope the same way: it cuts the opening
  ``{"v":3,"i":<id>,`` (:func:`.stored_forms.id_opening`, passed in ARGV[3]) down to ``{"v":3,``;
* ``lua/push.lua`` cuts ``a``, ``k``, ``j``/``b`` out (above), the shape (the
  text from ``t`` to ``c``) as the key of its message template, and ``c`` as the last field;
  every other script stores, returns or moves envelopes as opaque strings;
* :mod:`..beat.wire` makes the message templates from :func:`template_fields`: the id, the
  argument reprs and the body of an envelope whose other fields (its *shape*) are shared.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from ..due import ms_to_datetime
from ..exceptions import CorruptData
from .bounded import load_json

__all__ = [
    "CLAIM_HEADER",
    "DUE_HEADER",
    "ENVELOPE_VERSION",
    "JSON_CT",
    "KEYED_HEADER",
    "PLAIN_TAIL",
    "UTF8",
    "Envelope",
    "decode_envelope",
    "shape_envelope",
    "template_fields",
]

ENVELOPE_VERSION = 3

#: Header added at publish: the job's due time, ms since the epoch (a whole number).
DUE_HEADER = "delayq_due"

#: Header added when a beat publishes a job through kombu: its claim (see :mod:`..worker.starts`).
CLAIM_HEADER = "delayq_claim"

#: Header of a job stored debounced or throttled by a key: ``"debounce"`` or ``"throttle"`` (the
#: key is the job id's hash tag; :attr:`Envelope.keyed` joins them for ``show``, the dashboard and
#: the Spark reader).
KEYED_HEADER = "delayq_keyed"


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
    def keyed(self) -> str | None:
        """``"debounce:<key>"`` or ``"throttle:<key>"`` for a job stored debounced or throttled
        (its :data:`KEYED_HEADER` holds the mode, among the headers given to ``apply_async``;
        the key is its id's hash tag, ``{<key>}``), else None."""
        extra = self.route.get("headers")
        mode = extra.get(KEYED_HEADER) if isinstance(extra, dict) else None
        mode = self.headers.get(KEYED_HEADER, mode)
        if not isinstance(mode, str):
            return None
        job_id = self.headers.get("id")
        if not isinstance(job_id, str) or not job_id.startswith("{") or job_id.find("}") < 1:
            return mode
        return f"{mode}:{job_id[1 : job_id.find('}')]}"

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


# -- the format's constants, shared with the writer (.envelope_writing) ----------------

#: Celery's body ``embed`` with no callbacks, errbacks, chain or chord, as kombu's JSON writes
#: it at the end of a body: a JSON body ending so is stored without this tail (field ``j``).
PLAIN_TAIL = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
JSON_CT = "application/json"
UTF8 = "utf-8"


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
