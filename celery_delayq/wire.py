"""Broker messages for kombu's Redis transport, built in the beat.

When the Celery broker is the store's own Redis server and database, the claim loop
does not hand due jobs to kombu one by one: it builds the JSON that kombu's Redis
transport would ``LPUSH`` for each of them, and ``lua/deliver.lua`` pushes it into the
queue's list and removes the job in one atomic step (see :mod:`.dispatch`).

:func:`wire_message` is the reference: it follows ``Producer.publish``,
``Channel.prepare_message``, ``Channel.basic_publish`` and the Redis transport's
``_put`` step by step, with kombu's own helpers for the delivery mode, body encoding,
delivery tag, priority list and JSON. A test compares its output with what kombu
pushes for the same job, and runs a real worker on it.

:class:`WireTemplates` makes that fast. Jobs of one task scheduled by one producer
with the same options differ only in a few fields (id, argument reprs, body, due
time, the due time as ``eta`` when ``delayq_publish_eta`` is on, delivery tag), so
the message of the first such job is built by :func:`wire_message` with placeholder
values and cut into a template at the placeholders; every later job of that *shape*
fills the template in with ``json``'s own string encoder. Anything unusual (an expiry,
a schedule point, a compressed body, an exchange to route through) goes the reference way.
:func:`~.envelope.template_fields` cuts an envelope into a job's values and its shape: this
module does not read the envelope format itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _jstr
from typing import Any

from kombu.entity import maybe_delivery_mode
from kombu.utils.json import dumps as kombu_dumps

from .due import due_iso
from .envelope import Envelope, shape_envelope, template_fields

__all__ = ["TEMPLATE_FORMAT", "WireTemplates", "template_space", "wire_message"]

# Placeholders: values no real job has, found again in the reference message's JSON.
_ID, _ARGS, _KWARGS, _TAG = "\u2603id\u2603", "\u2603args\u2603", "\u2603kwargs\u2603", "\u2603tag\u2603"
_BODY = b"\xe2\x98\x83body\xe2\x98\x83"
_DUE_MS = 9_876_543_210_123
#: Most templates kept (one per task, producer and set of options seen recently).
MAX_TEMPLATES = 1024
#: The version of the templates ``lua/push.lua`` reads (part of every template space).
TEMPLATE_FORMAT = 1
#: Settings a message depends on beyond its job's shape (part of the template space).
_SPACE_SETTINGS = (
    "task_default_queue", "task_default_exchange", "task_default_exchange_type", "task_default_routing_key",
    "task_default_delivery_mode", "task_default_priority", "task_queue_max_priority", "task_routes",
    "task_queues", "task_create_missing_queues", "task_serializer", "task_compression", "delayq_publish_eta",
)  # fmt: skip


def wire_message(
    channel: Any, producer: Any, kwargs: dict[str, Any], tag: str | None = None
) -> tuple[str, str] | None:
    """The list key and the JSON that kombu's Redis transport would ``LPUSH`` for
    ``producer.publish(**kwargs)`` on ``channel``.

    None when that publish would do more than one ``LPUSH`` into a queue's list (an
    exchange to route through, compression, entities to declare, a queue with
    ``x-expires``): such a message goes through kombu itself. ``tag`` replaces kombu's
    random delivery tag (the templates use it for a placeholder).
    """
    return _wire(channel, producer, tag, **kwargs)


def _wire(
    channel: Any,
    producer: Any,
    tag: str | None,
    body: Any,
    routing_key: Any = None,
    delivery_mode: Any = None,
    mandatory: bool = False,
    immediate: bool = False,
    priority: Any = 0,
    content_type: Any = None,
    content_encoding: Any = None,
    serializer: Any = None,
    headers: Any = None,
    compression: Any = None,
    exchange: Any = None,
    retry: bool = False,
    retry_policy: Any = None,
    declare: Any = None,
    expiration: Any = None,
    timeout: Any = None,
    confirm_timeout: Any = None,
    **properties: Any,
) -> tuple[str, str] | None:
    if exchange or compression or declare or not content_type or not isinstance(routing_key, str):
        return None
    expires = getattr(channel, "_expires", None)
    if expires and routing_key in expires:
        return None
    reply_to = properties.get("reply_to")
    if reply_to is not None and not isinstance(reply_to, str):
        return None
    headers = {} if headers is None else headers
    # Producer.publish: an exchange given as a str (here the anonymous one) takes the
    # delivery mode of the producer's own exchange.
    properties["delivery_mode"] = maybe_delivery_mode(  # type: ignore[no-untyped-call]
        delivery_mode or producer.exchange.delivery_mode
    )
    if expiration is not None:
        properties["expiration"] = str(int(expiration * 1000))
    # Producer._prepare with a content type: the body is sent as it is.
    if isinstance(body, str):
        content_encoding = content_encoding or "utf-8"
        body = body.encode(content_encoding)
    elif not content_encoding:
        content_encoding = "binary"
    # Channel.prepare_message
    properties.setdefault("delivery_info", {})
    properties.setdefault("priority", priority or channel.default_priority)
    message = {
        "body": body,
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": headers,
        "properties": properties,
    }
    # Channel.basic_publish with the anonymous exchange (the routing key is the queue), _put
    message["body"], body_encoding = channel.encode_body(body, channel.body_encoding)
    properties.update(
        body_encoding=body_encoding,
        delivery_tag=channel._next_delivery_tag() if tag is None else tag,
    )
    properties["delivery_info"].update(exchange="", routing_key=routing_key)
    key = channel._q_for_pri(routing_key, channel._get_message_priority(message, reverse=False))
    text = kombu_dumps(message)  # type: ignore[no-untyped-call]
    return getattr(channel, "global_keyprefix", "") + key, text


def template_space(channel: Any, producer: Any, conf: Any) -> str:
    """The namespace of the message templates a beat stores for ``lua/push.lua``: a digest of
    what a message depends on besides its job's shape (the channel's key prefix, priority steps
    and body encoding, the producer's exchange, the app's routing and publishing settings, the
    library versions). Beats with the same settings share templates; others never do.

    >>> len(template_space(None, None, {}))
    16
    """
    import celery
    import kombu

    exchange = getattr(producer, "exchange", None)
    parts = [
        TEMPLATE_FORMAT, celery.__version__, kombu.__version__,
        getattr(channel, "global_keyprefix", ""), getattr(channel, "priority_steps", None),
        getattr(channel, "sep", None), getattr(channel, "body_encoding", None),
        getattr(channel, "default_priority", None), getattr(exchange, "name", None),
        getattr(exchange, "delivery_mode", None),
        *(repr(conf.get(name)) for name in _SPACE_SETTINGS),
    ]  # fmt: skip
    return hashlib.sha1(repr(parts).encode("utf-8", "backslashreplace")).hexdigest()[:16]


def _whole_numbers_only(value: Any) -> bool:
    """True when every number in ``value`` is an int (a float would share ``lua/push.lua``'s shape
    key with the int of the same value) and no object or array is empty (cjson reads both the same)."""
    if isinstance(value, float):
        return False
    if isinstance(value, dict):
        return bool(value) and all(_whole_numbers_only(v) for v in value.values())
    if isinstance(value, list):
        return bool(value) and all(_whole_numbers_only(v) for v in value)
    return True


@dataclass(frozen=True)
class _Template:
    key: str  # the list to push to
    queue: str  # the queue it belongs to (declared once per pass)
    literals: tuple[str, ...]  # len(holes) + 1 pieces of JSON around the holes
    holes: tuple[int, ...]  # which value goes in each hole (index into the per-job values)
    body_encoding: str | None  # "base64" (kombu's default for Redis) or None: the body as text
    content_encoding: str
    eta: bool  # whether the message has an eta header (the due time, delayq_publish_eta)
    task: str  # the task name


_NOT_WIRE = object()


class WireTemplates:
    """Message templates per job shape, for one kombu Redis channel.

    ``args_for(producer, envelope, due_ms)`` gives the ``Producer.publish`` keyword arguments
    Celery would use (the dispatcher's routing); it is called once per shape.
    """

    def __init__(
        self, channel: Any, producer: Any, args_for: Callable[[Any, Envelope, int], dict[str, Any]]
    ) -> None:
        self.channel = channel
        self.producer = producer
        self.args_for = args_for
        self._templates: dict[tuple[Any, ...], Any] = {}
        #: the template space of lua/push.lua (set by the owner: publish.Publishing)
        self.space = ""

    def build(self, raw: str, due_ms: int) -> tuple[str, str, str, str] | None:
        """``(list key, message JSON, queue, task name)`` for the envelope ``raw`` due at ``due_ms``, or
        None when it must go the reference way (decode_envelope, then kombu or
        :func:`wire_message`)."""
        cut = template_fields(raw)
        if cut is None:  # (a corrupt envelope goes the reference way, which buries it)
            return None
        shape, data, job_id, args, kwargs, text = cut
        template = self._template(shape, data)
        if template is _NOT_WIRE:
            return None
        assert isinstance(template, _Template)
        try:
            body = text.encode(template.content_encoding)
        except (LookupError, UnicodeError):
            return None
        if template.body_encoding is None:
            body_json = _jstr(body.decode(template.content_encoding))
        else:
            body_json = '"' + base64.b64encode(body).decode("ascii") + '"'
        values = (
            _jstr(job_id),
            _jstr(args),
            _jstr(kwargs),
            body_json,
            repr(due_ms / 1000.0),
            '"' + str(uuid.uuid4()) + '"',
            '"' + due_iso(due_ms) + '"' if template.eta else "",
        )
        literals, holes = template.literals, template.holes
        parts = [literals[0]]
        for n, hole in enumerate(holes, 1):
            parts.append(values[hole])
            parts.append(literals[n])
        return template.key, "".join(parts), template.queue, template.task

    def lua_template(self, raw: str, registered: Callable[[str], bool]) -> str:
        """The template ``lua/push.lua`` fills in for jobs of the shape of the envelope ``raw``,
        as JSON: literals ``l`` around holes ``h`` (0 id, 1 argsrepr, 2 kwargsrepr, 3 body,
        4 due seconds, 5 delivery tag, 6 eta), the list key ``k``, ``b`` 1 for a base64 body, and
        the queue ``q`` and task ``t``. ``"-"`` when that shape must go the beat's way: no
        template (see :meth:`build`), a task ``registered`` refuses, a body not UTF-8 (the
        script encodes UTF-8 only), or a number that is not whole in the shape."""
        cut = template_fields(raw)
        if cut is None:
            return "-"
        shape_key, data = cut[0], cut[1]
        template = self._template(shape_key, data)
        if (
            not isinstance(template, _Template)
            or template.content_encoding != "utf-8"
            or not registered(template.task)
            or not _whole_numbers_only(data)
        ):
            return "-"
        spec = {
            "l": list(template.literals),
            "h": list(template.holes),
            "k": template.key,
            "b": 1 if template.body_encoding == "base64" else 0,
            "q": template.queue,
            "t": template.task,
        }
        return json.dumps(spec, separators=(",", ":"))

    def _template(self, key: tuple[Any, ...], shape: dict[str, Any]) -> Any:
        """The kept template of the shape ``key`` (made from ``shape`` the first time; the kept
        ones are dropped when :data:`MAX_TEMPLATES` are kept)."""
        template = self._templates.get(key)
        if template is None:
            template = self._make(shape)
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            self._templates[key] = template
        return template

    def _make(self, shape: dict[str, Any]) -> Any:
        """The template of one shape: the reference message of a job of that shape with
        placeholder values, cut at the placeholders; ``_NOT_WIRE`` when it has none."""
        try:
            envelope = shape_envelope(shape, _ID, (_ARGS, _KWARGS), _BODY)
            content_encoding = envelope.content_encoding
            body_text = _BODY.decode(content_encoding)
            kwargs = self.args_for(self.producer, envelope, _DUE_MS)
            built = wire_message(self.channel, self.producer, kwargs, tag=_TAG)
        except Exception:  # the reference way reports it, job by job
            return _NOT_WIRE
        if built is None:
            return _NOT_WIRE
        key, text = built
        reference = json.loads(text)
        encoded_body = reference["body"]
        body_encoding = reference["properties"].get("body_encoding")
        if body_encoding == "base64":
            body_hole = '"' + base64.b64encode(_BODY).decode("ascii") + '"'
        elif body_encoding in (None, "utf-8") and encoded_body == body_text:
            body_encoding, body_hole = None, _jstr(body_text)
        else:
            return _NOT_WIRE
        holes_by_text = {
            _jstr(_ID): 0,
            _jstr(_ARGS): 1,
            _jstr(_KWARGS): 2,
            body_hole: 3,
            repr(_DUE_MS / 1000.0): 4,
            _jstr(_TAG): 5,
            _jstr(due_iso(_DUE_MS)): 6,
        }
        pieces = re.split("(" + "|".join(re.escape(h) for h in holes_by_text) + ")", text)
        literals = tuple(pieces[0::2])
        holes = tuple(holes_by_text[h] for h in pieces[1::2])
        if any(holes.count(hole) != 1 for hole in (3, 4, 5)) or holes.count(6) > 1:
            return _NOT_WIRE
        return _Template(
            key=key,
            queue=str(kwargs["routing_key"]),
            literals=literals,
            holes=holes,
            body_encoding=body_encoding,
            content_encoding=content_encoding,
            eta=6 in holes,
            task=envelope.task,
        )
