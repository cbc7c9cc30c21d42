"""What tests need of a store and of Redis itself: a :class:`Store` on a URL, the server's clock,
ids on one shard, snapshots of the database, the broker's lists and command statistics."""

from __future__ import annotations

import json
from typing import Any

import redis

from celery_delayq.config import DelayQConfig
from celery_delayq.keys import KeySpace
from celery_delayq.store import Store


def make_store(url: str, **settings: Any) -> Store:
    """A :class:`Store` on ``url`` with ``delayq_<name>`` settings given as ``name=value``."""
    values = {"delayq_url": url, **{f"delayq_{k}": v for k, v in settings.items()}}
    return Store(DelayQConfig.from_mapping(values))


def server_ms(client: Any) -> int:
    """The server's clock (``TIME``) in ms, as the claim script computes it."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def ids_on_shard(keys: KeySpace, shard: int, n: int, stem: str = "job") -> list[str]:
    """``n`` job ids that all hash to ``shard``."""
    found: list[str] = []
    i = 0
    while len(found) < n:
        candidate = f"{stem}-{i}"
        if keys.shard_of(candidate) == shard:
            found.append(candidate)
        i += 1
    return found


def snapshot(url: str) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key of the database with its type and DUMP: equal snapshots mean nothing changed."""
    raw = redis.Redis.from_url(url)
    try:
        return {key: (raw.type(key), raw.dump(key)) for key in raw.keys("*")}
    finally:
        raw.close()


def broker_lists(client: Any) -> dict[str, list[dict[str, Any]]]:
    """Messages in every list key (the Redis broker's queues), decoded, oldest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in client.keys("*"):
        if client.type(key) == "list":
            # kombu LPUSHes and consumers BRPOP: the oldest message is at the right end.
            out[key] = [json.loads(m) for m in reversed(client.lrange(key, 0, -1))]
    return out


def command_calls(client: Any, command: str) -> tuple[int, int]:
    """``(calls, failed_calls)`` of ``command`` from ``INFO commandstats`` (Lua calls count too)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)), int(stats.get("failed_calls", 0))
