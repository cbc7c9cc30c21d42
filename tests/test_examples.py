"""Each example runs against a real Redis with a real worker and beat."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis

from celery_delayq import DelayQ, Schedules
from celery_delayq.config import DEFAULTS
from celery_delayq.due import due_iso
from tests.support.apps import make_app
from tests.support.processes import Procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_quickstart_example(redis_url: str, procs: Procs) -> None:
    env = dict(
        os.environ,
        DELAYQ_EXAMPLE_URL=redis_url,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs.start("worker", env, app="examples.quickstart")
    procs.start("beat", env, app="examples.quickstart")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.quickstart"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    ran = [line for line in proc.stdout.splitlines() if line.startswith("ran:")]
    assert len(ran) == 3, out
    assert [line.split()[2] for line in ran] == ["ada:", "bob:", "dee:"], out
    assert "pending now: 3" in out


@pytest.mark.e2e
def test_schedules_example(redis_url: str, procs: Procs) -> None:
    env = dict(
        os.environ,
        DELAYQ_EXAMPLE_URL=redis_url,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs.start("worker", env, app="examples.schedules")
    procs.start("beat", env, app="examples.schedules")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.schedules"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    ran = [line.split() for line in proc.stdout.splitlines() if line.startswith("ran:")]
    cron = [fields[2] for fields in ran if fields[1] == "cron"]
    interval = [fields[2] for fields in ran if fields[1] == "interval-1.5s"]
    assert len(cron) >= 3 and len(interval) >= 2, out
    assert all(i.startswith("{tick-tokyo}@") and i.endswith(".000Z") for i in cron), out
    assert all(i.startswith("{tick-interval}@") for i in interval), out
    assert len(set(cron + interval)) == len(ran), out
    assert "paused tick-interval: next_run=None" in out
    assert "deleted: [True, True], left: []" in out
    assert proc.stdout.splitlines()[-1] == "ok", out


def _example_env(redis_url: str) -> dict[str, str]:
    return dict(
        os.environ,
        DELAYQ_EXAMPLE_URL=redis_url,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def _log(r: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.lrange(key, 0, -1)]


@pytest.mark.e2e
def test_project_example(redis_url: str, r: redis.Redis, procs: Procs) -> None:
    """examples/project: one-off, recurring and bulk jobs of an app configured from celeryconfig.py."""
    env = _example_env(redis_url)
    procs.start("worker", env, app="examples.project")  # the package: celery finds its celery.py
    procs.start("beat", env, app="examples.project")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.project"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    assert proc.stdout.splitlines()[-1] == "ok", out
    assert "prefix 'project', 8 shards" in out
    assert "ran exactly once: 3,002 of 3,002 one-off and bulk jobs" in out

    # What the worker did, read from Redis here rather than trusted from the script.
    runs = {task_id: int(n) for task_id, n in r.hgetall("examples:project:runs").items()}
    log = _log(r, "examples:project:log")
    assert all(n == 1 for n in runs.values()), runs  # one-off, bulk and schedule points: once each
    trials = sorted(e["account"] for e in log if e["task"] == "expire_trial")
    assert trials == list(range(1000, 4000)), trials[:10]  # the bulk; not account 8 (cancelled)
    assert sorted(e["user"] for e in log if e["task"] == "send_reminder") == ["bob", "cy"]  # not ada
    assert all(e["due"] is not None for e in log)  # every run was published by the delayq beat
    assert not any(e["task"] == "daily_digest" for e in log)  # weekdays at 18:00 in Paris
    stats = [i for i in runs if i.startswith("{refresh-stats}@")]
    purges = [i for i in runs if i.startswith("{purge-expired-sessions}@")]
    assert len(stats) >= 2 and len(purges) >= 1, sorted(runs)[:10]

    # What stays stored, under the prefix and shard count of celeryconfig.py.
    assert r.keys("project:*") and not r.keys("delayq:*")
    match = re.search(r"id (reminder:ada:\d{4}-\d\d-\d\d), created=True", out)
    assert match, out
    app = make_app(redis_url, delayq_prefix="project", delayq_shards=8)
    try:
        ada = DelayQ(app).get(match.group(1))
        assert ada is not None and ada.state == "waiting"
        assert ada.due > datetime.now(UTC) and ada.due.astimezone(ZoneInfo("Asia/Tokyo")).hour == 9
        schedules = Schedules(app)
        digest = schedules.get("digest-paris")
        assert digest is not None and digest.tz == "Europe/Paris" and digest.next_run is not None
        assert schedules.get("refresh-stats") is None  # deleted at the end
        purge = schedules.get("purge-expired-sessions")  # beat_schedule, stored by the beat
        assert purge is not None and purge.origin == "config" and purge.run_count >= 1
    finally:
        app.close()


@pytest.mark.e2e
def test_django_settings_example(redis_url: str, r: redis.Redis, procs: Procs) -> None:
    """examples/django_settings: CELERY_DELAYQ_* settings read through namespace="CELERY", and
    apply_async(countdown=...) and self.retry(countdown=...) going through delayq."""
    env = _example_env(redis_url)
    procs.start("worker", env, app="examples.django_settings")
    procs.start("beat", env, app="examples.django_settings")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.django_settings"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    assert proc.stdout.splitlines()[-1] == "ok", out

    # The effective config printed is what settings.py gives.
    printed = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.startswith("  "))
    assert printed["url"] == repr(redis_url), out
    assert printed["prefix"] == "'mysite'"
    assert printed["shards"] == "4"
    assert printed["intercept_eta"] == "True"
    assert printed["reclaim_ttl"] == "60.0"
    assert printed["batch_size"] == "200"
    assert printed["max_sleep"] == repr(DEFAULTS["delayq_max_sleep"][0])  # not in settings.py
    assert re.search(r"countdown=2\) -> ScheduledResult, .* waiting \(shard [0-3] of 4\)", out), out
    assert "apply_async() -> AsyncResult, in delayq: no" in out

    runs = {task_id: int(n) for task_id, n in r.hgetall("examples:django:runs").items()}
    log = _log(r, "examples:django:log")
    welcome = {e["user"]: e for e in log if e["task"] == "send_welcome"}
    assert sorted(welcome) == [42, 43], log
    # countdown: via the beat; the message has no eta, the task reads its due time as request.eta
    assert welcome[42]["due"] is not None and welcome[42]["eta"] == due_iso(round(welcome[42]["due"] * 1000))
    assert welcome[43]["due"] is None and welcome[43]["eta"] is None  # no countdown: direct
    sync = [e for e in log if e["task"] == "sync_account"]
    assert [e["retries"] for e in sync] == [0, 1] and len({e["id"] for e in sync}) == 1, sync
    # the retry too: each run came through the beat and reads its due time as request.eta
    assert all(e["due"] is not None and e["eta"] == due_iso(round(e["due"] * 1000)) for e in sync)
    assert runs == {welcome[42]["id"]: 1, welcome[43]["id"]: 1, sync[0]["id"]: 2}
