"""The store's single writes over connections of its own (:class:`~celery_delayq.store.direct.DirectCalls`):
faults (a paused server, a killed connection, an error reply, a fork) leave no connection that
reads another call's reply, and ``Store.close`` closes them. Each test runs on a server of its
own (one is paused, one has its clients killed)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.store.direct import DirectCalls, _packed
from celery_delayq.store.facade import Store
from celery_delayq.store.jobs import CancelOutcome, EnqueueOutcome
from celery_delayq.store.scripts import SCRIPTS
from tests.support.store import make_store, server_ms


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
def r(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url + "/0", decode_responses=True)
    yield client
    client.close()


def direct(store: Store) -> DirectCalls:
    calls = store._direct
    assert calls is not None
    return calls


def opened(store: Store) -> int:
    """Connections the store's direct calls have opened and hold now."""
    return sum(1 for conn in direct(store)._made if conn._sock is not None)


def test_only_a_plain_client_with_its_own_pool_gets_direct_calls(server: EmbeddedRedis) -> None:
    url = server.url + "/0"
    assert DirectCalls.for_client(redis.Redis.from_url(url)) is not None
    single = redis.Redis.from_url(url, single_connection_client=True)
    assert DirectCalls.for_client(single) is None
    single.close()

    class Sub(redis.Redis):
        pass

    assert DirectCalls.for_client(Sub.from_url(url)) is None
    assert DirectCalls.for_client(object.__new__(RedisCluster)) is None


def test_single_writes_reuse_one_connection(server: EmbeddedRedis, r: redis.Redis) -> None:
    store = make_store(server.url + "/0")
    due = server_ms(r) + 60_000
    for i in range(20):
        assert store.enqueue([(f"j{i}", due, "env")]) == [(EnqueueOutcome.NEW, due)]
    assert store.cancel("j0") == CancelOutcome.CANCELLED
    assert opened(store) == 1
    store.close()


def test_an_error_reply_leaves_the_connection_ready_for_the_next_call(
    server: EmbeddedRedis, r: redis.Redis
) -> None:
    store = make_store(server.url + "/0")
    keys = store.keys.shard(0).core
    with pytest.raises(redis.ResponseError, match="mode must be"):
        direct(store).call(SCRIPTS["enqueue"], keys, ["bad", "ch", 0, "at", "a", 1, "env"])
    due = server_ms(r) + 60_000
    assert store.enqueue([("a", due, "env")]) == [(EnqueueOutcome.NEW, due)]
    assert store.cancel("a") == CancelOutcome.CANCELLED
    assert opened(store) == 1
    store.close()


def test_a_killed_connection_reconnects(server: EmbeddedRedis, r: redis.Redis) -> None:
    store = make_store(server.url + "/0")
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "env")])
    assert r.client_kill_filter(_type="normal", skipme=True) >= 1
    assert store.cancel("a") == CancelOutcome.CANCELLED  # the retry policy reconnects
    assert store.cancel("a") == CancelOutcome.MISSING
    store.close()


def test_a_paused_server_times_out_and_no_late_reply_is_read(server: EmbeddedRedis, r: redis.Redis) -> None:
    """The server is stopped (SIGSTOP) while a write waits for its reply: the call times out and
    its connection is closed, so the reply the server sends once resumed is never taken for the
    reply of a later call."""
    store = make_store(server.url + "/0?socket_timeout=0.2")
    due = server_ms(r) + 60_000
    store.enqueue([("a", due, "env")])
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(redis.TimeoutError):
            store.enqueue([("b", due, "env")])
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert store.cancel("a") == CancelOutcome.CANCELLED  # this call's reply, not the late one
    assert store.enqueue([("c", due + 1, "env")]) == [(EnqueueOutcome.NEW, due + 1)]
    assert store.get("b") is not None  # the server ran the sends it had received
    store.close()


def test_threads_each_get_a_whole_reply(server: EmbeddedRedis, r: redis.Redis) -> None:
    store = make_store(server.url + "/0")
    due = server_ms(r) + 60_000
    errors: list[BaseException] = []

    def produce(t: int) -> None:
        try:
            for i in range(200):
                job = f"t{t}-{i}"
                assert store.enqueue([(job, due + i, "env")]) == [(EnqueueOutcome.NEW, due + i)]
                assert store.cancel(job) == CancelOutcome.CANCELLED
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert 1 <= opened(store) <= 4  # at most one a call running at once
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_opens_its_own_connection(server: EmbeddedRedis, r: redis.Redis) -> None:
    store = make_store(server.url + "/0")
    due = server_ms(r) + 60_000
    store.enqueue([("parent-1", due, "env")])
    parent_conn = next(iter(direct(store)._made))
    pid = os.fork()
    if pid == 0:  # the child: its writes must not go over the parent's socket
        code = 1
        try:
            ok = store.enqueue([("child", due, "env")]) == [(EnqueueOutcome.NEW, due)]
            code = 0 if ok and parent_conn not in direct(store)._made else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.enqueue([("parent-2", due, "env")]) == [(EnqueueOutcome.NEW, due)]
    assert next(iter(direct(store)._made)) is parent_conn
    assert store.count() == 3
    store.close()


def test_close_closes_the_direct_connections(server: EmbeddedRedis, r: redis.Redis) -> None:
    store = make_store(server.url + "/0")
    store.enqueue([("a", server_ms(r) + 60_000, "env")])
    assert opened(store) == 1
    store.close()
    assert opened(store) == 0
    assert store.cancel("a") == CancelOutcome.CANCELLED  # a later call opens one again


@pytest.mark.parametrize(
    "command",
    [
        (
            "EVALSHA",
            "ab" * 20,
            2,
            "k:{1}:due",
            "k:{1}:jobs",
            "keep",
            3,
            "at",
            1,
            "é \u2603",
            "x" * 70_000,
            1.5,
        ),
        ("EVALSHA", "ab" * 20, 0, memoryview(b"view"), bytearray(b"array"), b"bytes"),
    ],
)
def test_a_script_call_is_packed_as_redis_py_packs_it(command: tuple[object, ...]) -> None:
    """DirectCalls hands a command straight to hiredis: the same bytes as redis-py's own packing
    (a memoryview or bytearray goes redis-py's way), and the same error for what it refuses."""
    conn = redis.Connection(decode_responses=True, encoding_errors="surrogateescape")
    assert b"".join(_packed(conn, command)) == b"".join(conn.pack_command(*command))
    with pytest.raises(redis.DataError):
        _packed(conn, ("EVALSHA", "ab", 0, object()))
