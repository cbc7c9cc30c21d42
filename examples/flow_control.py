"""Flow control: a concurrency cap per tenant, and a batch under a cap with a completion callback.

Run it (from the repository root, with a Redis at DELAYQ_EXAMPLE_URL):

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.flow_control worker -l info -P threads -c 8
    celery -A examples.flow_control beat -S celery_delayq.Scheduler -l info
    python -m examples.flow_control

The last command stores 8 renders of tenant 42 (at most 2 at a time) and 4 of tenant 7 (at
most 3), then a batch of 12 renders of tenant "acme" (at most 3 at a time), one of which
fails, with ``month_done`` as its ``on_complete``. It waits for the batch (``join``: woken by
the completion notification), then for the tenants' renders, and prints, per key, how many
renders ran at once at most (from the start and end times the tasks recorded), and what
``month_done`` received: ``("acme", batch_id, counts)``. The worker has 8 threads, so
without the caps up to 8 renders of a key would run at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from celery import Celery

from celery_delayq import DelayedTask, DelayQ

URL = os.environ.get("DELAYQ_EXAMPLE_URL", "redis://127.0.0.1:6379/0")
RUNS = "examples:flow:runs"
DONE = "examples:flow:done"
LIMITS = {"tenant:42": 2, "tenant:7": 3, "acme": 3}
RENDER_SECONDS = 0.3

app = Celery("flow_control", broker=URL)
app.conf.update(delayq_url=URL, task_ignore_result=True, broker_connection_retry_on_startup=True)


@app.task(base=DelayedTask, name="examples.render")
def render(tenant: str, report: int) -> None:
    """Render one report (sleep), recording when it ran; report -1 fails."""
    started = time.time()
    if report < 0:
        raise ValueError(f"report {report} of {tenant} cannot be rendered")
    time.sleep(RENDER_SECONDS)
    record = {"tenant": tenant, "report": report, "start": started, "end": time.time()}
    redis.Redis.from_url(URL).rpush(RUNS, json.dumps(record))


@app.task(name="examples.month_done")
def month_done(tenant: str, batch_id: str, counts: dict[str, int]) -> None:
    """A batch's completion callback: its own argument, then the batch id and the counts."""
    record = {"tenant": tenant, "batch_id": batch_id, "counts": counts, "at": time.time()}
    redis.Redis.from_url(URL).rpush(DONE, json.dumps(record))


def most_at_once(runs: list[dict[str, Any]]) -> int:
    """The largest number of runs in progress at one instant."""
    events = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    now = peak = 0
    for _, step in events:  # an end before a start at the same instant: sorted -1 first
        now += step
        peak = max(peak, now)
    return peak


def main() -> int:
    client = redis.Redis.from_url(URL, decode_responses=True)
    client.delete(RUNS, DONE)
    dq = DelayQ(app)

    # A cap per tenant: due now, but at most LIMITS[key] of a key run at once.
    for tenant, count in (("tenant:42", 8), ("tenant:7", 4)):
        for report in range(count):
            render.apply_in(0, args=(tenant, report), concurrency_key=tenant,
                            concurrency_limit=LIMITS[tenant])  # fmt: skip

    # A batch under a cap of its own, with a completion callback; one member fails.
    members = [render.s("acme", report) for report in range(11)] + [render.s("acme", -1)]
    batch = dq.batch(members, concurrency_limit=LIMITS["acme"], priority=5, on_complete=month_done.s("acme"))
    print(f"batch {batch.id}: {batch.progress()}")
    try:
        progress = batch.join(timeout=90)
    except TimeoutError:
        print(f"batch not done after 90 s: {batch.progress()}")
        return 1
    print(f"batch done: {progress}")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (client.llen(RUNS) < 8 + 4 + 11 or not client.llen(DONE)):
        time.sleep(0.1)
    time.sleep(1.0)  # nothing more may run: every job ran once, the callback once
    runs = [json.loads(raw) for raw in client.lrange(RUNS, 0, -1)]
    ok = len(runs) == 8 + 4 + 11
    for key, limit in LIMITS.items():
        mine = [r for r in runs if r["tenant"] == key]
        peak = most_at_once(mine)
        print(f"{key}: {len(mine)} renders, at most {peak} at once (limit {limit})")
        ok = ok and peak <= limit
    done = [json.loads(raw) for raw in client.lrange(DONE, 0, -1)]
    for call in done:
        print(f"month_done({call['tenant']!r}, {call['batch_id']!r}, {call['counts']})")
    ok = ok and len(done) == 1 and done[0]["batch_id"] == batch.id
    ok = ok and done[0]["counts"] == {"total": 12, "succeeded": 11, "failed": 1, "cancelled": 0}
    for state in dq.keys():  # noqa: SIM118 - DelayQ is not a mapping
        print(f"key {state.key}: running {state.running}, waiting {state.waiting}")
    print("ok" if ok else "unexpected result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
