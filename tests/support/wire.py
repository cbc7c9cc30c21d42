"""The push path's differential tests, shared by tests/test_wire.py and tests/test_push.py:
the option sets compared with kombu, the generated job values, and the broker lists taken and
compared. Their apps come from the ``app_factory`` fixture (tests/support/apps.py; ``AppFactory``
is re-exported here)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.support.apps import AppFactory

__all__ = [
    "JOB_VALUES",
    "OPTION_SETS",
    "WITH_AND_WITHOUT_ETA",
    "AppFactory",
    "OptionSet",
    "body_of",
    "comparable",
    "take_lists",
    "text_body",
]


def take_lists(r: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    """Every list (queue) with its messages decoded, then delete them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in r.keys("*"):
        if r.type(key) == "list":
            out[key] = [json.loads(m) for m in reversed(r.lrange(key, 0, -1))]
            r.delete(key)
    return out


def text_body(message: dict[str, Any]) -> None:
    """Put a base64 body (kombu's Redis channel writes every body so) as text, as the template
    paths send one (no ``body_encoding``, as kombu does with the transport option
    ``body_encoding=None``); a body that is not text is left in base64 (both paths send it so)."""
    props = message["properties"]
    if props.get("body_encoding") == "base64":
        try:
            message["body"] = base64.b64decode(message["body"]).decode(message["content-encoding"])
        except (UnicodeError, LookupError):
            return
        props["body_encoding"] = None


def body_of(message: dict[str, Any]) -> bytes:
    """A broker message's body as bytes: base64-decoded when its ``body_encoding`` says so (kombu's
    Redis channel), else its text (the template paths send it so)."""
    if message["properties"].get("body_encoding") == "base64":
        return base64.b64decode(message["body"])
    return str(message["body"]).encode(message.get("content-encoding") or "utf-8")


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message less what differs between two publishes of one job by design."""
    message = json.loads(json.dumps(message))
    props = message["properties"]
    assert isinstance(props.pop("delivery_tag"), str)
    props.pop("reply_to")  # each app has its own reply-to oid
    text_body(message)
    # The claim a beat puts on what it publishes through kombu (celery_delayq/worker/starts.py): the
    # push path needs none, on claim or not (tests/test_start_check.py checks both sides).
    message["headers"].pop("delayq_claim", None)
    if "expiration" in props:  # the time left, computed at publish
        props["expiration"] = "<set>"
    return message


#: Generated jobs: any argument text, any due time from 1970 to 9999.
JOB_VALUES = given(
    args=st.text(max_size=40),
    kwargs=st.text(max_size=40),
    due_ms=st.integers(min_value=0, max_value=253_402_300_799_999),
)
WITH_AND_WITHOUT_ETA = pytest.mark.parametrize("publish_eta", [False, True], ids=["no-eta", "publish-eta"])

#: (id, args, kwargs, options)
OptionSet = tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any]]

OPTION_SETS: list[OptionSet] = [
    ("plain", (1,), {}, {}),
    ("queue", (1,), {}, {"queue": "q2"}),
    ("priority", (1,), {}, {"priority": 3}),
    ("priority-queue", (1,), {}, {"priority": 9, "queue": "q2"}),
    ("headers", (1,), {}, {"headers": {"h": 1, "nested": {"x": [1, "\u00e9"]}}}),
    ("text", ('quote " back \\ \u00e9 \u2603 \U0001f600',), {"y": [None, True, 1.5, {"z": "\n"}]}, {}),
    (
        "json-types",  # every JSON type a job's arguments carry, as they come
        (
            [
                10**30,
                -(2**70),
                -0.0,
                1e-300,
                1.5e300,
                [],
                {},
                [[{}], []],
                "\ud83d\ude00 \ud800 \x00 \u2028",
                "",
            ],
        ),
        {"y": {"empty": {}, "none": None, "nested": {"a": [{"b": [1, 2.5, "c"]}]}, "\u00e9": True}},
        {},
    ),
    ("ids", (1,), {}, {"shadow": "nick", "root_id": "root-1", "parent_id": "parent-1"}),
    ("transient", (1,), {}, {"delivery_mode": "transient"}),
    ("expires", (1,), {}, {"expires": 600}),
    ("pickle", ({1, 2},), {}, {"serializer": "pickle"}),
]
