"""Flow control end to end (issue 15): concurrency caps, batches, limits changed at run time,
pause/resume and a rate limit, with real ``celery worker`` (``-P threads``) and
``celery beat -S celery_delayq.Scheduler`` processes of ``tests/apps/flow_app.py`` and a real
redis-server (broker and store).

``flow.work(seconds)`` records its start and its end (``time.time()``, before the worker gives
the slot back) with a token per run (see ``tests/apps/flow_app.py``); the tests compute from
them how many runs of a key overlapped (:func:`tests.support.flow.max_overlap`). Worker, beats
and the test share the machine's clock. Tolerances are generous (a loaded 2-core machine); no
test asserts a speed.

Run with ``-s`` to see the figures the tests print (overlap maxima, rates).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_delayq.flow.gate import member_id
from tests.support.flow import (
    FlowProducer,
    Run,
    ended_ids,
    max_overlap,
    overlap_at,
    read_done,
    read_runs,
    start_flow_stack,
    warm_up_flow,
    worker_pids,
)
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import assert_alive, env_for

pytestmark = pytest.mark.e2e

#: Seconds after a pause or a lowered limit within which a job released just before it may
#: still start (the beat published it; it is on its way to a worker).
IN_FLIGHT = 1.5
#: Seconds to wait after the last expected record, for a late duplicate to show up.
SETTLE = 1.5
#: Slot lease of the worker-kill test (the default is 60 s).
SLOT_TTL = 3
#: Start TTL of the worker-kill test (the default is 3,600 s, as kombu's visibility timeout): the
#: killed worker may hold a member's message it received and had not started yet (a slot freed
#: just before the kill promotes the next member, and that worker took it); such a member is
#: delivered again when this TTL is over, as Celery would after the visibility timeout.
START_TTL = 12


@pytest.fixture
def flow(redis_url: str, r: redis.Redis, procs: Procs) -> Iterator[Callable[..., FlowProducer]]:
    """Starts the stack (by default 2 workers ``-P threads -c 4`` and 2 beats, broker and store
    on the session's Redis) with the given app settings, warms it up, returns the producer."""
    made: list[FlowProducer] = []

    def start(conf: dict[str, Any] | None = None, workers: int = 2, beats: int = 2) -> FlowProducer:
        conf = conf or {}
        producer = FlowProducer(redis_url, redis_url, **conf)
        made.append(producer)
        start_flow_stack(procs, env_for(redis_url, redis_url, conf), workers=workers, beats=beats)
        warm_up_flow(producer, r, procs)
        return producer

    yield start
    for producer in made:
        producer.close()


def tenure(runs: list[Run]) -> list[tuple[float, float]]:
    """Per job: from its first start to its last recorded end. A job whose run was killed keeps
    its slot until the slot's lease expires, and then the same job is released again into the
    same slot: so its slot is held all along this interval."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for run in runs:
        first[run.id] = min(first.get(run.id, math.inf), run.start)
        if run.end is not None:
            last[run.id] = max(last.get(run.id, -math.inf), run.end)
    return [(first[job], last.get(job, math.inf)) for job in first]


def completed(runs: list[Run]) -> list[tuple[float, float]]:
    return [(run.start, run.end) for run in runs if run.end is not None]


def open_now(runs: list[Run]) -> list[tuple[float, float]]:
    """Each run, an unfinished one open until now (for polling the overlap reached so far)."""
    return [(run.start, math.inf if run.end is None else run.end) for run in runs]


def check_batch_done(
    r: redis.Redis, producer: FlowProducer, batch: Any, members: set[str], runs: list[Run], args: list[Any]
) -> None:
    """``on_complete`` ran once, after the last member ended, with (its args, batch id, counts);
    the batch says so and nothing of it is left in the store."""
    done = read_done(r)
    assert len(done) == 1, done
    counts = {"total": len(members), "succeeded": len(members), "failed": 0, "cancelled": 0}
    assert done[0]["args"] == [*args, batch.id, counts], done
    last_end = max(run.end for run in runs if run.end is not None)
    assert done[0]["time"] >= last_end, (done[0]["time"], last_end)
    progress = batch.join(timeout=10)
    assert progress["total"] == len(members) and progress["succeeded"] == len(members), progress
    assert progress["waiting"] == 0 and progress["running"] == 0 and progress["failed"] == 0, progress
    assert producer.dq.count() == 0
    assert list(producer.dq.dead()) == []


def test_batch_of_60_capped_at_3_runs_each_once_then_completes(
    r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """60 members of 0.2 s, limit 3, two workers of 4 threads (8 could run at once) and two
    beats: each member runs exactly once, never more than 3 at an instant, 3 at some instant;
    ``on_complete`` runs once, after the last member ended."""
    producer = flow()
    batch = producer.dq.batch(
        [producer.work.s(0.2, i) for i in range(60)],
        concurrency_limit=3,
        on_complete=producer.done.s("all-done"),
    )
    members = {member_id(batch.id, i) for i in range(60)}
    finished = wait_for(lambda: members <= ended_ids(r) and read_done(r), 120, 0.1)
    assert finished, f"{len(ended_ids(r) & members)}/60 ended, done={read_done(r)}\n{procs.logs()}"
    time.sleep(SETTLE)

    runs = read_runs(r)
    assert Counter(run.id for run in runs) == Counter(members), "a member ran twice, or not at all"
    assert all(run.end is not None for run in runs)
    assert {run.key for run in runs} == {f"batch:{batch.id}"}
    most, when = max_overlap(completed(runs))
    span = max(run.end for run in runs if run.end is not None) - runs[0].start
    print(
        f"\nFLOW batch 60 x 0.2 s, limit 3, 2 workers x 4 threads, 2 beats: overlap max {most} "
        f"(first at +{when - runs[0].start:.2f} s), all ran in {span:.2f} s"
    )
    assert most <= 3, f"{most} members ran at once"
    assert most == 3, f"at most {most} members ran at once: the limit 3 was never reached"
    check_batch_done(r, producer, batch, members, runs, ["all-done"])
    assert_alive(procs)


@pytest.mark.slow
def test_worker_killed_mid_batch_members_run_again_cap_holds(
    r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """As the batch test (members of 0.5 s, so that a kill finds some running), with
    ``delayq_slot_ttl`` 3 s and one of the two workers SIGKILLed while it runs members.

    What the cap means when a worker dies: a killed run never records its end, and its job
    keeps its slot (in ``gate:run:<key>``, not renewed any more) until the slot's lease expires;
    the beat then claims the job again and releases it into the same slot (a redelivery), and
    the job's slot is given back only when that second run ends. So the right check is on each
    job's *tenure*, from its first start to its last end (a killed job's tenure spans its killed
    run, the wait for the lease and its second run): at no instant do more than 3 tenures
    overlap. Counting only the runs that ended would not see a slot taken by a dead worker; it
    holds too (it is weaker). Also: every member ended exactly once; the members that ran
    twice are exactly those killed, their second run started after the kill on the other worker;
    ``on_complete`` ran once, after the last end, counting 60 succeeded.
    """
    producer = flow({"delayq_slot_ttl": SLOT_TTL, "delayq_start_ttl": START_TTL})
    batch = producer.dq.batch(
        [producer.work.s(0.5, i) for i in range(60)],
        concurrency_limit=3,
        on_complete=producer.done.s("after-kill"),
    )
    members = {member_id(batch.id, i) for i in range(60)}
    assert wait_for(lambda: len(ended_ids(r) & members) >= 12, 120, 0.05), procs.logs()

    # The victim: a worker with a run that started less than 0.25 s ago (0.25 s left at least).
    pids = worker_pids(procs)

    def victim() -> int | None:
        now = time.time()
        busy = [run.pid for run in read_runs(r) if run.end is None and now - run.start < 0.25]
        return busy[0] if busy else None

    pid = wait_for(victim, 30, 0.01)
    assert pid in pids, (pid, pids)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    proc = next(p for p, _ in procs.procs if p.pid == pid)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    finished = wait_for(lambda: members <= ended_ids(r) and read_done(r), 120 + 3 * SLOT_TTL + START_TTL, 0.1)
    missing = sorted(members - ended_ids(r))
    assert finished, (
        f"{60 - len(missing)}/60 ended, done={read_done(r)}, missing {missing}: "
        f"{[producer.dq.get(job) for job in missing]}\n{procs.logs()}"
    )
    time.sleep(SETTLE)

    runs = read_runs(r)
    killed = {run.id for run in runs if run.end is None}
    assert killed, "the kill caught no running member"
    assert {run.pid for run in runs if run.end is None} == {pid}
    ended = Counter(run.id for run in runs if run.end is not None)
    assert ended == Counter(members), "a member did not end, or ended twice"
    twice = {job for job, n in Counter(run.id for run in runs).items() if n > 1}
    assert twice == killed, f"ran twice: {sorted(twice)}; killed: {sorted(killed)}"
    again = [run for run in runs if run.id in killed and run.end is not None]
    assert all(run.start > t_kill and run.pid != pid for run in again), again
    wait_s = sorted(run.start - t_kill for run in again)
    most, _ = max_overlap(tenure(runs))
    most_ended, _ = max_overlap(completed(runs))
    print(
        f"\nFLOW batch 60 x 0.5 s, limit 3, worker SIGKILLed (slot TTL {SLOT_TTL} s): killed members "
        f"{len(killed)}, their second runs started {[round(s, 2) for s in wait_s]} s after the kill; "
        f"overlap max of job tenures {most}, of ended runs {most_ended}"
    )
    assert most <= 3, f"{most} jobs held a slot at once"
    assert most_ended <= 3
    check_batch_done(r, producer, batch, members, runs, ["after-kill"])


def test_limit_lowered_from_4_to_1_while_jobs_wait(
    r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """20 jobs of 0.4 s with ``concurrency_limit=4``: once 4 ran at once, ``set_limit(key, 1)``;
    from then on (after what was already released has started and ended) one runs at a time."""
    producer = flow()
    key = "tenant:lower"
    results = producer.work.apply_at_many(
        [(time.time(), (0.4, i), None) for i in range(20)], concurrency_key=key, concurrency_limit=4
    )
    ids = {res.id for res in results}
    reached = wait_for(lambda: max_overlap(open_now(read_runs(r)))[0] >= 4, 60, 0.02)
    assert reached, f"4 never ran at once: {read_runs(r)}\n{procs.logs()}"
    t_set = time.time()
    producer.dq.set_limit(key, 1)
    started_before = len(read_runs(r))

    assert wait_for(lambda: ids <= ended_ids(r), 120, 0.1), f"{len(ended_ids(r) & ids)}/20\n{procs.logs()}"
    time.sleep(SETTLE)
    runs = read_runs(r)
    assert Counter(run.id for run in runs) == Counter(ids)
    intervals = completed(runs)
    before, _ = max_overlap(iv for iv in intervals if iv[0] < t_set)
    after = overlap_at(intervals, t_set + IN_FLIGHT + 0.4)
    late = [run for run in runs if run.start >= t_set + IN_FLIGHT + 0.4]
    print(
        f"\nFLOW limit 4 -> 1: overlap max {before} before set_limit ({started_before} started), "
        f"{after} from {IN_FLIGHT + 0.4:.1f} s after it ({len(late)} runs then)"
    )
    assert max_overlap(intervals)[0] <= 4
    assert before == 4
    assert after == 1
    assert len(late) >= 5, "too few jobs ran after the change to show it"
    state = producer.dq.key_state(key)
    assert state.running == 0 and state.waiting == 0, state


def test_pause_holds_a_key_and_resume_releases_it(
    r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """Jobs of a paused key never start; after ``resume`` they run (each once); a pause in the
    middle stops new starts again (after what was already released)."""
    producer = flow()
    key = "tenant:paused"
    producer.dq.pause(key, new=True)
    results = producer.work.apply_at_many(
        [(time.time(), (0.5, i), None) for i in range(12)], concurrency_key=key, concurrency_limit=2
    )
    ids = {res.id for res in results}
    parked = wait_for(lambda: producer.dq.key_state(key).waiting == 12, 30, 0.1)
    assert parked, f"{producer.dq.key_state(key)}\n{procs.logs()}"
    time.sleep(2.0)
    assert read_runs(r) == [], "a job of a paused key started"
    state = producer.dq.key_state(key)
    assert state.paused and state.running == 0 and state.waiting == 12, state

    producer.dq.resume(key)
    assert wait_for(lambda: len(ended_ids(r) & ids) >= 2, 30, 0.05), procs.logs()
    t_pause = time.time()
    producer.dq.pause(key)
    time.sleep(IN_FLIGHT + 2.0)
    runs = read_runs(r)
    held = len(ids) - len(runs)
    after_pause = [run for run in runs if run.start > t_pause + IN_FLIGHT]
    print(
        f"\nFLOW pause in the middle: {len(runs)} started, {held} held back; "
        f"{len(after_pause)} started later than {IN_FLIGHT} s after the pause"
    )
    assert after_pause == []
    assert held >= 4, f"only {held} jobs were left to hold back"
    assert producer.dq.key_state(key).paused

    producer.dq.resume(key)
    assert wait_for(lambda: ids <= ended_ids(r), 60, 0.1), f"{len(ended_ids(r) & ids)}/12\n{procs.logs()}"
    time.sleep(SETTLE)
    runs = read_runs(r)
    assert Counter(run.id for run in runs) == Counter(ids)
    assert max_overlap(completed(runs))[0] <= 2
    state = producer.dq.key_state(key)
    assert not state.paused and state.running == 0 and state.waiting == 0, state


@pytest.mark.slow
def test_rate_limit_20_per_second_across_two_beats(
    r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """240 jobs due at once with ``rate_limit="20/s"``, two beats: the starts the tasks recorded
    in the 10 s from the first one number about 200 (150 to 215: the bound is loose for start
    jitter on a loaded machine, the rate itself is kept at release by the beats)."""
    producer = flow()
    key = "api:rated"
    results = producer.work.apply_at_many(
        [(time.time(), (0.0, i), None) for i in range(240)], rate_limit_key=key, rate_limit="20/s"
    )
    ids = {res.id for res in results}
    assert wait_for(lambda: ids <= ended_ids(r), 90, 0.1), f"{len(ended_ids(r) & ids)}/240\n{procs.logs()}"
    time.sleep(SETTLE)
    runs = read_runs(r)
    assert Counter(run.id for run in runs) == Counter(ids)
    t0 = runs[0].start
    in_window = sum(1 for run in runs if run.start < t0 + 10.0)
    per_second = [sum(1 for run in runs if t0 + s <= run.start < t0 + s + 1) for s in range(10)]
    print(
        f"\nFLOW rate 20/s, 2 beats: {in_window} starts in the 10 s from the first; per second "
        f"{per_second}; all 240 in {runs[-1].start - t0:.2f} s"
    )
    assert 150 <= in_window <= 215, in_window


#: The second producer of the streamed-batch test: adds ``rounds`` x ``size`` members to the
#: open batch ``sys.argv[2]``, ``pause`` s apart, and prints their ids.
STREAM_ADDER = """
import sys, time
from tests.support.flow import FlowProducer
url, bid, pause = sys.argv[1], sys.argv[2], float(sys.argv[5])
rounds, size = int(sys.argv[3]), int(sys.argv[4])
producer = FlowProducer(url, url)
batch = producer.dq.batch_result(bid)
ids = []
for n in range(rounds):
    ids += batch.add([producer.work.s(0.1, "b", n, i) for i in range(size)])
    time.sleep(pause)
