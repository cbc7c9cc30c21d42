"""One ``apply_at`` is one round trip: the enqueue script's ``EVALSHA``, and no other command
from the client (no ``TIME``, ``EXISTS``, ``PING``, ``SCRIPT`` or pause read of its own), on a
real redis-server, counted in ``INFO commandstats`` (where the commands a script runs count
too: those are the enqueue script's own, one ``TIME``, ``HSETNX``, ``ZADD`` and wake-marker
``GET`` a call, a ``ZRANGE``, ``SET`` and ``PUBLISH`` when it lowers the marker)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_delayq import DelayedTask
from tests.support.apps import AppFactory

CALLS = 20
#: What the enqueue script runs itself (lua/enqueue.lua, lua/includes/wake.lua).
SCRIPT_COMMANDS = {"time", "hsetnx", "zadd", "get", "zrange", "set", "publish", "hexists", "hlen", "hset"}


@pytest.fixture
def shaped(app_factory: AppFactory) -> Any:
    """A task of the real job shape: an int id, a text, one keyword argument."""
    app = app_factory(task_ignore_result=True, task_queues=None)

    @app.task(base=DelayedTask, name="t.shaped", shared=False)
    def job(job_id: int, text: str, *, source: str = "") -> None:
        return None

    return app.tasks["t.shaped"]


def command_counts(r: redis.Redis) -> dict[str, int]:
    """Calls of every command the server ran, from ``INFO commandstats``."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in r.info("commandstats").items()
    }


def counted(r: redis.Redis, calls: Any) -> tuple[dict[str, int], int]:
    """The commands ``calls()`` made the server run (the two ``INFO`` read before it left out),
    and the connections it opened."""
    before, connections = command_counts(r), int(r.info("stats")["total_connections_received"])
    calls()
    after = command_counts(r)
    opened = int(r.info("stats")["total_connections_received"]) - connections
    delta = {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}
    delta["info"] -= 2  # the two that read ``before`` and ``connections``
    return {name: n for name, n in delta.items() if n}, opened


def test_apply_at_is_one_evalsha_and_nothing_else(shaped: Any, r: redis.Redis) -> None:
    """After a first call (connection opened, script loaded), each ``apply_at`` of a job of the
    real shape sends one ``EVALSHA`` on a connection already open: nothing else reaches the
    server from the client."""
    due = time.time() + 3600
    shaped.apply_at(due, (0, "the first job, which warms up"), {"source": "test"})

    def calls() -> None:
        for i in range(CALLS):
            shaped.apply_at(due + i, (i, f"job {i} of the real shape, text"), {"source": "test"})

    delta, opened = counted(r, calls)
    assert opened == 0
    assert delta.pop("evalsha") == CALLS
    assert set(delta) <= SCRIPT_COMMANDS, delta
    # one of each per script run, none other (hexists: the job's shape is in the shard's shapes hash)
    for command in ("time", "hexists", "hsetnx", "zadd", "get"):
        assert delta[command] == CALLS, delta
    assert sum(r.hlen(key) for key in r.scan_iter("*:jobs")) == CALLS + 1


def test_apply_at_with_options_is_one_evalsha(shaped: Any, r: redis.Redis) -> None:
    """Options (a queue, a task id, an expiry, headers) are checked and built in this process:
    still one ``EVALSHA`` a call."""
    due = time.time() + 3600
    shaped.apply_at(due, (0, "the first job, which warms up"), {"source": "test"}, queue="q2")

    def calls() -> None:
        for i in range(CALLS):
            shaped.apply_at(
                due,
                (i, "a job with options"),
                {"source": "test"},
                queue="q2",
                task_id=f"job-{i}",
                expires=60,
                headers={"who": "test"},
            )

    delta, opened = counted(r, calls)
    assert opened == 0
    assert delta.pop("evalsha") == CALLS
    assert set(delta) <= SCRIPT_COMMANDS, delta
    assert delta["time"] == CALLS
