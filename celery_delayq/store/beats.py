"""The beats' upkeep and the server: heartbeats, lateness histograms, the wake channel and
markers, and the server checks (version, eviction policy, same server as the broker).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from ..exceptions import CorruptData, UnsupportedServer
from . import lateness
from .base import StoreBase
from .bounded import MAX_SMALL, load_json
from .connection import REDIS_ERRORS, evicts_jobs, version_problem

#: A wake marker as the scripts write it: ms, digits (a score Redis prints may have a fraction).
_MARKER = re.compile(r"-?[0-9]{1,17}(\.[0-9]{1,17})?")


def is_acl_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command to the user's ACL (``NOPERM``).

    >>> is_acl_refusal(redis.exceptions.NoPermissionError("no permissions")), is_acl_refusal(ValueError())
    (True, False)
    """
    return isinstance(exc, redis.exceptions.NoPermissionError)


def read_marker(raw: Any) -> float | None:
    """A shard's wake marker (ms), or None when it is missing or does not read as one: Lua's
    ``tonumber`` reads every text this accepts as the same number, so a marker the scripts
    would take as missing is never trusted here.

    >>> read_marker("1700000000000"), read_marker("9999999999999999"), read_marker("12.5")
    (1700000000000.0, 1e+16, 12.5)
    >>> read_marker(None), read_marker("soon"), read_marker("1e3"), read_marker(" 12"), read_marker("nan")
    (None, None, None, None, None)
    """
    if not isinstance(raw, str) or not _MARKER.fullmatch(raw):
        return None
    return float(raw)


#: Longest wait (s) for the server's confirmation of the wake channel's SUBSCRIBE.
SUBSCRIBE_TIMEOUT = 5.0


