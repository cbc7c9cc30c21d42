"""Streamed batches end to end (issue 28, part 5): a batch opened empty, filled over time from
two processes while its first members already run on real ``celery worker`` processes released
by real ``celery beat -S celery_delayq.Scheduler`` processes (``tests/apps/flow_app.py``), then
sealed: ``on_complete`` runs once, after the seal and after the last member ended, with the
counts of every member added. Tolerances are generous; no test asserts a speed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from celery_delayq.flow.batch import OpenBatch
from celery_delayq.flow.gate import member_id
from tests.support.flow import (
    FlowProducer,
    ended_ids,
    max_overlap,
    read_done,
    read_runs,
    start_flow_stack,
    warm_up_flow,
)
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import assert_alive, env_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent

#: Another process adds to the batch: ``python -c ADDER <url> <batch id> <first> <n>`` prints
#: the ids it added.
ADDER = """
import sys
from tests.support.flow import FlowProducer
url, bid, first, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
producer = FlowProducer(url, url)
batch = producer.dq.batch_result(bid)
print(" ".join(batch.add([producer.work.s(0.2, first + i) for i in range(n)])))
producer.close()
"""


def test_a_batch_filled_over_time_from_two_processes_completes_once_after_the_seal(
    redis_url: str, r: redis.Redis, procs: Procs
) -> None:
    producer = FlowProducer(redis_url, redis_url)
    try:
        start_flow_stack(procs, env_for(redis_url, redis_url, {}), workers=2, beats=2)
        warm_up_flow(producer, r, procs)
        batch = producer.dq.open_batch(on_complete=producer.done.s("streamed"), concurrency_limit=3)
        assert isinstance(batch, OpenBatch)
        first = batch.add([producer.work.s(0.2, i) for i in range(10)])
        # the first members run and all end; the batch is open, so nothing completes
        assert wait_for(lambda: set(first) <= ended_ids(r), 60, 0.1), procs.logs()
        time.sleep(1.5)
        assert read_done(r) == [] and not batch.state().done

        # another process adds 10 more, by the batch's id, while this one adds 10 too
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        other = subprocess.Popen(
            [sys.executable, "-c", ADDER, redis_url, batch.id, "100", "10"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        mine = batch.add([producer.work.s(0.2, 200 + i) for i in range(10)])
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 0
        theirs = out.split()
        members = set(first) | set(mine) | set(theirs)
        assert members == {member_id(batch.id, i) for i in range(30)}
        sealed_at = time.time()
        assert batch.seal() is True

        assert wait_for(lambda: read_done(r), 120, 0.1), f"{batch.state()}\n{procs.logs()}"
        time.sleep(1.5)  # a second completion would show up by now
        runs = [run for run in read_runs(r) if run.id in members]
        assert Counter(run.id for run in runs) == Counter(members), "a member ran twice, or not at all"
        done = read_done(r)
        counts = {"total": 30, "succeeded": 30, "failed": 0, "cancelled": 0}
        assert len(done) == 1 and done[0]["args"] == ["streamed", batch.id, counts], done
        last_end = max(run.end for run in runs if run.end is not None)
        assert done[0]["time"] >= max(last_end, sealed_at), (done[0]["time"], last_end, sealed_at)
        most, _ = max_overlap((run.start, run.end) for run in runs if run.end is not None)
        print(f"\nSTREAMED BATCH 30 members from 2 processes, limit 3: overlap max {most}, completed once")
        assert most <= 3
        state = batch.state()
        assert state.sealed and state.done and state.succeeded == 30
        assert_alive(procs)
    finally:
        producer.close()
