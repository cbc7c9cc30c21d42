"""Broker messages for kombu's Redis transport, built in the beat.

When the Celery broker is the store's own Redis server and database, the claim loop
does not hand due jobs to kombu one by one: it builds the JSON that kombu's Redis
transport would ``LPUSH`` for each of them, and ``lua/push_claimed.lua`` pushes it into the
queue's list and removes the job in one step (the push path: see :mod:`.publish`).

:func:`wire_message` is the reference: it follows ``Producer.publish``,
``Channel.prepare_message``, ``Channel.basic_publish`` and the Redis transport's
``_put`` step by step, with kombu's own helpers for the delivery mode, body encoding,
delivery tag, priority list and JSON. A test compares its output with what kombu
pushes for the same job, and runs a real worker on it.

:class:`WireTemplates` makes that fast. Jobs of one task scheduled by one producer
with the same options differ only in a few fields (id, argument reprs, body, due
time, the due time as ``eta`` when ``delayq_publish_eta`` is on, delivery tag), so
the message of the first such job is built by :func:`wire_message` with placeholder
values, its body as text (no ``body_encoding``: kombu's Redis transport reads such a
body as it is), and cut into a template at the placeholders. The same template serves
both ways of filling it: ``lua/push.lua`` joins it with the JSON-escaped pieces the
envelope already holds (encoded once, at enqueue: :mod:`..store.envelope`), and
:meth:`WireTemplates.build` does the same here for ``lua/push_claimed.lua``. Anything unusual
(an expiry, a schedule point, a binary body, an exchange to route through) goes the
reference way.
:func:`~..store.envelope.template_fields` cuts an envelope into a job's values and its shape: this
module does not read the envelope format itself.
"""

from __future__ import annotations

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

from ..due import due_iso
from ..store.envelope import PLAIN_TAIL, Envelope, shape_envelope, template_fields

__all__ = ["TEMPLATE_FORMAT", "WireTemplates", "template_space", "wire_message"]

# Placeholders: values no real job has, found again in the reference message's JSON.
_ID, _ARGS, _KWARGS, _TAG = "\u2603id\u2603", "\u2603args\u2603", "\u2603kwargs\u2603", "\u2603tag\u2603"
_BODY = b"\xe2\x98\x83body\xe2\x98\x83"
_DUE_MS = 9_876_543_210_123
#: Most templates kept (one per task, producer and set of options seen recently).
MAX_TEMPLATES = 1024
#: The version of the templates ``lua/push.lua`` reads (part of every template space).
TEMPLATE_FORMAT = 2
#: Settings a message depends on beyond its job's shape (part of the template space).
_SPACE_SETTINGS = (
    "task_default_queue", "task_default_exchange", "task_default_exchange_type", "task_default_routing_key",
    "task_default_delivery_mode", "task_default_priority", "task_queue_max_priority", "task_routes",
    "task_queues", "task_create_missing_queues", "task_serializer", "task_compression", "delayq_publish_eta",
)  # fmt: skip


_CHANNELS = object()


def wire_message(
    channel: Any,
    producer: Any,
    kwargs: dict[str, Any],
    tag: str | None = None,
    body_encoding: Any = _CHANNELS,
) -> tuple[str, str] | None:
    """The list key and the JSON that kombu's Redis transport would ``LPUSH`` for
    ``producer.publish(**kwargs)`` on ``channel``.

    None when that publish would do more than one ``LPUSH`` into a queue's list (an
    exchange to route through, compression, entities to declare, a queue with
    ``x-expires``): such a message goes through kombu itself. ``tag`` replaces kombu's
    random delivery tag (the templates use it for a placeholder); ``body_encoding``
    replaces the channel's (``None``: the body as text, as kombu writes it with the
    transport option ``body_encoding`` set to None).
    """
    encoding = channel.body_encoding if body_encoding is _CHANNELS else body_encoding
    return _wire(channel, producer, tag, encoding, **kwargs)