producer.close()
print(" ".join(ids))
"""


def test_streamed_batch_from_two_processes_completes_once_after_the_seal(
    redis_url: str, r: redis.Redis, procs: Procs, flow: Callable[..., FlowProducer]
) -> None:
    """An open batch (limit 3) gets 3 rounds of 5 members from the test process and 3 from a
    second process, 0.3 s apart, while workers run them: every one of the 30 runs once; once
    all ended, ``on_complete`` has not run (the batch is not sealed); after the seal it runs
    exactly once, after the last member ended, with the counts of 30."""
    producer = flow()
    batch = producer.dq.open_batch(concurrency_limit=3, on_complete=producer.done.s("streamed"))
    root = Path(__file__).resolve().parent.parent
    other = subprocess.Popen(
        [sys.executable, "-c", STREAM_ADDER, redis_url, batch.id, "3", "5", "0.3"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    mine: list[str] = []
    for n in range(3):
        mine += batch.add([producer.work.s(0.1, "a", n, i) for i in range(5)])
        time.sleep(0.3)
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0
    members = set(mine) | set(out.split())
    assert members == {member_id(batch.id, i) for i in range(30)}
    ended = wait_for(lambda: members <= ended_ids(r), 120, 0.1)
    assert ended, f"{len(ended_ids(r) & members)}/30 ended\n{procs.logs()}"
    time.sleep(SETTLE)
    assert read_done(r) == [], "on_complete ran before the seal"
    state = batch.state()
    assert (state.total, state.succeeded, state.sealed, state.done) == (30, 30, False, False)
    assert batch.seal() is True
    assert wait_for(lambda: read_done(r), 60, 0.1), f"on_complete did not run\n{procs.logs()}"
    time.sleep(SETTLE)
    runs = read_runs(r)
    assert Counter(run.id for run in runs) == Counter(members), "a member ran twice, or not at all"
    assert max_overlap(completed(runs))[0] <= 3
    check_batch_done(r, producer, batch, members, runs, ["streamed"])
    assert_alive(procs)