class BeatsPart(StoreBase):
    """The beats' upkeep and the server (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def beats(self) -> dict[str, Any]:
        """What each beat last wrote into ``<prefix>:beats``: ``{token: decoded JSON}``
        (a value that is not JSON is returned as the string it is)."""
        out: dict[str, Any] = {}
        for token, raw in self.client.hgetall(self.keys.beats).items():
            try:
                out[token] = load_json(raw, "heartbeat", None, MAX_SMALL)
            except CorruptData:
                out[token] = raw
        return out

    def write_heartbeat(self, token: str, entry: Mapping[str, Any], read_all: bool) -> dict[str, str] | None:
        """Set ``token``'s entry of ``<prefix>:beats``; with ``read_all``, return the whole hash
        (in the same round trip)."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.beats, token, json.dumps(entry, separators=(",", ":")))
            if read_all:
                pipe.hgetall(self.keys.beats)
            replies = pipe.execute()
        return dict(replies[1]) if read_all else None

    def forget_beats(self, *tokens: str) -> None:
        """Remove the entries of ``tokens`` from ``<prefix>:beats``."""
        if tokens:
            self.client.hdel(self.keys.beats, *tokens)

    def add_lateness(self, key: str, fields: Mapping[str, float], minute: int | None = None) -> None:
        """Add a lateness histogram's counts (:mod:`.lateness`) to the hash ``key`` and, in the
        same pipeline, to the hash of ``minute`` (epoch minute; default: the server's now), which
        expires an hour after that minute ends (:func:`.lateness.minute_ttl_ms`; a minute older
        than that is not written)."""
        now = self.server_now_ms()
        minute = now // lateness.MINUTE_MS if minute is None else int(minute)
        ttl = lateness.minute_ttl_ms(minute, now)
        keys = [key, lateness.minute_key(key, minute)] if ttl > 0 else [key]
        with self.client.pipeline(transaction=False) as pipe:
            for target in keys:
                for name, value in fields.items():
                    if name == "sum_ms":
                        pipe.hincrbyfloat(target, name, round(value, 3))
                    else:
                        pipe.hincrby(target, name, int(value))
            if ttl > 0:
                pipe.pexpire(keys[1], ttl)
            pipe.execute()

    def lateness_fields(self, key: str) -> dict[str, Any]:
        """The hash ``key`` of a lateness histogram, as stored."""
        return dict(self.client.hgetall(key))

    def lateness_minutes(self, key: str, minutes: Iterable[int]) -> list[dict[str, Any]]:
        """The minute hashes (:func:`.lateness.minute_key`) of the histogram ``key`` for each of
        ``minutes``, as stored (empty when absent), in one pipeline."""
        with self.client.pipeline(transaction=False) as pipe:
            for minute in minutes:
                pipe.hgetall(lateness.minute_key(key, minute))
            return [dict(fields or {}) for fields in pipe.execute()]

    def check_server(self) -> list[str]:
        """Raise if the server cannot run the scripts; return warnings worth logging.

        A check the server refuses (an ACL user without ``INFO`` or ``CONFIG``, a managed
        Redis, a renamed command; see docs/security.md) is skipped, with a warning for the
        version check.
        """
        if self.is_cluster:
            return self._check_cluster()
        warnings: list[str] = []
        try:
            info = self.client.info("server")
        except redis.ResponseError as exc:  # NOPERM (a NoPermissionError) or unknown command
            warnings.append(
                f"cannot read INFO ({exc}): the server version was not checked "
                "(celery-delayq needs Redis 6.2 or newer, or Valkey)"
            )
            info = None
        problem = None if info is None else version_problem(info)
        if problem is not None:
            raise UnsupportedServer(problem)
        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.ResponseError:
            policy = None  # CONFIG disabled (managed Redis, ACL): nothing to say
        if policy and evicts_jobs(policy):
            warnings.append(
                f"Redis maxmemory-policy is {policy!r}: when used memory reaches maxmemory, Redis "
                "may evict scheduled jobs; set it to 'noeviction' (a full Redis then refuses new "
                "jobs with StoreFull while the beats go on delivering due ones, which frees memory)"
            )
        return warnings

    def _check_cluster(self) -> list[str]:
        """:meth:`check_server` on every primary of the cluster (each answers for itself)."""
        warnings: list[str] = []
        for node in self.client.get_primaries():
            one = type(self)(self.config, self.client.get_redis_connection(node))
            warnings.extend(f"{node.name}: {warning}" for warning in one.check_server())
        return warnings

    def ping(self) -> None:
        """Raise when the server cannot be reached (or refuses the credentials)."""
        self.client.ping()

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._client is not None:  # (a Cluster client never made: nothing to close)
            self._client.close()

    def wake_subscription(self) -> Any:
        """A pub/sub connection subscribed to the wake channel (``get_message``, ``close``).

        On a cluster, redis-py opens it on the node that its cached slot map says serves the
        channel's slot, and a connection error does not refresh that map: when the
        subscription fails, the map is read again (:meth:`refresh_slots`) before the error is
        raised, so that the next attempt goes to the slot's new owner after a failover.

        Returns once the server confirmed the subscription (redis-py's ``subscribe`` only sends
        it): a refusal (an ACL without the channel) raises here, and a job stored after this
        returns sends a wake message that the subscription hears."""
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(self.keys.wake_channel)
            deadline = time.monotonic() + SUBSCRIBE_TIMEOUT
            while True:
                message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None and message.get("type") == "subscribe":
                    break
                if time.monotonic() >= deadline:
                    raise redis.TimeoutError(f"SUBSCRIBE not confirmed in {SUBSCRIBE_TIMEOUT:.0f} s")
            pubsub.ignore_subscribe_messages = True
        except REDIS_ERRORS:
            with contextlib.suppress(*REDIS_ERRORS):
                pubsub.close()
            self.refresh_slots()
            raise
        return pubsub

    def refresh_slots(self) -> bool:
        """On a cluster, read the slot map again from the first node that answers
        (redis-py's ``NodesManager.initialize``: ``CLUSTER SLOTS``); whether it could. Never
        raises. A plain server has no map: False."""
        if not self.is_cluster:
            return False
        try:
            self.client.nodes_manager.initialize()
        except REDIS_ERRORS:
            return False
        return True

    def wake_markers(self) -> tuple[int, list[float | None]]:
        """The server's now (ms, ``TIME``) and every shard's wake marker (ms), read for the
        safety poll in one round trip: ``TIME`` and one ``MGET`` on one server (2 commands); on a
        Cluster, ``TIME`` of one node and a ``GET`` per shard, pipelined by node.

        A marker that is missing, or not a decimal number of ms (see :func:`read_marker`), is
        None: the shard must be claimed to know.
        """
        names = [shard.wake for shard in self.keys.all_shards()]
        if self.is_cluster:
            now = self.client.time()
            raws = self.client.mget_nonatomic(names)
        else:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.mget(names)
                now, raws = pipe.execute()
        return int(now[0]) * 1000 + int(now[1]) // 1000, [read_marker(raw) for raw in raws]

    def is_single_server(self) -> bool:
        """Whether the store is one plain Redis server (no cluster): the only case where it can
        also be a Redis broker and push messages itself (``lua/push_claimed.lua``)."""
        return isinstance(self.client, redis.Redis)

    def is_server_of(self, broker_client: Any) -> bool:
        """Whether ``broker_client`` (a kombu channel's redis client) talks to this store's
        server (``run_id``), database and user. A user that may not run ``INFO`` answers False."""
        broker_kw = broker_client.connection_pool.connection_kwargs
        store_kw = self.client.connection_pool.connection_kwargs
        if int(broker_kw.get("db") or 0) != int(store_kw.get("db") or 0):
            return False
        if broker_kw.get("username") != store_kw.get("username"):
            return False
        try:
            broker_id = broker_client.info("server").get("run_id")
            return bool(broker_id == self.client.info("server").get("run_id"))
        except redis.ResponseError:  # INFO refused (ACL)
            return False

    def database(self) -> int:
        return int(self.client.connection_pool.connection_kwargs.get("db") or 0)
