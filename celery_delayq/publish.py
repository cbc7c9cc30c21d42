"""The beat's publish of one job through Celery's own ``app.amqp.send_task_message``.

:func:`publish` hands a stored :class:`~.envelope.Envelope` to Celery as ``apply_async``
would (so ``before_task_publish``/``after_task_publish`` fire at the moment it really enters
the broker) with the body already serialized: kombu publishes the stored bytes as they are.
"""

from __future__ import annotations

from typing import Any

from celery.app.amqp import task_message

from .due import due_iso
from .due import local_now_ms as _now_ms
from .envelope import DUE_HEADER, Envelope

__all__ = ["publish"]


def publish(
    app: Any,
    producer: Any,
    envelope: Envelope,
    due_ms: int,
    now_ms: int | None = None,
    with_eta: bool = False,
) -> None:
    """Publish one job through Celery's ``send_task_message``, as ``apply_async`` would;
    ``with_eta`` (``delayq_publish_eta``): with its due time as the message's ``eta``."""
    headers = dict(envelope.headers)
    headers[DUE_HEADER] = due_ms / 1000.0
    if with_eta:
        headers["eta"] = due_iso(due_ms)
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
