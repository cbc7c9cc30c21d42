"""The wake channel seen from a test: :class:`Wake` reads what the scripts publish there, and the
``wake`` fixture (imported by the test modules that use it) subscribes to the ``store`` fixture's
channel."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_delayq.store.facade import Store


class Wake:
    """A subscription to the wake channel that reads messages up to a sentinel."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self.pubsub = client.pubsub()
        self.pubsub.subscribe(channel)
        # Wait for the subscription to be active before anything is published.
        confirm = self.pubsub.get_message(timeout=5.0)
        assert confirm is not None and confirm["type"] == "subscribe"

    def drain(self) -> list[str]:
        """Every message published since the last drain (in order)."""
        self.client.publish(self.channel, "sentinel")
        got: list[str] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=1.0)
            if message is None or message["type"] != "message":
                continue
            if message["data"] == "sentinel":
                return got
            got.append(message["data"])
        raise AssertionError(f"sentinel never arrived; got {got}")

    def close(self) -> None:
        self.pubsub.close()


@pytest.fixture
def wake(store: Store, r: redis.Redis) -> Iterator[Wake]:
    w = Wake(r, store.keys.wake_channel)
    yield w
    w.close()
