"""examples/flow_control.py with a real worker (8 threads) and beat on a real Redis: the caps hold
and are reached, every render runs once, and the batch's callback runs once with its counts.
What the worker did is read from Redis here, not trusted from the script's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from celery_delayq import DelayQ
from examples import flow_control as ex
from tests.support.apps import make_app
from tests.support.processes import Procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_flow_control_example(redis_url: str, r: redis.Redis, procs: Procs) -> None:
    env = dict(os.environ, DELAYQ_EXAMPLE_URL=redis_url,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    procs.start("worker", env, app="examples.flow_control")  # -P threads -c 8
    procs.start("beat", env, app="examples.flow_control")
    proc = subprocess.run([sys.executable, "-m", "examples.flow_control"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    assert proc.stdout.splitlines()[-1] == "ok", out

    runs = [json.loads(raw) for raw in r.lrange(ex.RUNS, 0, -1)]
    done = [json.loads(raw) for raw in r.lrange(ex.DONE, 0, -1)]
    per_key = {key: [run for run in runs if run["tenant"] == key] for key in ex.LIMITS}
    assert sorted(run["report"] for run in per_key["tenant:42"]) == list(range(8))  # each once
    assert sorted(run["report"] for run in per_key["tenant:7"]) == list(range(4))
    assert sorted(run["report"] for run in per_key["acme"]) == list(range(11))  # not the failing one
    for key, limit in ex.LIMITS.items():
        # Never over the cap; and the cap is reached (8 worker threads, all jobs due at once).
        assert ex.most_at_once(per_key[key]) == limit, (key, per_key[key])
    [call] = done  # on_complete ran once, with (its args, batch id, counts), after the last member
    batch_id = call["batch_id"]
    assert call["tenant"] == "acme"
    assert call["counts"] == {"total": 12, "succeeded": 11, "failed": 1, "cancelled": 0}
    assert call["at"] >= max(run["end"] for run in per_key["acme"])
    assert f"month_done('acme', {batch_id!r}, " in out and "batch done: " in out

    app = make_app(redis_url)
    try:
        dq = DelayQ(app)
        assert dq.count() == 0  # every capped job released its slot and left the store
        assert all(state.running == 0 and state.waiting == 0 for state in dq.keys())  # noqa: SIM118
        result = dq.batch_result(batch_id)
        assert result is not None and result.progress()["succeeded"] == 11
    finally:
        app.close()
