"""Each example runs against a real Redis with a real worker and beat."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_quickstart_example(redis_url: str, procs: Procs) -> None:
    env = dict(os.environ, DELAYQ_EXAMPLE_URL=redis_url,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs.start("worker", env, app="examples.quickstart")
    procs.start("beat", env, app="examples.quickstart")
    proc = subprocess.run([sys.executable, "-m", "examples.quickstart"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    ran = [line for line in proc.stdout.splitlines() if line.startswith("ran:")]
    assert len(ran) == 3, out
    assert [line.split()[2] for line in ran] == ["ada:", "bob:", "dee:"], out
    assert "pending now: 3" in out


@pytest.mark.e2e
def test_schedules_example(redis_url: str, procs: Procs) -> None:
    env = dict(os.environ, DELAYQ_EXAMPLE_URL=redis_url,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs.start("worker", env, app="examples.schedules")
    procs.start("beat", env, app="examples.schedules")
    proc = subprocess.run([sys.executable, "-m", "examples.schedules"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
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
