"""What Celery would send for a stored job: the arguments of the ``Producer.publish`` call
``send_task_message`` makes (:func:`direct_args`), that call itself (:func:`send_task`, as
``apply_async`` would), and whether the first may stand in for the second
(:func:`can_publish_direct`), and the headers a message carries (:func:`message_headers`). Used
by the publishing strategies of :mod:`.publish` and :mod:`.push`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.app.amqp import task_message
from celery.signals import after_task_publish, before_task_publish, task_sent

from ..due import due_iso
from ..store.envelope import CLAIM_HEADER, DUE_HEADER, Envelope

__all__ = ["can_publish_direct", "direct_args", "message_headers", "send_task", "transport_batches"]


def can_publish_direct(app: Any, producer: Any) -> bool:
    """True when nothing would notice Celery's ``send_task_message`` being skipped.

    That is: no receiver of ``before_task_publish``/``after_task_publish``/
    ``task_sent``, no task-sent events, and a transport with kombu publish
    batches (Redis). Then each message is handed to kombu's ``Producer.publish``
    with the arguments :func:`direct_args` works out (exactly the same message), or,
    when the broker is the store's Redis, built by :func:`.wire.wire_message` and pushed by
    :meth:`.push.Pusher.push` (the push path).
    """
    if app.conf.task_send_sent_event:
        return False
    if any(sig.receivers for sig in (before_task_publish, after_task_publish, task_sent)):
        return False
    return transport_batches(producer)


def message_headers(envelope: Envelope) -> dict[str, Any]:
    """The headers the message of ``envelope`` carries: its own, and those of its route's
    ``headers`` option (:func:`direct_args` merges them)."""
    extra = envelope.route.get("headers")
    if isinstance(extra, dict) and extra:
        return {**envelope.headers, **extra}
    return envelope.headers


def transport_batches(producer: Any) -> bool:
    """Whether the producer's transport has kombu publish batches (Redis: the publishes
    are buffered and sent when the batch is flushed)."""
    try:
        channel = producer.channel
    except Exception:  # broker unreachable: the normal path reports it per job
        return False
    return bool(getattr(channel, "create_publish_batch", None)) and getattr(
        channel, "supports_batch_publish", True
    )


def direct_args(
    app: Any,
    conf: dict[str, Any],
    envelope: Envelope,
    due_ms: int,
    with_eta: bool,
    now_ms: float,
    declare: Callable[[Any], None],
) -> dict[str, Any]:
    """``send_task_message``'s routing, without the signal machinery: the keyword
    arguments of the ``Producer.publish`` call it would make. ``conf``: the app settings
    it reads (task_compression, task_default_delivery_mode, task_default_routing_key,
    task_serializer); ``declare``: declares a kombu queue (once per pass)."""
    amqp = app.amqp
    headers = dict(envelope.headers)
    headers[DUE_HEADER] = due_ms
    if with_eta:
        headers["eta"] = due_iso(due_ms)
    route = dict(envelope.route)
    extra = route.pop("headers", None)
    if extra:
        headers.update(extra)
    qname = queue = route.pop("queue", None)
    exchange = route.pop("exchange", None)
    routing_key = route.pop("routing_key", None)
    exchange_type = route.pop("exchange_type", None)
    delivery_mode = route.pop("delivery_mode", None)
    compression = route.pop("compression", None) or conf["task_compression"]
    declared = route.pop("declare", None)
    for name in ("retry", "retry_policy", "serializer", "timeout", "confirm_timeout", "event_dispatcher"):
        route.pop(name, None)
    if envelope.expires_ms is not None:
        route["expiration"] = max(0.0, (envelope.expires_ms - now_ms) / 1000.0)
    if queue is None and exchange is None:
        queue = amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            queue = amqp.queues[queue]
        qname = queue.name
        if declared is None:
            declare(queue)
            declared = []
    if delivery_mode is None:
        delivery_mode = getattr(getattr(queue, "exchange", None), "delivery_mode", None)
        delivery_mode = delivery_mode or conf["task_default_delivery_mode"]
    if exchange_type is None:
        exchange_type = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        exchange = queue.exchange.name or amqp.default_exchange
        routing_key = routing_key or queue.routing_key or conf["task_default_routing_key"]
    properties = dict(envelope.props)
    properties.update(route)
    return dict(
        body=envelope.body,
        exchange=exchange,
        routing_key=routing_key,
        serializer=conf["task_serializer"],
        compression=compression,
        retry=False,
        delivery_mode=delivery_mode,
        declare=declared,
        headers=headers,
        content_type=envelope.content_type,
        content_encoding=envelope.content_encoding,
        **properties,
    )


def send_task(
    app: Any,
    producer: Any,
    envelope: Envelope,
    due_ms: int,
    now_ms: int,
    with_eta: bool = False,
    claim: str | None = None,
) -> None:
    """Publish one job through Celery's ``send_task_message``, as ``apply_async`` would;
    ``with_eta`` (``delayq_publish_eta``): with its due time as the message's ``eta``;
    ``claim``: the :data:`~..store.envelope.CLAIM_HEADER` it carries (see :mod:`..worker.starts`)."""
    headers = dict(envelope.headers)
    headers[DUE_HEADER] = due_ms
    if with_eta:
        headers["eta"] = due_iso(due_ms)
    props = dict(envelope.props)
    route = dict(envelope.route)
    if claim is not None:
        headers[CLAIM_HEADER] = claim
        extra = route.get("headers")  # send_task_message lays these over the message's
        if isinstance(extra, dict) and CLAIM_HEADER in extra:
            route["headers"] = {k: v for k, v in extra.items() if k != CLAIM_HEADER}
    if envelope.expires_ms is not None:
        route["expiration"] = max(0.0, (envelope.expires_ms - now_ms) / 1000.0)
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
            "eta": headers.get("eta"),
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
