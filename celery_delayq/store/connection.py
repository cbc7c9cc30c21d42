"""Connecting to Redis and reading its errors: the one client factory (plain, Cluster and TLS
connections) and what a Redis error says about the server.

Only the store (:mod:`celery_delayq.store.facade`) builds clients with :func:`make_client`; the
error helpers are what the layers above use to classify a failure without importing redis.
:func:`store_error` is what the store's public calls raise instead of redis-py's error when the
store cannot be reached or refuses the login (:class:`~celery_delayq.exceptions.StoreUnreachable`,
:class:`~celery_delayq.exceptions.StoreRefused`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterDownError,
    ExternalAuthProviderError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from ..config import redact_url
from ..exceptions import StoreError, StoreRefused, StoreTimeout, StoreUnreachable

__all__ = [
    "OOM_REPLY",
    "REDIS_ERRORS",
    "cluster_nodes",
    "error_text",
    "evicts_jobs",
    "is_oom",
    "make_client",
    "redis_error_kind",
    "store_error",
    "version_problem",
]

#: What a Redis or Redis Cluster client raises when the store cannot be reached or answer
#: (redis-py's cluster errors such as ``SlotNotCoveredError`` are not ``RedisError``s), and what
#: the store's public calls raise in their place (:func:`store_error`; ``StoreUnreachable`` is
#: a ``redis.ConnectionError``, ``StoreRefused`` is named here).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException, StoreRefused)

#: The part of :data:`REDIS_ERRORS` that means "not reached" (no connection, or no answer in time).
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)

#: In the error of a write refused because Redis is over maxmemory (every version's wording;
#: Redis 6.2 puts it inside a script's error: "@user_script: 1: -OOM command not allowed ...").
OOM_REPLY = "command not allowed when used memory"


#: Redis's words for a login or a database it refuses (an error reply, not a network fault).
_REFUSED_REPLIES = ("WRONGPASS", "NOAUTH", "invalid password", "DB index is out of range", "Invalid Database")

#: redis-py's errors of a refused login (``AuthenticationError`` is also a ``ConnectionError``).
_REFUSED_ERRORS = (
    AuthenticationError,
    AuthorizationError,
    AuthenticationWrongNumberOfArgsError,
    ExternalAuthProviderError,
)

#: What a client raises when the store cannot be reached or answer now: the network, a timeout,
#: a Cluster failing over or whose nodes cannot be reached (``RedisClusterException`` covers
#: ``RedisClusterUnreachableError`` and ``SlotNotCoveredError``).
_UNREACHABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
    RedisClusterException,
)


def store_error(exc: BaseException, url: str, setting: str = "delayq_url") -> StoreError | None:
    """The error a public call of the store raises for redis-py's ``exc`` (which becomes its
    ``__cause__``), or None when ``exc`` is raised as it is (an error reply of a reachable
    Redis: a script or command error, OOM, NOSCRIPT). The message names ``url`` (password
    redacted) and ``setting`` (the setting that gave it, as the configuration spells it).

    >>> from redis.exceptions import AuthenticationError, ConnectionError, ResponseError
    >>> print(store_error(ConnectionError("Error 111 connecting to cache:1."), "redis://:pw@cache:1/0"))
    cannot reach Redis at redis://:***@cache:1/0 (delayq_url): Error 111 connecting to cache:1.
    >>> print(store_error(AuthenticationError("invalid username-password pair"), "redis://:x@cache:1/0"))
    Redis at redis://:***@cache:1/0 (delayq_url) refused the login: invalid username-password pair
    >>> print(store_error(ResponseError("DB index is out of range"), "redis://cache:1/99", "DJANGO_URL"))
    Redis at redis://cache:1/99 (DJANGO_URL) refused the database: DB index is out of range
    >>> store_error(ResponseError("WRONGTYPE Operation against a key"), "redis://cache:1/0") is None
    True
    """
    if isinstance(exc, StoreError):
        return None
    text = str(exc)
    where = f"{redact_url(url)} ({setting})"
    if isinstance(exc, _REFUSED_ERRORS) or (
        isinstance(exc, redis.ResponseError | redis.ConnectionError)
        and any(reply in text for reply in _REFUSED_REPLIES)
    ):
        what = "database" if "DB index" in text or "Database" in text else "login"
        return StoreRefused(f"Redis at {where} refused the {what}: {text}")
    if isinstance(exc, redis.TimeoutError):
        return StoreTimeout(f"Redis at {where} did not answer in time: {text or type(exc).__name__}")
    if isinstance(exc, _UNREACHABLE):
        return StoreUnreachable(f"cannot reach Redis at {where}: {text or type(exc).__name__}")
    return None


def cluster_nodes(url: str) -> tuple[str, list[ClusterNode]]:
    """A Cluster URL that may name several startup nodes, comma-separated
    (``redis://h1:7000,h2:7001/0``): the URL of its first node alone, and the others.

    >>> url, others = cluster_nodes("redis://:pw@h1:7000,h2:7001,[::1]:7002/0?socket_connect_timeout=1")
    >>> url, [(n.host, n.port) for n in others]
    ('redis://:pw@h1:7000/0?socket_connect_timeout=1', [('h2', 7001), ('::1', 7002)])
    >>> cluster_nodes("redis://h1:7000")
    ('redis://h1:7000', [])
    """
    parts = urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    first, *rest = hosts.split(",")
    others: list[ClusterNode] = []
    for name in rest:
        host, colon, port = name.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"a startup node is host:port, got {name!r}")
        others.append(ClusterNode(host.strip("[]"), int(port)))  # type: ignore[no-untyped-call]
    if not rest:
        return url, others
    return urlunsplit(parts._replace(netloc=f"{user}{at}{first}")), others


def make_client(
    url: str, cluster: bool = False, connect_timeout: float | None = None, socket_timeout: float | None = None
) -> Any:
    """A redis-py client for ``url`` that returns ``str``: a ``RedisCluster`` when ``cluster``
    (``url`` names one node or several, comma-separated, as :func:`cluster_nodes` reads them;
    the others are discovered from the first that answers), else a ``Redis``. A ``rediss://``
    URL connects with TLS (its ``ssl_*`` query parameters apply), in both cases. A
    ``RedisCluster`` asks its nodes for the slot map as it is made: when none answers, this
    raises redis-py's error (``RedisClusterException``).

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
        first, others = cluster_nodes(url)
        if parse_url(first).get("db", 0) != 0:  # type: ignore[no-untyped-call]
            raise ValueError("a Redis Cluster has database 0 only: leave the database out of the URL")
        return RedisCluster.from_url(first, startup_nodes=others, **options)
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
    if isinstance(exc, (*_UNREACHABLE, StoreRefused)):  # a refused login was redis-py's ConnectionError
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
