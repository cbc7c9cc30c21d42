"""The flow-control end-to-end stack: workers and beats of ``tests/apps/flow_app.py``
(:func:`start_flow_stack`), the producer in the test process (:class:`FlowProducer`), what the
app's tasks record read back as runs (:func:`read_runs`, :class:`Run`) and the overlap of runs
in time (:func:`max_overlap`, :func:`overlap_at`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from celery_delayq import DelayedTask, DelayQ
from celery_delayq.store.facade import get_store
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import STARTUP, log_of

FLOW_APP = "tests.apps.flow_app"
#: The keys ``flow_app`` records into.
FLOW_KEYS = ("flow:starts", "flow:ends", "flow:done")


class FlowProducer:
    """A producer app in the test process with ``flow_app``'s task names and signatures."""

    def __init__(self, broker: str, store: str, **conf: Any) -> None:
        self.app = app = make_app(broker, store, task_ignore_result=True, **conf)

        @app.task(base=DelayedTask, bind=True, name="flow.work", shared=False)
        def work(self: Any, seconds: float = 0.0, *args: Any) -> None:
            return None

        @app.task(base=DelayedTask, bind=True, name="flow.done", shared=False)
        def done(self: Any, *args: Any) -> None:
            return None

        self.work = work
        self.done = done
        self.dq = DelayQ(app)

    def close(self) -> None:
        get_store(self.app).close()
        self.app.close()


@dataclass(frozen=True)
class Run:
    """One run of ``flow.work``: ``end`` is None when its worker died before it returned."""

    run: str
    id: str
    key: str | None
    pid: int
    start: float
    end: float | None


def read_runs(r: redis.Redis) -> list[Run]:
    """Every run recorded so far, by start time."""
    ends = {e["run"]: e["end"] for e in map(json.loads, r.lrange("flow:ends", 0, -1))}
    runs = [
        Run(s["run"], s["id"], s["key"], s["pid"], s["start"], ends.get(s["run"]))
        for s in map(json.loads, r.lrange("flow:starts", 0, -1))
    ]
    return sorted(runs, key=lambda run: run.start)


def read_done(r: redis.Redis) -> list[dict[str, Any]]:
    """The runs of ``flow.done``: ``{id, args, time}``."""
    return [json.loads(d) for d in r.lrange("flow:done", 0, -1)]


def ended_ids(r: redis.Redis) -> set[str]:
    return {json.loads(e)["id"] for e in r.lrange("flow:ends", 0, -1)}


def max_overlap(intervals: Iterable[tuple[float, float]]) -> tuple[int, float]:
    """The most intervals ``[start, end)`` open at one instant, and the first such instant.
    An interval that ends at the instant another starts does not overlap it."""
    events = sorted((t, kind) for start, end in intervals for t, kind in ((start, 1), (end, -1)))
    # At equal times ends (-1) sort before starts (+1).
    most, when, open_now = 0, 0.0, 0
    for t, kind in events:
        open_now += kind
        if open_now > most:
            most, when = open_now, t
    return most, when


def overlap_at(intervals: Iterable[tuple[float, float]], since: float) -> int:
    """The most intervals open at one instant at or after ``since``."""
    clipped = [(max(start, since), end) for start, end in intervals if end > since]
    return max_overlap(clipped)[0]


def start_flow_stack(
    procs: Procs, env: dict[str, str], workers: int = 2, beats: int = 2, concurrency: int = 4, pool: str = ""
) -> None:
    """``workers`` workers (``-P threads -c concurrency``: one process each, so a SIGKILL ends
    its tasks too; or ``pool``, e.g. ``"prefork -c 2"``) and ``beats`` beats of ``flow_app``;
    returns once all are ready."""
    for _ in range(workers):
        procs.start("worker", env, app=FLOW_APP, pool=pool or f"threads -c {concurrency}")
    for _ in range(beats):
        procs.start("beat", env, app=FLOW_APP)
    indexes = range(len(procs.procs))

    def ready() -> bool:
        logs = [(procs.procs[i][0].args, log_of(procs, i)) for i in indexes]
        return all(
            (" ready." in text) if "worker" in args else ("delayq: beat" in text) for args, text in logs
        )

    assert wait_for(ready, STARTUP, 0.1), f"worker(s)/beat(s) did not start\n{procs.logs()}"


def warm_up_flow(producer: FlowProducer, r: redis.Redis, procs: Procs) -> None:
    """One ungated job through a beat and a worker; then forget what it recorded."""
    job = producer.work.apply_in(0, task_id=f"warmup-{uuid.uuid4().hex}")
    ran = wait_for(lambda: job.id in ended_ids(r), STARTUP, 0.05)
    assert ran, f"warm-up job did not run; in the store: {producer.dq.get(job.id)}\n{procs.logs()}"
    r.delete(*FLOW_KEYS)


def worker_pids(procs: Procs) -> list[int]:
    return [proc.pid for proc, log in procs.procs if log.name.startswith("worker")]


def parked_completion(app: Any, bid: str, total: int, *args: Any) -> str:
    """Open batch ``bid`` of ``total`` members with a completion job ``t.done(*args)`` (a task
    of ``app``'s registered here), stored as the producer API stores it: its envelope built
    now, the job parked with the batch. Returns the completion job's id."""
    from celery_delayq.flow.gate import BATCH_DONE_HEADER, completion_id

    store = get_store(app)

    @app.task(base=DelayedTask, name="t.done", shared=False)
    def on_complete(*args: Any) -> None:
        return None

    done = on_complete.apply_in(3600, args, task_id=completion_id(bid), headers={BATCH_DONE_HEADER: bid})
    stored = store.get(done.id)
    assert stored is not None
    DelayQ(app).cancel(done.id)
    assert store.open_batch(bid, total, (done.id, stored.envelope), {})
    return str(done.id)
