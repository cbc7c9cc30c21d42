"""Security (docs/security.md): a store user limited by ACL to the key prefix, TLS, no
unpickling in the beat, and prefix isolation, each against real Redis servers."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import re
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads as kombu_loads

from celery_delayq import DelayedTask, DelayQ, Schedules
from celery_delayq.admin.listing import id_search, jobs_page
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.beat.metrics import DispatcherCollector
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.devtools.embedded import EmbeddedRedis, free_port
from celery_delayq.store.connection import make_client
from celery_delayq.store.facade import get_store
from celery_delayq.worker.starts import StartCheck
from tests.support.acl import (
    SECURITY,
    STORE_PASSWORD,
    documented_rule,
    push_path_words,
    script_commands,
    server_kind,
)
from tests.support.apps import AppFactory
from tests.support.cluster import LocalCluster, cluster_url, redis_cluster
from tests.support.polling import wait_for
from tests.support.store import broker_lists, server_ms
from tests.support.wire import body_of

__all__ = ["cluster_url", "redis_cluster"]  # fixtures, used by name

HOUR = 3600.0
START_TTL_MS = 60_000
ADMIN = ("admin", "admin-pw")


def server_rule(admin: redis.Redis, user: str = "delayq") -> list[str]:
    """The documented rule as the docs say to write it for ``admin``'s server."""
    return documented_rule(user, server=server_kind(admin))


def rule_commands(rule: list[str]) -> set[str]:
    return {w[1:] for w in rule if w.startswith("+") and not w.startswith("+@")}


def top_level(commands: set[str]) -> set[str]:
    return {c.split("|")[0] for c in commands}


def set_user(admin: redis.Redis, rule: list[str]) -> None:
    admin.execute_command("ACL", "SETUSER", *rule)


def denied(admin: redis.Redis) -> list[tuple[str, str]]:
    """``(reason, object)`` of every ``ACL LOG`` entry (reason: command, key or channel)."""
    return [(str(e["reason"]), str(e["object"])) for e in admin.acl_log()]


def run_as(user: redis.Redis, admin: redis.Redis, command: str) -> str | None:
    """Run ``command`` as ``user`` with the fewest arguments it takes (its arity, from ``COMMAND
    INFO``), each ``delayq:wake`` (a key under the prefix, and the wake channel): the refusal's
    text when the ACL refuses it, else None. An error of the arguments (a wrong type, not a
    number) is no refusal: the server checks the ACL after the arity, before the command runs."""
    arity = int(admin.execute_command("COMMAND", "INFO", command)[command]["arity"])
    try:
        user.execute_command(command, *["delayq:wake"] * (abs(arity) - 1))
    except redis.exceptions.NoPermissionError as exc:
        return str(exc)
    except redis.ResponseError:
        pass
    return None


def used_commands(admin: redis.Redis) -> set[str]:
    """Commands with calls since ``CONFIG RESETSTAT`` (calls made by scripts included), less the
    handshake's ``HELLO``/``AUTH`` (which any user may send) and the reset itself."""
    stats = admin.info("commandstats")
    used = {name[len("cmdstat_") :] for name, s in stats.items() if int(s.get("calls", 0))}
    return used - {"hello", "auth", "config|resetstat"}


@pytest.fixture(scope="module")
def acl_server(server_binary: tuple[str, str]) -> Iterator[EmbeddedRedis]:
    """A server whose default user is off: an admin user does the setting up. One of each
    supported kind in turn (Redis 6.2, Valkey, the machine's redis-server)."""
    with EmbeddedRedis(binary=server_binary[1]) as server:
        setup = redis.Redis(host="127.0.0.1", port=server.port)
        setup.execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
        setup.execute_command("ACL", "SETUSER", "default", "off")
        setup.close()
        yield server


