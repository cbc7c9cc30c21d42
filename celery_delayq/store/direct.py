"""Single script calls over connections of the store's own (:class:`DirectCalls`), not taken
from the client's pool at each call: the store's single writes on a plain ``redis.Redis``
(``Store`` makes one per client, :mod:`.base`). Pipelines and every other client go through
:mod:`.scripts`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

from redis import ConnectionPool, Redis
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError, NoScriptError, TimeoutError

from .scripts import LuaScript

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py packs in Python without hiredis
    _hiredis_pack = None  # type: ignore[assignment]

__all__ = ["DirectCalls"]


class DirectCalls:
    """Single script calls on a plain ``redis.Redis`` over connections kept here, not taken
    from the client's pool at each call.

    redis-py 8's ``execute_command`` and pool do work at every call (a lock, metrics, an
    event, the retry wrapper's bookkeeping). What this buys, on the bench's apply_at row (a
    job of the real shape, loopback, a busy 2-core VM;
    ``BENCH_APPLY_AT_WITHOUT=direct python -m bench --only apply_at``, both in the same
    halves): 124 µs a call with it, 151 without; 119 vs 184; 142 vs 174; 138 vs 200 (four runs).
    Here a call takes an idle connection from a list (or opens one: as many as calls run at
    once, as the pool would), checks it as the pool does (:func:`_ready`: one the server
    closed is opened again), sends ``EVALSHA`` and reads the reply with the connection's own
    health check and retry policy (as ``execute_command`` does), and puts it back. A
    connection that failed was closed by redis-py (on any error or interruption of a send or
    read) and reconnects at its next use; one that read a whole reply, error replies
    included, is ready for the next call. After a fork the child opens connections of its
    own. :meth:`close` closes them all. ``for_client`` says None for any other client (a
    cluster, a subclass, one connection of its own, client-side caching, another pool
    class): its calls go through ``evalsha``.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool = client.connection_pool
        self._pid = os.getpid()
        self._idle: list[Any] = []
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()

    @classmethod
    def for_client(cls, client: Any) -> DirectCalls | None:
        """Direct calls on ``client``, or None when it is not a plain ``redis.Redis``."""
        if type(client) is not Redis or client.connection is not None:
            return None
        pool = client.connection_pool
        if type(pool) is not ConnectionPool or getattr(pool, "cache", None) is not None:
            return None
        return cls(client)

    def call(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script`` (loading it on NOSCRIPT, as :meth:`LuaScript.__call__`)."""
        try:
            return self._evalsha(script.sha_for(self.client), keys, args)
        except NoScriptError:
            script.load(self.client)
            return self._evalsha(script.sha_for(self.client), keys, args)

    def _evalsha(self, sha: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are not its own
            self._pid, self._idle, self._made = os.getpid(), [], weakref.WeakSet()
        idle = self._idle
        try:
            conn = idle.pop()
        except IndexError:
            pool = self._pool
            conn = pool.connection_class(**pool.connection_kwargs)
            self._made.add(conn)
        try:
            _ready(conn)
        except BaseException:
            idle.append(conn)
            raise

        try:
            packed = _packed(conn, ("EVALSHA", sha, len(keys), *keys, *args))

            def send() -> Any:
                conn.send_packed_command(packed)  # what conn.send_command does once it has packed
                return conn.read_response()

            return conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
        finally:
            # The server announced maintenance (redis-py 7+): closed, as the pool does.
            reconnect = getattr(conn, "should_reconnect", None)
            if reconnect is not None and reconnect():
                conn.disconnect()
            idle.append(conn)

    def close(self) -> None:
        """Close every connection opened here (the next call opens one again)."""
        for conn in list(self._made):
            conn.disconnect()


def _packed(conn: Any, command: tuple[Any, ...]) -> Any:
    """``command`` in the Redis protocol, as ``conn.send_command`` packs it. With hiredis,
    redis-py's packer first rewrites every argument in Python (a generator over them all, for
    the bytearrays and memoryviews hiredis does not take); a command of a script's strings and
    integers goes to hiredis as it is (about 4 µs less a call; anything hiredis refuses goes the
    packer's way, which says what is wrong as redis-py does). The command name has no space."""
    if _hiredis_pack is not None and type(getattr(conn, "_command_packer", None)) is HiredisRespSerializer:
        try:
            return [_hiredis_pack(command)]
        except TypeError:
            pass
    return conn.pack_command(*command)


def _ready(conn: Any) -> None:
    """Connect ``conn``, or connect it again when the server closed it while it was idle (a
    restart, ``CLIENT KILL``, the server's idle ``timeout``) or it holds unread data: the check
    redis-py's pool makes at each checkout, so a write is never sent on a dead connection.
    (redis-py 8's ``connect()`` runs its retry wrapper even on a connected socket: it is only
    called on one without a socket.)"""
    if getattr(conn, "_sock", None) is None:
        conn.connect()
    try:
        if conn.can_read():
            raise ConnectionError("Connection has data")
    except (ConnectionError, TimeoutError, OSError):
        conn.disconnect()
        conn.connect()
        if conn.can_read():
            raise ConnectionError("Connection not ready") from None
