"""What a dispatched job looks like on the Redis broker, next to what ``apply_async`` publishes:
:func:`dispatch` one pass of a beat, :func:`pop_broker_messages`, :func:`normalized` and the
option sets (:data:`OPTION_SETS`) they are compared over."""

from __future__ import annotations

import json
from typing import Any

import redis
from celery import Celery

from celery_delayq.beat.dispatch import Dispatcher
from tests.support.store import broker_lists
from tests.support.wire import text_body


def dispatch(app: Celery) -> None:
    dispatcher = Dispatcher(app)
    try:
        dispatcher.run_once()
    finally:
        dispatcher.close()


def pop_broker_messages(r: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    found = broker_lists(r)
    for key in found:
        r.delete(key)
    return found


def normalized(message: dict[str, Any], task_id: str) -> dict[str, Any]:
    message = json.loads(json.dumps(message).replace(task_id, "<id>"))
    text_body(message)
    message["properties"].pop("delivery_tag")
    message["headers"].pop("delayq_due", None)
    message["headers"].pop("delayq_claim", None)  # kombu-path messages only: the beat's claim
    return message


OPTION_SETS: list[dict[str, Any]] = [
    {},
    {"queue": "q1"},
    {"queue": "q1", "priority": 3},
    {"priority": 9},
    {"queue": "q1", "routing_key": "q1"},
    {"headers": {"h": 1, "nested": {"a": [1, 2]}}},
    {"ignore_result": True},
    {"time_limit": 30, "soft_time_limit": 20},
    {"shadow": "nice-name"},
    {"retries": 2},
    {"group_id": "g1", "group_index": 4},
    {"root_id": "root-1", "parent_id": "parent-1"},
    {"serializer": "pickle"},
    {"compression": "zlib"},
    {"reply_to": "somewhere"},
]