@pytest.fixture
def admin(acl_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """The admin client of the ACL server: empty, with the documented user, a fresh ACL LOG and
    fresh command statistics."""
    client = redis.Redis(
        host="127.0.0.1", port=acl_server.port, username=ADMIN[0], password=ADMIN[1], decode_responses=True
    )
    client.flushall()
    client.script_flush()
    set_user(client, server_rule(client))
    client.execute_command("ACL", "LOG", "RESET")
    client.config_resetstat()
    yield client
    client.flushall()
    client.close()


def acl_url(server: EmbeddedRedis, user: str = "delayq", password: str = STORE_PASSWORD, db: int = 0) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/{db}"


def published(client: redis.Redis, queue: str = "celery") -> list[str]:
    return [m["headers"]["id"] for m in broker_lists(client).get(queue, [])]


def delivered(dispatcher: Dispatcher, broker: redis.Redis, job_id: str) -> bool:
    """Pass until ``job_id`` is published (a woken beat may pass a few ms before the server's
    clock reaches the due time; a real beat then simply passes again)."""
    return bool(wait_for(lambda: dispatcher.run_once() is None or job_id in published(broker), timeout=3))


# -- ACL -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_documented_acl_user_runs_everything_the_store_does(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """Producers, DelayQ, Schedules and a beat's passes under the documented rule, with the
    broker on another server: all work, nothing but CONFIG GET is refused, and every command
    of the rule is used (database 1 needs SELECT, an idle connection's health check PING)."""
    store_url = acl_url(acl_server, db=1) + "?health_check_interval=1"
    app = app_factory(redis_url, delayq_url=store_url)
    producer = app_factory(redis_url, delayq_url=store_url)

    @producer.task(base=DelayedTask, name="other.task", shared=False)
    def other(x: int) -> int:
        return x

    add = app.tasks["t.add"]
    dq = DelayQ(app)

    assert get_store(app).check_server() == []  # INFO allowed; CONFIG GET refused: skipped
    now = time.time()
    due = add.apply_at(now - 5, (1, 2))
    many = add.apply_at_many([(now - 5, (i, i), None) for i in range(40)])
    later = add.apply_in(HOUR, (3, 4), task_id="later")
    kept = add.apply_in(2 * HOUR, (0, 0), task_id="later")
    job = dq.get("later")
    assert not kept.created and job is not None and (job.args, job.state) == ([3, 4], "waiting")
    moved = add.apply_in(HOUR, (5, 6))
    assert dq.reschedule(moved.id, now + 2 * HOUR)
    gone = add.apply_in(HOUR, (7, 8))
    assert dq.cancel(gone.id) and dq.get(gone.id) is None
    unknown = producer.tasks["other.task"].apply_at(now - 5, (1,))  # the beat's app lacks it

    schedules = Schedules(app)
    schedules.upsert("tick", add, timedelta(seconds=1), args=(1, 1))
    schedules.add("nightly", add, "0 3 * * *", args=(2, 2))
    assert not schedules.pause("nightly").enabled and schedules.resume("nightly").enabled
    assert schedules.update("nightly", args=(3, 3)).args == [3, 3]
    run_now = schedules.run_now("nightly")
    config = {"cfg": {"task": "t.add", "schedule": 3600.0, "args": (4, 4)}}
    assert sync_config(schedules, config)["added"] == ["cfg"]
    assert sorted(s.name for s in schedules.list()) == ["cfg", "nightly", "tick"]
    assert sync_config(schedules, {})["removed"] == ["cfg"]
    assert schedules.delete("nightly") and schedules.count() == 1
    # due, 40 more, later, moved, the unknown task's job, tick's next point, the run-now job
    assert dq.count() == 46
    assert {j.id for j in dq.pending(end=now)} == {due.id, unknown.id, *(res.id for res in many)}

    dispatcher = dispatchers(app)
    dispatcher.run_once()
    points = {i for i in published(r) if i.startswith("{tick}@")}  # if a second has passed
    assert set(published(r)) - points == {due.id, run_now.id, *(res.id for res in many)}
    [(dead_id, record)] = list(dq.dead())
    assert dead_id == unknown.id and "not registered" in record["reason"]

    def ticked() -> bool:
        dispatcher.run_once()
        tick = schedules.get("tick")
        return tick is not None and tick.run_count >= 1

    assert wait_for(ticked, timeout=5)  # a schedule point fired (fire.lua) under the rule
    assert schedules.delete("tick")

    soon = add.apply_in(0.3, (9, 9))
    wakeups = dispatcher.stats.wakeups
    dispatcher.wait(5)  # woken through the wake channel, then sleeps until the job is due
    assert dispatcher.stats.wakeups > wakeups
    assert delivered(dispatcher, r, soon.id)
    dispatcher.wake.last_full -= dispatcher.config.max_sleep  # the safety poll: TIME and MGET
    dispatcher.run_once()
    time.sleep(1.1)  # idle past health_check_interval: the next command is preceded by PING
    assert {j.id for j in dq.pending()} == {later.id, moved.id}

    # Operations: the lateness flush (HINCRBY/HINCRBYFLOAT), the heartbeat (HSET, HGETALL to
    # prune, HDEL at stop), and the metrics' read of the store (ZCARD, ZCOUNT, HLEN, HGETALL).
    dispatcher.chores(force=True)
    db1 = redis.Redis(
        host="127.0.0.1",
        port=acl_server.port,
        db=1,
        username=ADMIN[0],
        password=ADMIN[1],
        decode_responses=True,
    )
    try:
        assert int(db1.hget("delayq:lateness:publish", "count") or 0) == dispatcher.stats.published
        assert db1.hexists("delayq:beats", dispatcher.token)
        state = DispatcherCollector(dispatcher, read_every=0).store_state()
        assert state is not None and state["pending"] == 2
        dispatcher.stop()
        assert db1.hlen("delayq:beats") == 0  # (commands the rule has: the statistics count them)
    finally:
        db1.close()

    # Every command of the rule was used (but those of the less-used paths: LESS_USED), and no
    # other (Redis 6.2 names no subcommands here).
    rule = top_level(rule_commands(server_rule(admin)))
    assert top_level(used_commands(admin)) - {"config"} == rule - LESS_USED
    # Refused: CONFIG GET only (check_server skips it); redis-py's CLIENT SETINFO is allowed.
    assert top_level({obj for _, obj in denied(admin)}) == {"config"}


def test_a_user_of_the_older_rule_without_mget_and_exists_still_delivers(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rule of an older version has no +mget (the safety poll's markers) and no +exists
    (the stall sweep's look): the safety poll claims every shard instead, with one warning,
    and the sweep does its lap."""
    set_user(admin, [*server_rule(admin), "-mget", "-exists"])
    app = app_factory(redis_url, delayq_url=acl_url(acl_server, db=1))
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))  # its wake message is not read
    with caplog.at_level(logging.WARNING, logger="celery_delayq.beat.wake"):
        for _ in range(2):
            dispatcher.wake.last_full -= dispatcher.config.max_sleep  # a safety poll now
            dispatcher.run_once()
    assert published(r) == [res.id]
    lines = [rec.getMessage() for rec in caplog.records]
    warned = [line for line in lines if "wake markers could not be read" in line]
    assert len(warned) == 1 and "+mget" in warned[0], warned
    assert not [line for line in lines if "sweep for stalled schedules failed" in line]
    assert dispatcher.sweep_stalls() == 0
    assert top_level({obj for _, obj in denied(admin)}) == {"mget", "exists"}


def test_the_dashboards_kept_chart_counts_under_the_documented_rule(
    admin: redis.Redis, acl_server: EmbeddedRedis, redis_url: str, app_factory: AppFactory
) -> None:
    """The overview's chart counts are kept (SET PX), read (GET) and forgotten (PEXPIRE 0)
    within the rule: nothing is refused."""
    store = get_store(app_factory(redis_url, delayq_url=acl_url(acl_server, db=1)))
    store.keep_counts("hour", {"counts": [1, 2]}, 60_000)
    assert store.kept_counts(["hour", "day"]) == [{"counts": [1, 2]}, None]
    store.forget_counts(["hour", "day"])
    assert store.kept_counts(["hour"]) == [None]
    assert denied(admin) == []


def test_every_command_the_scripts_call_is_allowed_by_the_documented_rule(
    admin: redis.Redis, acl_server: EmbeddedRedis
) -> None:
    """Every command named in the Lua scripts (``redis.call('X'``, ``redis.pcall('X'``,
    ``call_sliced('X'``: lua/ and lua/includes/) is in the documented rule, or, for the push
    path's ``LPUSH`` into the broker's lists, in what the docs add for it; and the server takes
    each one from the user so made (an ACL applies inside scripts too: a command refused there
    fails the script, e.g. the start check's INCR when it drops a stale copy)."""
    rule = server_rule(admin)
    push = push_path_words()
    called = script_commands()
    allowed = rule_commands(rule) | rule_commands(push)
    missing = {c: sorted(set(files)) for c, files in called.items() if c not in allowed}
    assert missing == {}, f"called by the scripts, not in docs/security.md's rule: {missing}"
    user = make_client(acl_url(acl_server))
    set_user(admin, [*rule, *push])
    try:
        for command in sorted(called):
            refused = run_as(user, admin, command)
            assert refused is None, f"{command} ({', '.join(sorted(set(called[command])))}): {refused}"
    finally:
        user.close()
    assert denied(admin) == []


def test_the_start_check_drops_a_stale_copy_under_the_documented_rule(
    admin: redis.Redis, acl_server: EmbeddedRedis, redis_url: str, app_factory: AppFactory
) -> None:
    """The worker's start check (lua/start.lua) as the documented user: the first claim of a
    job instance starts, and so does that claim again; a copy of another claim is dropped and
    counted (``INCR`` of the shard's ``starts:dropped``), nothing is refused. Refused, the drop
    failed the script: the check counted as not answered, and the stale copy ran."""
    app = app_factory(redis_url, delayq_url=acl_url(acl_server, db=1))
    check = StartCheck(SimpleNamespace(app=app))
    check.store = get_store(app)
    headers = {"id": "j1", "task": "t.add"}
    assert check.may_start(app, headers, "1|beat-a|1000|7|j1", START_TTL_MS)
    assert check.may_start(app, headers, "1|beat-a|1000|7|j1", START_TTL_MS)  # a redelivery
    assert not check.may_start(app, headers, "1|beat-b|1000|7|j1", START_TTL_MS)  # stale: dropped
    assert not check.failing
    assert check.store.overview(0).dropped == 1
    assert denied(admin) == []


#: The rule's commands that only less-used paths send (debounce, throttle, uniqueness, a record of
#: the wrong type replaced, a stale copy dropped at start, an id search, a listing's next page,
#: delayq_wait_replicas): test_the_less_used_paths_run_under_the_documented_rule uses them, the
#: rule's other commands test_the_documented_acl_user_runs_everything_the_store_does.
LESS_USED = {"type", "del", "zrangebyscore", "zremrangebyscore", "incr", "zscan", "zrank", "wait"}


@pytest.mark.slow
def test_the_less_used_paths_run_under_the_documented_rule(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    redis_url: str,
    app_factory: AppFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Debounce and throttle (lua/keyed.lua), a uniqueness window over a record of the wrong type
    (lua/enqueue.lua replaces it), a stale copy dropped at start (lua/start.lua), an id search
    (``ZSCAN``), a listing's next page (``ZRANK``) and ``delayq_wait_replicas`` (``WAIT``, with
    no replica: it waits its second) as the documented user: nothing is refused, and each of
    these commands of the rule is used."""
    url = acl_url(acl_server, db=1)
    app = app_factory(redis_url, delayq_url=url)
    add = app.tasks["t.add"]
    store = get_store(app)
    assert add.apply_async((1,), debounce=("user:1", 60)).outcome == "new"
    assert add.apply_async((2,), debounce=("user:1", 60)).outcome == "debounced"
    assert add.apply_async((3,), throttle=("user:1", 60)).outcome == "new"
    assert add.apply_async((4,), throttle=("user:1", 60)).outcome == "throttled"
    unique = store.keys.shard(store.keys.shard_of("invoice-1")).unique
    db1 = redis.Redis(host="127.0.0.1", port=acl_server.port, db=1, username=ADMIN[0], password=ADMIN[1])
    try:
        db1.set(unique, "not a sorted set")
        assert add.apply_in(HOUR, (5,), task_id="invoice-1", unique_for=60).outcome == "new"
        assert db1.type(unique) == b"zset"
    finally:
        db1.close()
    assert store.start("invoice-1", 1000, 7, "1|beat-a", START_TTL_MS)
    assert not store.start("invoice-1", 1000, 7, "1|beat-b", START_TTL_MS)
    assert [j["id"] for j in id_search(store, "celery", "invoice")["jobs"]] == ["invoice-1"]
    first = jobs_page(store, "celery", limit=1)
    assert first["next_cursor"] is not None
    assert jobs_page(store, "celery", limit=1, cursor=first["next_cursor"])["count"] == 1
    replicated = app_factory(redis_url, delayq_url=url, delayq_wait_replicas=1)
    with caplog.at_level(logging.WARNING, logger="celery_delayq"):
        replicated.tasks["t.add"].apply_in(HOUR, (6,))
    assert "reached 0 of the 1 replica(s) asked" in caplog.text  # none here; WAIT was allowed
    assert denied(admin) == []
    assert top_level(used_commands(admin)) >= LESS_USED


def cluster_words() -> list[str]:
    """What docs/security.md says to add to the rule on a Redis Cluster."""
    found = re.search(r"On a Redis Cluster \(`delayq_cluster`\), add `([^`]*)`", SECURITY.read_text())
    assert found, "docs/security.md does not say what a cluster adds to the rule"
    return found.group(1).split()


@pytest.mark.cluster
@pytest.mark.slow
def test_the_documented_rule_with_its_cluster_words_runs_a_beat_on_a_cluster(
    redis_cluster: LocalCluster,
    cluster_url: str,
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """The rule alone cannot connect to a cluster (redis-py reads CLUSTER SLOTS and COMMAND);
    with the two words docs/security.md adds for a cluster, producers, a beat's passes and the
    slot map's refresh after a failover all work, and nothing but CONFIG is refused."""
    nodes = [
        redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True) for node in redis_cluster.nodes
    ]
    store_url = f"redis://delayq:{STORE_PASSWORD}@127.0.0.1:{redis_cluster.nodes[0].port}/0"
    try:
        for node in nodes:
            set_user(node, server_rule(node))
        with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected"):
            make_client(store_url, cluster=True)
        for node in nodes:
            node.execute_command("ACL", "SETUSER", "delayq", *cluster_words())
            node.execute_command("ACL", "LOG", "RESET")
        app = app_factory(redis_url, delayq_url=store_url, delayq_cluster=True)
        add = app.tasks["t.add"]
        due = add.apply_at(time.time() - 5, (1, 2))
        later = add.apply_in(HOUR, (3, 4))
        assert DelayQ(app).cancel(add.apply_in(HOUR, (5, 6)).id)
        assert delivered(dispatchers(app), r, due.id)
        get_store(app).refresh_slots()  # what a beat does after a failover
        assert [j.id for j in DelayQ(app).pending()] == [later.id]
        refused = {str(e["object"]).split("|")[0] for node in nodes for e in node.acl_log()}
        assert refused <= {"config"}
    finally:
        for node in nodes:
            node.execute_command("ACL", "DELUSER", "delayq")
            node.close()


def test_the_summary_counts_the_commands_of_the_rule() -> None:
    """docs/security.md's summary says how many commands the rule allows (CLIENT SETINFO aside)."""
    found = re.search(r"the (\d+) commands it uses and redis-py's `CLIENT SETINFO`", SECURITY.read_text())
    assert found, "docs/security.md's summary does not count the rule's commands"
    assert int(found.group(1)) == len(rule_commands(documented_rule()) - {"client|setinfo"})


def test_the_documented_rule_as_written_on_each_server(admin: redis.Redis) -> None:
    """The docs' line is taken as it is by Redis 6.2, 7.2+ and Valkey; Redis 7.0 refuses it
    with the error the docs name, and takes it as the docs change it for 7.0."""
    kind = server_kind(admin)
    rule = documented_rule("as-written")
    if kind == "Redis 7.0":
        with pytest.raises(redis.ResponseError, match="Unknown command or category name in ACL"):
            set_user(admin, rule)
    else:
        set_user(admin, rule)
    set_user(admin, documented_rule("as-written", server=kind))
    assert admin.execute_command("ACL", "DELUSER", "as-written") == 1


def test_the_acl_user_is_refused_outside_its_prefix(admin: redis.Redis, acl_server: EmbeddedRedis) -> None:
    admin.set("other", "untouched")
    admin.lpush("celery", "queued")
    user = make_client(acl_url(acl_server))
    refusals: list[Callable[[], Any]] = [
        lambda: user.get("other"),
        lambda: user.set("other", "x"),
        lambda: user.delete("other"),
        lambda: user.lpush("celery", "x"),
        lambda: user.keys("*"),
        lambda: user.scan(0),
        lambda: user.flushall(),
        lambda: user.config_get("maxmemory-policy"),
        lambda: user.config_set("maxmemory-policy", "allkeys-lru"),
        lambda: user.eval("return 1", 0),
        lambda: user.publish("other:wake", "1"),
        lambda: user.execute_command("ACL", "WHOAMI"),
        lambda: user.hset("delayqx:jobs", "a", "b"),  # the prefix is "delayq:", colon included
    ]
    for refused in refusals:
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    # A script runs with its caller's permissions: loading one does not widen them.
    sha = user.script_load("return redis.call('GET', KEYS[1])")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.evalsha(sha, 1, "other")
    sha = user.script_load("return redis.call('GET', 'other')")
    with pytest.raises(redis.exceptions.ResponseError, match=r"(?i)perm|acl|access"):
        user.evalsha(sha, 0)
    pubsub = user.pubsub()
    with pytest.raises(redis.exceptions.NoPermissionError):
        pubsub.subscribe("other:wake")
        pubsub.get_message(timeout=1)
    pubsub.close()
    # Inside the prefix all is well.
    user.set("delayq:mine", "1")
    assert user.get("delayq:mine") == "1"
    assert (admin.get("other"), admin.lrange("celery", 0, -1)) == ("untouched", ["queued"])
    user.close()


def test_check_server_degrades_when_info_and_config_are_refused(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        as_admin = app_factory(
            redis_url, delayq_url=f"redis://{ADMIN[0]}:{ADMIN[1]}@127.0.0.1:{acl_server.port}/0"
        )
        assert any("maxmemory-policy" in w for w in get_store(as_admin).check_server())
        # The documented user: CONFIG GET refused, so the policy check is skipped silently.
        assert get_store(app_factory(redis_url, delayq_url=acl_url(acl_server))).check_server() == []
        # A user without INFO either: a warning instead of the version check, and all else works.
        set_user(admin, [w for w in server_rule(admin, "no-info") if w != "+info"])
        app = app_factory(redis_url, delayq_url=acl_url(acl_server, "no-info"))
        [warning] = get_store(app).check_server()
        assert warning.startswith("cannot read INFO") and "version was not checked" in warning
        job = app.tasks["t.add"].apply_at(time.time() - 1, (1, 1))
        dispatchers(app).run_once()
        assert published(r) == [job.id]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")


def test_a_broker_with_another_user_on_the_stores_server_goes_through_kombu(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """The broker (admin user) is the store's server and database, but the store connects as the
    limited user: the beat does not take the push path (it needs the same user), so kombu
    publishes with the broker's user and nothing is refused."""
    broker = f"redis://{ADMIN[0]}:{ADMIN[1]}@127.0.0.1:{acl_server.port}/0"
    app = app_factory(broker, delayq_url=acl_url(acl_server))
    add = app.tasks["t.add"]
    jobs = [add.apply_at(time.time() - 1, (i, i)) for i in range(3)]
    jobs.append(add.apply_at(time.time() - 1, (3, 3), priority=3))  # list "celery\x06\x163"
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.pushing is False
    assert sorted(published(admin) + published(admin, "celery\x06\x163")) == sorted(job.id for job in jobs)
    assert DelayQ(app).count() == 0 and dispatcher.stats.publish_errors == 0
    assert denied(admin) == []


def test_one_user_for_store_and_broker_takes_the_atomic_path(
    admin: redis.Redis,
    acl_server: EmbeddedRedis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """Store and broker as the same user, allowed the store's rule plus what publishing needs
    (kombu's queue declaration, LPUSH on the queue lists): the push path pushes with it."""
    extra = ["+lpush", "+sadd", "+llen", "+multi", "+exec", "~celery*", "~_kombu.*"]
    admin.execute_command("ACL", "SETUSER", "delayq", *extra)
    url = acl_url(acl_server)
    app = app_factory(url, delayq_url=url)
    add = app.tasks["t.add"]
    jobs = [add.apply_at(time.time() - 1, (i, i)) for i in range(3)]
    jobs.append(add.apply_at(time.time() - 1, (3, 3), priority=3))
    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.pushing is True
    assert sorted(published(admin) + published(admin, "celery\x06\x163")) == sorted(job.id for job in jobs)
    assert DelayQ(app).count() == 0 and dispatcher.stats.publish_errors == 0
    assert denied(admin) == []


# -- TLS -------------------------------------------------------------------------------------------


class TLSRedis(EmbeddedRedis):
    """An EmbeddedRedis that listens on TLS only (``port`` is the TLS port)."""

    ca_file: str = ""

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}"

    def ping(self) -> bool:
        context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
            ):
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def _no_tls_support(binary: str | None) -> str | None:
    """What ``binary`` says when asked for a TLS port, when that says it has no TLS (a build
    without TLS refuses the directive, or has no TLS connection type); None otherwise."""
    if binary is None:
        return None
    args = ["--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent", "--logfile", ""]
    probe = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=False)
    for line in (probe.stdout + probe.stderr).splitlines():
        if "Bad directive" in line or "TLS support" in line:
            return line.strip()
    return None


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    """redis-server on TLS only, with a server certificate for 127.0.0.1 from a fresh CA."""
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert_file, key_file = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    port = free_port()
    server = TLSRedis(
        port=port,
        extra_args=[
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", str(cert_file),
            "--tls-key-file", str(key_file),
            "--tls-ca-cert-file", str(ca_file),
            "--tls-auth-clients", "no",
        ],
    )  # fmt: skip
    server.ca_file = str(ca_file)
    try:
        server.start()
    except RuntimeError:
        reason = _no_tls_support(server.binary)
        if reason:
            pytest.skip(f"{server.binary} has no TLS support: {reason}")
        raise
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_tls_store_url(
    tls_server: TLSRedis,
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """rediss:// with ssl_ca_certs: producers, DelayQ, Schedules, the beat's scripts and its
    wake subscription all go over TLS (the broker is plain Redis on another server)."""
    url = f"{tls_server.url}/0?ssl_ca_certs={tls_server.ca_file}"
    app = app_factory(redis_url, delayq_url=url)
    store = get_store(app)
    assert store.client.connection_pool.connection_class is redis.SSLConnection
    assert store.check_server() == []
    add = app.tasks["t.add"]
    dq = DelayQ(app)
    due = add.apply_at(time.time() - 1, (1, 1))
    many = add.apply_at_many([(time.time() - 1, (i, i), None) for i in range(20)])
    later = add.apply_in(HOUR, (2, 2))
    gone = add.apply_in(HOUR, (3, 3))
    assert dq.cancel(gone.id) and dq.count() == 22
    schedules = Schedules(app)
    schedules.upsert("hourly", add, "0 * * * *", args=(4, 4))
    assert [s.name for s in schedules.list()] == ["hourly"]

    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert set(published(r)) == {due.id, *(res.id for res in many)}
    soon = add.apply_in(0.3, (5, 5))
    dispatcher.wait(5)
    assert dispatcher.stats.wakeups >= 1
    assert delivered(dispatcher, r, soon.id)
    assert schedules.delete("hourly")
    assert [j.id for j in dq.pending()] == [later.id]

    # The server's certificate is verified: without the CA, no connection.
    unverified = make_client(f"{tls_server.url}/0")
    with pytest.raises(redis.exceptions.ConnectionError, match=r"(?i)certificate"):
        unverified.ping()
    unverified.close()


# -- no unpickling -----------------------------------------------------------------------------------


class Armed:
    """Unpickling this touches ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def store_raw(app: Celery, job_id: str, due_ms: int, envelope: str | bytes) -> None:
    """Write a job straight into its shard's keys (no script, no validation)."""
    store = get_store(app)
    keys = store.keys.for_job(job_id)
    store.client.zadd(keys.due, {job_id: due_ms})
    store.client.hset(keys.jobs, job_id, envelope)


@pytest.mark.parametrize("push", [True, False], ids=["push", "kombu"])
def test_the_beat_never_unpickles(
    push: bool,
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """A pickle body is published as it is (never loaded), and pickle bytes in place of the
    envelope are dead-lettered as corrupt; the marker file a load would create never appears."""
    pickle.loads(pickle.dumps(Armed(tmp_path / "armed")))
    assert (tmp_path / "armed").exists()  # the payload works when loaded
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Armed(marker))
    app = app_factory(redis_url, delayq_url=redis_url, accept_content=["json"], delayq_push=push)
    past = server_ms(r) - 1000
    envelope = {
        "v": 2,
        "i": "pickle-body",
        "t": "t.add",
        "z": base64.b64encode(payload).decode("ascii"),
        "ct": "application/x-python-serialize",
        "ce": "binary",
        "c": past,
    }
    store_raw(app, "pickle-body", past, json.dumps(envelope, separators=(",", ":")))
    ascii_pickle = pickle.dumps(Armed(marker), protocol=0)
    binary_pickle = pickle.dumps(Armed(marker), protocol=5)  # not UTF-8 either
    store_raw(app, "pickle-envelope-0", past, ascii_pickle)
    store_raw(app, "pickle-envelope-5", past, binary_pickle)

    dispatcher = dispatchers(app)
    dispatcher.run_once()
    assert dispatcher.pushing is push

    assert not marker.exists()
    [message] = broker_lists(r)["celery"]
    assert message["headers"]["id"] == "pickle-body"
    assert message["content-type"] == "application/x-python-serialize"
    body = body_of(message)
    assert body == payload  # the stored bytes, as they were
    with pytest.raises(ContentDisallowed):  # what a worker with accept_content=["json"] does
        kombu_loads(body, message["content-type"], message["content-encoding"], accept=["json"])
    dead = dict(DelayQ(app).dead())
    assert sorted(dead) == ["pickle-envelope-0", "pickle-envelope-5"]
    assert all(record["reason"].startswith("corrupt envelope") for record in dead.values())
    # kept as they were: the client decodes with surrogateescape, which encodes back exactly
    assert dead["pickle-envelope-0"]["envelope"].encode() == ascii_pickle
    assert dead["pickle-envelope-5"]["envelope"].encode("utf-8", "surrogateescape") == binary_pickle
    job = DelayQ(app).get("pickle-envelope-5")
    assert job is not None and job.state == "dead"
    assert DelayQ(app).count() == 0
    assert not marker.exists()


# -- prefixes --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_prefixes_on_one_database_never_meet(
    redis_url: str,
    r: redis.Redis,
    app_factory: AppFactory,
    dispatchers: Callable[[Celery], Dispatcher],
) -> None:
    """Prefixes "alpha" and "alpha:beta" (one a prefix of the other) on one server and broker."""
    one = app_factory(redis_url, delayq_url=redis_url, delayq_prefix="alpha")
    two = app_factory(redis_url, delayq_url=redis_url, delayq_prefix="alpha:beta")
    now = time.time()
    jobs: dict[Celery, dict[str, str]] = {}
    for app in (one, two):
        add = app.tasks["t.add"]
        jobs[app] = {
            "due": add.apply_at(now - 5, (1, 1)).id,
            "later": add.apply_in(HOUR, (2, 2)).id,
            "same": add.apply_in(HOUR, (3, 3), task_id="same-id").id,
        }
        Schedules(app).upsert("digest", add, "0 18 * * *", args=(app.conf.delayq_prefix,))
    keys = set(r.keys("*"))
    assert keys and all(k.startswith(("alpha:{alpha:", "alpha:beta:")) for k in keys)

    for app, other in ((one, two), (two, one)):
        dq = DelayQ(app)
        assert dq.count() == 4  # its three jobs and its schedule's next point
        ids = {j.id for j in dq.pending()}
        assert {jobs[app]["due"], jobs[app]["later"], "same-id"} <= ids
        assert not ids & {jobs[other]["due"], jobs[other]["later"]}
        assert dq.get(jobs[other]["later"]) is None and not dq.cancel(jobs[other]["later"])
        [digest] = Schedules(app).list()
        assert digest.args == [app.conf.delayq_prefix]

    assert DelayQ(one).cancel("same-id")
    assert DelayQ(one).get("same-id") is None and DelayQ(two).get("same-id") is not None
    assert Schedules(one).delete("digest") and Schedules(two).get("digest") is not None

    first, second = dispatchers(one), dispatchers(two)
    first.run_once()
    assert published(r) == [jobs[one]["due"]]
    second.run_once()
    assert published(r) == [jobs[one]["due"], jobs[two]["due"]]
    wakeups = first.stats.wakeups, second.stats.wakeups
    soon = two.tasks["t.add"].apply_in(0.3, (4, 4))  # wakes the beats of "alpha:beta" only
    second.wait(3)
    first.wait(0.2)
    assert (first.stats.wakeups, second.stats.wakeups) == (wakeups[0], wakeups[1] + 1)
    first.run_once()
    assert delivered(second, r, soon.id)
    assert published(r) == [jobs[one]["due"], jobs[two]["due"], soon.id]
    assert (DelayQ(one).count(), DelayQ(two).count()) == (1, 3)
