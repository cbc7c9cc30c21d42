"""Connecting to Redis and reading its errors: the one client factory (plain, Cluster and TLS
connections) and what a Redis error says about the server.

Only the store (:mod:`celery_delayq.store.facade`) builds clients with :func:`make_client`; the
error helpers are what the layers above use to classify a failure without importing redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

__all__ = [
    "OOM_REPLY",
    "REDIS_ERRORS",
    "error_text",
    "evicts_jobs",
    "is_oom",
    "make_client",
    "redis_error_kind",
    "version_problem",
]

#: What a Redis or Redis Cluster client raises when the store cannot be reached or answer
#: (redis-py's cluster errors such as ``SlotNotCoveredError`` are not ``RedisError``s).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)

#: The part of :data:`REDIS_ERRORS` that means "not reached" (no connection, or no answer in time).
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)

#: In the error of a write refused because Redis is over maxmemory (every version's wording;
#: Redis 6.2 puts it inside a script's error: "@user_script: 1: -OOM command not allowed ...").
OOM_REPLY = "command not allowed when used memory"


def make_client(
    url: str, cluster: bool = False, connect_timeout: float | None = None, socket_timeout: float | None = None
) -> Any:
    """A redis-py client for ``url`` that returns ``str``: a ``RedisCluster`` (``url`` names
    any node; the others are discovered) when ``cluster``, else a ``Redis``. A ``rediss://``
    URL connects with TLS (its ``ssl_*`` query parameters apply), in both cases.

    Replies are decoded with ``surrogateescape``: a value that is not UTF-8 (bytes written
    into the store's keys by something else) reads as a ``str`` that encodes back to the
    same bytes, so the beat dead-letters such a job as corrupt instead of failing the whole
    claim on it, and acks or buries an id of that kind exactly. ``connect_timeout`` (seconds)
    bounds each connection attempt (the CLI's, so a wrong URL fails fast); ``socket_timeout``
    each reply (a ``socket_timeout`` in the URL wins over both).

    >>> make_client("redis://127.0.0.1:6390/0").get_connection_kwargs()["decode_responses"]
    True
    """
    options: dict[str, Any] = dict(
        decode_responses=True, encoding_errors="surrogateescape", health_check_interval=30
    )
    if connect_timeout is not None:
        options["socket_connect_timeout"] = connect_timeout
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def is_oom(exc: BaseException) -> bool:
    """Did Redis refuse this for memory (over ``maxmemory``, policy ``noeviction``)? Redis 7
    and Valkey answer a script's refused write with ``OOM``; Redis 6.2 wraps it in the
    script's error text."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and OOM_REPLY in str(exc)
    )


def redis_error_kind(exc: BaseException) -> str:
    """What a Redis error says about the server: ``"unreachable"`` (no connection, a timeout,
    a cluster failing over), ``"oom"`` (``maxmemory`` reached, writes refused), ``"noscript"``
    (the script cache was flushed again after the reload), ``"script"`` (any other error reply:
    a script or a command refused; Redis answers, so backing off does not help by itself), or
    ``"other"``.

    >>> from redis.exceptions import ConnectionError, OutOfMemoryError, ResponseError
    >>> redis_error_kind(ConnectionError("refused")), redis_error_kind(OutOfMemoryError("OOM"))
    ('unreachable', 'oom')
    >>> redis_error_kind(ResponseError(  # Redis 6.2's words for a script's refused write
    ...     "Error running script ...: @user_script: 1: -OOM command not allowed when used memory "
    ...     "> 'maxmemory'."))
    'oom'
    >>> redis_error_kind(ResponseError("Error running script: attempt to perform arithmetic on nil"))
    'script'
    """
    if is_oom(exc):
        return "oom"
    if isinstance(exc, NoScriptError):
        return "noscript"
    if isinstance(
        exc,
        redis.ConnectionError
        | redis.TimeoutError
        | ClusterDownError
        | TryAgainError
        | ReadOnlyError
        | RedisClusterException,
    ):
        return "unreachable"
    if isinstance(exc, ResponseError):
        return "script"
    return "other"


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``"<class>: <message>"`` of an error, for a log line: redis-py's ``repr`` of its errors
    (``server:ResponseError``) leaves out the message that says what went wrong.

    >>> error_text(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    'ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value'
    """
    text = str(exc)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def version_problem(info: Mapping[str, Any]) -> str | None:
    """Why a server that answers ``info`` (its ``INFO server``) cannot run the scripts, or None.

    >>> version_problem({"redis_version": "6.0.9"})
    'Redis 6.0.9 is too old: celery-delayq needs 6.2 or newer (ZRANGE BYSCORE)'
    >>> version_problem({"redis_version": "5.0.14"}) is None, version_problem({"redis_version": "6.2.0"})
    (False, None)
    >>> version_problem({"redis_version": "7.2.4", "valkey_version": "8.1.1"}) is None
    True
    """
    version = str(info.get("valkey_version") or info.get("redis_version") or "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not info.get("valkey_version") and parts < (6, 2):
        return f"Redis {version} is too old: celery-delayq needs 6.2 or newer (ZRANGE BYSCORE)"
    return None


def evicts_jobs(policy: str) -> bool:
    """May this ``maxmemory-policy`` evict the store's keys? ``allkeys-*`` evict any key.
    ``volatile-*`` evict only keys with a TTL, and no key holding jobs has one (the only
    keys with a TTL are the lateness histograms' per-minute hashes and finished batches'
    records), so they act as ``noeviction`` for the jobs. An unknown policy
    is taken to evict.

    >>> [evicts_jobs(p) for p in ("noeviction", "allkeys-lru", "volatile-ttl", "new-policy")]
    [False, True, False, True]
    """
    return policy != "noeviction" and not policy.startswith("volatile-")