def _wire(
    channel: Any,
    producer: Any,
    tag: str | None,
    body_encoding: Any,
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
    if body_encoding is None:  # kombu's Producer sends the text of a body it serialized itself
        if content_encoding != "utf-8":
            return None
        body = body.decode(content_encoding)
    message["body"], body_encoding = channel.encode_body(body, body_encoding)
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


@dataclass(frozen=True)
class _Template:
    key: str  # the list to push to
    queue: str  # the queue it belongs to (declared once per pass)
    literals: tuple[str, ...]  # len(holes) + 1 pieces of JSON around the holes
    holes: tuple[int, ...]  # which value goes in each hole (index into the per-job values)
    plain: bool  # the body is a plain JSON body stored less its tail (``j``): the tail is a literal
    eta: bool  # whether the message has an eta header (the due time, delayq_publish_eta)
    task: str  # the task name


_NOT_WIRE = object()


class WireTemplates:
    """Message templates per job shape, for one kombu Redis channel.

    A template is the message of its shape cut at the job's own values, each a hole between two
    literals: 0 the id, 1 the argsrepr, 2 the kwargsrepr, 3 the body, 4 the due time (ms), 5 the
    delivery tag, 6 the eta. Holes 0-3 and 5 lie between the quotes of a JSON string: what fills
    them is already JSON-escaped text (the envelope keeps it so: :mod:`..store.envelope`), and the body
    is sent as text (no ``body_encoding``). ``args_for(producer, envelope, due_ms)`` gives the
    ``Producer.publish`` keyword arguments Celery would use (the dispatcher's routing); it is
    called once per shape.
    """

    def __init__(
        self, channel: Any, producer: Any, args_for: Callable[[Any, Envelope, int], dict[str, Any]]
    ) -> None:
        self.channel = channel
        self.producer = producer
        self.args_for = args_for
        self._templates: dict[tuple[Any, ...], Any] = {}
        #: the template space of lua/push.lua (set by the owner: push.PushPath)
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
        if template.plain:
            text = text[: -len(PLAIN_TAIL)]
        values = (
            _jstr(job_id)[1:-1],
            _jstr(args)[1:-1],
            _jstr(kwargs)[1:-1],
            _jstr(text)[1:-1],
            str(due_ms),
            str(uuid.uuid4()),
            due_iso(due_ms),
        )
        literals, holes = template.literals, template.holes
        parts = [literals[0]]
        for n, hole in enumerate(holes, 1):
            parts.append(values[hole])
            parts.append(literals[n])
        return template.key, "".join(parts), template.queue, template.task

    def lua_template(self, raw: str, registered: Callable[[str], bool]) -> str:
        """The template ``lua/push.lua`` fills in for jobs of the shape of the envelope ``raw``,
        as JSON: literals ``l`` around holes ``h`` (as above: 0 id, 1 argsrepr, 2 kwargsrepr,
        3 body, 4 due ms, 5 delivery tag), the list key ``k``, and the queue ``q`` and task
        ``t``. ``"-"`` when that shape must go the beat's way: no template (see :meth:`build`),
        a task ``registered`` refuses, or an ``eta`` to write (``delayq_publish_eta``: the beat
        writes dates)."""
        cut = template_fields(raw)
        if cut is None:
            return "-"
        shape_key, data = cut[0], cut[1]
        template = self._template(shape_key, data)
        if not isinstance(template, _Template) or template.eta or not registered(template.task):
            return "-"
        spec = {
            "l": list(template.literals),
            "h": list(template.holes),
            "k": template.key,
            "q": template.queue,
            "t": template.task,
        }
        return json.dumps(spec, separators=(",", ":"))

    def _template(self, key: tuple[Any, ...], shape: dict[str, Any]) -> Any:
        """The kept template of the shape ``key`` (made from ``shape`` the first time; the kept
        ones are dropped when :data:`MAX_TEMPLATES` are kept)."""
        template = self._templates.get(key)
        if template is None:
            template = self._make(shape, plain=key[0])
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            self._templates[key] = template
        return template

    def _make(self, shape: dict[str, Any], plain: bool) -> Any:
        """The template of one shape: the reference message of a job of that shape with
        placeholder values, its body as text, cut at the placeholders; ``_NOT_WIRE`` when it has
        none (a body not in UTF-8 among them)."""
        body = _BODY + PLAIN_TAIL.encode() if plain else _BODY
        try:
            envelope = shape_envelope(shape, _ID, (_ARGS, _KWARGS), body)
            kwargs = self.args_for(self.producer, envelope, _DUE_MS)
            built = wire_message(self.channel, self.producer, kwargs, tag=_TAG, body_encoding=None)
        except Exception:  # the reference way reports it, job by job
            return _NOT_WIRE
        if built is None:
            return _NOT_WIRE
        key, text = built
        holes_by_text = {
            _jstr(_ID)[1:-1]: 0,
            _jstr(_ARGS)[1:-1]: 1,
            _jstr(_KWARGS)[1:-1]: 2,
            _jstr(_BODY.decode())[1:-1]: 3,
            str(_DUE_MS): 4,
            _jstr(_TAG)[1:-1]: 5,
            due_iso(_DUE_MS): 6,
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
            plain=plain,
            eta=6 in holes,
            task=envelope.task,
        )
