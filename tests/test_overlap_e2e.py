"""Overlap policies of recurring schedules end to end (issue 28, part 4), with real ``celery
worker`` and ``celery beat -S celery_delayq.Scheduler`` processes of ``tests/apps/flow_app.py``
and a real redis-server (broker and store).

A schedule fires every second a ``flow.work`` run that lasts longer than that, so its points
come due while a run is in flight. ``flow.work`` records each run's start and end
(``tests/support/flow.py``); the tests compute from them what overlapped. Tolerances are generous
(a loaded 2-core machine); no test asserts a speed.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import redis

from celery_delayq import Schedules
from tests.support.flow import (
    FLOW_APP,
    FlowProducer,
    Run,
    max_overlap,
    read_runs,
    start_flow_stack,
    warm_up_flow,
)
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import assert_alive, env_for

pytestmark = pytest.mark.e2e

#: How long a run lasts, and how often the schedule fires (seconds).
RUN_S = 2.5
EVERY_S = 1
#: Slot lease of the worker-kill test (the default is 60 s).
SLOT_TTL = 3


@pytest.fixture
def stack(redis_url: str, r: redis.Redis, procs: Procs) -> Iterator[Callable[..., FlowProducer]]:
    """Starts one worker (``pool``) and one beat of ``flow_app`` with the given app settings,
    warms them up, returns the producer."""
    made: list[FlowProducer] = []

    def start(conf: dict[str, Any] | None = None, pool: str = "") -> FlowProducer:
        conf = conf or {}
        producer = FlowProducer(redis_url, redis_url, **conf)
        made.append(producer)
        start_flow_stack(procs, env_for(redis_url, redis_url, conf), workers=1, beats=1, pool=pool)
        warm_up_flow(producer, r, procs)
        return producer

    yield start
    for producer in made:
        producer.close()


def point_time(job_id: str) -> float:
    """The time (epoch s) of a schedule point, from its id ``{name}@<ISO time>Z``."""
    return datetime.fromisoformat(job_id.split("@", 1)[1].replace("Z", "+00:00")).timestamp()


def _logs(procs: Procs) -> list[str]:
    return [log.read_text(errors="replace") for _, log in procs.procs]


def run_for(
    producer: FlowProducer, r: redis.Redis, overlap: str, seconds: float, run_s: float = RUN_S
) -> list[Run]:
    """Schedule ``flow.work(run_s)`` every second with ``overlap``, let it fire for ``seconds``,
    pause it, wait for the runs in flight to end (or be revoked), and return the runs."""
    schedules = Schedules(producer.app)
    name = f"ov-{overlap}"
    schedules.add(name, "flow.work", EVERY_S, args=[run_s], overlap=overlap)
    time.sleep(seconds)
    schedules.pause(name)
    time.sleep(run_s + 2)
    runs = read_runs(r)
    assert runs, f"schedule {name!r} never ran"
    assert {run.key for run in runs} == ({None} if overlap == "allow" else {name}), runs
    return runs


def test_allow_runs_overlap(r: redis.Redis, procs: Procs, stack: Callable[..., FlowProducer]) -> None:
    """The default: a point runs while the previous run is in flight (the contrast to the rest)."""
    producer = stack()
    runs = run_for(producer, r, "allow", 6)
    most, _ = max_overlap((run.start, run.end or time.time()) for run in runs)
    print(f"\nOVERLAP allow: {len(runs)} runs of {RUN_S} s in 6 s every {EVERY_S} s, {most} at once at most")
    assert most >= 2, runs
    assert_alive(procs)


def test_skip_never_overlaps_and_skips_points(
    r: redis.Redis, procs: Procs, stack: Callable[..., FlowProducer]
) -> None:
    """``skip``: no two runs at once; the points that came due meanwhile did not run (fewer runs
    than points), and the schedule went on (more than one run)."""
    producer = stack()
    runs = run_for(producer, r, "skip", 9)
    most, when = max_overlap((run.start, run.end or time.time()) for run in runs)
    print(f"\nOVERLAP skip: {len(runs)} runs of {RUN_S} s in 9 s every {EVERY_S} s, {most} at once at most")
    assert all(run.end is not None for run in runs), runs
    assert most == 1, f"{most} runs at once at {when}: {runs}"
    assert 2 <= len(runs) <= 5, runs
    schedule = Schedules(producer.app).get("ov-skip")
    assert schedule.overlap == "skip" and schedule.run_count == len(runs), schedule
    assert_alive(procs)


def test_buffer_one_runs_back_to_back(
    r: redis.Redis, procs: Procs, stack: Callable[..., FlowProducer]
) -> None:
    """``buffer_one``: no two runs at once, and each run after the first starts soon after the
    previous one ended (the point that came due meanwhile waited for it; the others were folded
    into it): the schedule is busy all along."""
    producer = stack()
    runs = run_for(producer, r, "buffer_one", 9)
    most, when = max_overlap((run.start, run.end or time.time()) for run in runs)
    gaps = [round(b.start - a.end, 2) for a, b in itertools.pairwise(runs) if a.end is not None]
    print(
        f"\nOVERLAP buffer_one: {len(runs)} runs of {RUN_S} s in 9 s, {most} at once at most, gaps {gaps} s"
    )
    assert all(run.end is not None for run in runs), runs
    assert most == 1, f"{most} runs at once at {when}: {runs}"
    assert len(runs) >= 3, runs
    # the poll is 1 s (OVERLAP_POLL_MS); a loaded machine adds to it
    assert all(0 <= gap < 3 for gap in gaps), gaps
    # the points that came due during a run were folded into the one that waited: each run's
    # point came due after the previous run started (not a backlog of points caught up in turn)
    points = [point_time(run.id) for run in runs]
    assert all(b > a.start - 0.1 for a, b in zip(runs, points[1:], strict=False)), (points, runs)
    assert_alive(procs)


@pytest.mark.slow
def test_cancel_previous_revokes_the_run_in_flight(
    r: redis.Redis, procs: Procs, stack: Callable[..., FlowProducer]
) -> None:
    """``cancel_previous`` on a prefork worker (which can terminate a running task): each point
    revokes the run still in flight, so the runs but the last are cut short (no end recorded),
    and a run is never long in flight with the next."""
    producer = stack(pool="prefork -c 2")
    runs = run_for(producer, r, "cancel_previous", 8, run_s=6)
    cut = [run for run in runs if run.end is None]
    # each cut run ended (terminated) within a few seconds of the next one's start
    lasted = [round(b.start - a.start, 2) for a, b in itertools.pairwise(runs)]
    print(
        f"\nOVERLAP cancel_previous: {len(runs)} runs of 6 s started {lasted} s apart, {len(cut)} cut short"
    )
    assert len(runs) >= 3, runs
    assert len(cut) >= len(runs) - 1, runs
    assert all(gap < 6 for gap in lasted), lasted
    logs = "\n".join(_logs(procs))
    assert "revokes the run(s) still in flight" in logs
    assert "Terminating" in logs or "terminat" in logs.lower(), logs[-3000:]
    assert_alive(procs)


@pytest.mark.slow
def test_buffer_one_after_a_worker_killed_mid_run(
    redis_url: str, r: redis.Redis, procs: Procs, stack: Callable[..., FlowProducer]
) -> None:
    """The worker running a ``buffer_one`` run is SIGKILLed: its slot is no longer renewed, so
    the waiting point runs once the slot expires (``delayq_slot_ttl``, 3 s here, after the last
    renewal, plus the 1 s poll) on another worker: the schedule never waits forever."""
    producer = stack({"delayq_slot_ttl": SLOT_TTL})
    schedules = Schedules(producer.app)
    schedules.add("ov-kill", "flow.work", EVERY_S, args=[30], overlap="buffer_one")
    assert wait_for(lambda: read_runs(r), 30, 0.1), procs.logs()
    first = read_runs(r)[0]
    time.sleep(1.5)  # the next point waits for it
    os.kill(first.pid, signal.SIGKILL)
    t_kill = time.time()
    procs.start("worker", env_for(redis_url, redis_url, {"delayq_slot_ttl": SLOT_TTL}), app=FLOW_APP)
    again = wait_for(lambda: [run for run in read_runs(r) if run.start > t_kill], 60, 0.1)
    schedules.pause("ov-kill")
    assert again, f"no run after the kill\n{procs.logs()}"
    waited = again[0].start - t_kill
    print(
        f"\nOVERLAP buffer_one, worker SIGKILLed mid-run (slot TTL {SLOT_TTL} s): "
        f"next run {waited:.1f} s later"
    )
    assert again[0].pid != first.pid
    # slot TTL after the last renewal (every TTL / 3), the poll, a new worker's start
    assert waited < SLOT_TTL + 1 + 25, waited
    assert len(again) == 1, again
    os.kill(again[0].pid, signal.SIGKILL)  # its 30 s run would hold the teardown's warm shutdown
