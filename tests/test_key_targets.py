"""``pause``, ``resume`` and ``limit`` check the name they are given (issue 52): a schedule's
name (and no key's) is refused, pointing to ``schedules pause``; a key never seen (no entry in
``gate:keys``, no job of it stored) is refused unless ``--new`` / ``new=True``; the same in the
CLI, ``DelayQ`` and the dashboard. Each refusal leaves the store as it was."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from datetime import timedelta

import pytest
import redis
from celery import Celery

from celery_delayq.admin.jobs import DelayQ
from celery_delayq.exceptions import UnknownKey
from celery_delayq.schedules.api import Schedules
from celery_delayq.store.facade import get_store
from tests.support.cli import as_json, invoke
from tests.support.store import gate_due, snapshot
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

Dashboard = Callable[..., Client]


def every_key(url: str) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key with its type and DUMP but the chart counts a dashboard page keeps a while."""
    return {key: value for key, value in snapshot(url).items() if b":web:counts:" not in key}


def test_the_cli_refuses_a_schedules_name_and_points_to_schedules_pause(app: Celery, redis_url: str) -> None:
    Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    before = every_key(redis_url)
    for args in (["pause", "tick"], ["resume", "tick"], ["limit", "tick", "3"], ["limit", "tick", "--clear"]):
        result = invoke(app, *args)
        assert result.exit_code == 1, (args, result.output)
        [line] = result.stderr.strip().splitlines()
        command = "resume" if args[0] == "resume" else "pause"
        assert line == (
            f"Error: 'tick' is a schedule, not a gate key: use `celery delayq schedules {command} tick` "
            f"(or --new to {args[0]} a new gate key 'tick')"
        ), line
    assert every_key(redis_url) == before  # no key 'tick' listed as paused
    assert as_json(invoke(app, "keys", "--json"))["keys"] == []
    # --new: the operator means a key of that name
    assert invoke(app, "pause", "tick", "--new").stdout.strip() == "tick: paused"


def test_the_cli_refuses_a_key_never_seen_unless_new(app: Celery, r: redis.Redis, redis_url: str) -> None:
    before = every_key(redis_url)
    for args in (["pause", "tenant:4"], ["resume", "tenant:4"], ["limit", "tenant:4", "2"]):
        result = invoke(app, *args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.strip() == (
            "Error: no gate key 'tenant:4' has been seen (no job of it stored or gated, no limit or "
            f"pause set): check the name, or pass --new to {args[0]} it anyway"
        )
    assert every_key(redis_url) == before
    assert invoke(app, "limit", "tenant:4", "2", "--new").stdout.strip() == (
        "tenant:4: run-time limit 2; limit in force: 2"
    )
    # seen now (its gate:keys entry): no --new needed
    assert invoke(app, "pause", "tenant:4").stdout.strip() == "tenant:4: paused"
    # a bad limit is a usage error first, whatever the key
    assert invoke(app, "limit", "tenant:5", "0").exit_code == 2


def test_a_key_is_seen_by_a_stored_job_or_by_the_gate(app: Celery, r: redis.Redis) -> None:
    add = app.tasks["t.add"]
    store = get_store(app)
    assert not store.key_seen("tenant:1")
    add.apply_in(3600, (1, 2), concurrency_key="tenant:1", concurrency_limit=2)  # stored, not gated
    assert store.key_seen("tenant:1")
    assert not store.key_seen("tenant:") and not store.key_seen("tenant:*") and not store.key_seen("tenant")
    gate_due(app, r, "gated", 1, limit=1)  # gated (its job released: the key is in gate:keys)
    assert store.key_seen("gated")
    assert invoke(app, "pause", "tenant:1").stdout.strip() == "tenant:1: paused"
    # a name that is a key seen and a schedule's: the key is meant
    Schedules(app).add("gated", "t.noop", timedelta(minutes=5))
    assert invoke(app, "pause", "gated").stdout.strip() == "gated: paused"


def test_delayq_raises_unknown_key_and_new_true_allows_it(app: Celery, redis_url: str) -> None:
    Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    dq = DelayQ(app)
    before = every_key(redis_url)
    with pytest.raises(UnknownKey, match=r"'tick' is a schedule, not a gate key: use Schedules\(app\).pause"):
        dq.pause("tick")
    for call in (
        lambda: dq.pause("ghost"),
        lambda: dq.resume("ghost"),
        lambda: dq.set_limit("ghost", 3),
        lambda: dq.set_limit("ghost", None),
        lambda: dq.clear_limit("ghost"),
    ):
        with pytest.raises(UnknownKey, match="gate key 'ghost' has never been seen") as info:
            call()
        assert isinstance(info.value, LookupError) and info.value.key == "ghost"
    assert every_key(redis_url) == before
    assert dq.pause("ghost", new=True) == 0
    assert dq.key_state("ghost").paused
    assert dq.resume("ghost") == 0  # seen now


def test_the_dashboard_refuses_a_schedules_name_and_a_key_never_seen(
    app: Celery, redis_url: str, dashboard: Dashboard
) -> None:
    Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    client = dashboard(allow_actions=True)
    client.get("/")
    before = every_key(redis_url)
    api = client.api("/api/keys/action", {"action": "pause", "key": "tick"})
    [result] = api.json()["results"]
    assert api.status == 409 and result["outcome"] == "unknown-key"
    assert result["message"].startswith("'tick' is a schedule, not a gate key: pause it on its page")
    form = client.action("/keys/action", [("action", "limit"), ("key", "ghost"), ("limit", "3")])
    page = client.follow(form).text
    flashed = [html.unescape(li) for li in re.findall(r'<li class="error">(.*?)</li>', page, flags=re.S)]
    assert flashed == [
        "ghost: no gate key 'ghost' has been seen (no job of it stored or gated, no limit or pause "
        "set): check the name, or send new to limit it anyway"
    ]
    assert every_key(redis_url) == before
    done = client.api("/api/keys/action", {"action": "pause", "key": "ghost", "new": True})
    assert done.status == 200 and done.json()["results"][0]["paused"] is True
