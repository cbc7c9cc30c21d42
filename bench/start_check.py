"""What the workers' start check (``delayq_start_check``) costs per task start.

``python -m bench.start_check [N]`` (N = 5,000 by default) starts a throwaway Redis and
prints, side by side:

* **in the consumer**: the time the worker's consumer spends per message in the strategy
  that :class:`celery_delayq.worker.starts.StartCheck` wraps, for N messages without the claim
  header (never checked: the push path, plain Celery), N with one (the first start: one
  ``lua/start.lua`` call that writes a record), and N stale copies (the call that drops them);
  the inner strategy does nothing, so this is the check alone; and the memory each record
  takes in Redis (``used_memory`` delta / N);
* **in a real worker**: N messages of an empty task (``bench.noop``) published to a Redis
  broker, with and without a claim header each, and one ``celery worker -P solo`` started on
  them: the time from the first task start to the last, per task (worker start-up left out).

Figures and the default chosen from them: docs/benchmarks.md ("The workers' start check").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import redis
from celery import Celery

from celery_delayq.store.envelope import CLAIM_HEADER

BROKER = os.environ.get("START_CHECK_BROKER", "redis://127.0.0.1:1/0")
app = Celery("start_check", broker=BROKER, set_as_current=False)
app.conf.update(broker_connection_retry_on_startup=True, task_ignore_result=True, delayq_url=BROKER)


@app.task(name="bench.noop")
def noop() -> None:
    _client().rpush("bench:starts", time.time())


_clients: list[redis.Redis] = []


def _client() -> redis.Redis:
    if not _clients:
        _clients.append(redis.Redis.from_url(BROKER))
    return _clients[0]


class _Consumer:
    def __init__(self, application: Any) -> None:
        self.app = application
        self.strategies: dict[str, Any] = {"bench.noop": lambda *args, **kwargs: None}


class _Message:
    __slots__ = ("headers",)

    def __init__(self, headers: dict[str, Any]) -> None:
        self.headers = headers

    def ack(self) -> None:
        pass


def in_consumer(url: str, n: int) -> list[str]:
    from celery_delayq.worker.starts import StartCheck

    logging.getLogger("celery_delayq.worker.starts").setLevel(logging.ERROR)  # (a line per stale copy)
    application = Celery("start_check", broker=url, set_as_current=False)
    application.conf.update(delayq_url=url)
    consumer = _Consumer(application)
    StartCheck(consumer).start(consumer)
    strategy = consumer.strategies["bench.noop"]
    r = redis.Redis.from_url(url)
    run = uuid.uuid4().hex[:8]
    modes = {
        "no header (unchecked)": [{"id": f"{run}-{i}"} for i in range(n)],
        "claim, first start": [{CLAIM_HEADER: f"1|beat-a|1000|7|{run}-{i}"} for i in range(n)],
        "claim, stale copy (dropped)": [{CLAIM_HEADER: f"1|beat-b|1000|7|{run}-{i}"} for i in range(n)],
    }
    lines: list[str] = []
    for label, headers in modes.items():
        messages = [_Message(h) for h in headers]
        before = int(r.info("memory")["used_memory"])
        began = time.perf_counter()
        for message in messages:
            strategy(message, None, None, None, None)
        took = time.perf_counter() - began
        grown = int(r.info("memory")["used_memory"]) - before
        lines.append(
            f"in the consumer, {label:28}: {took / n * 1e6:7.1f} us per message"
            + (f", {grown / n:.0f} bytes of Redis per record" if "first" in label else "")
        )
    return lines


def in_worker(url: str, n: int, with_claim: bool) -> str:
    sender = Celery("start_check", broker=url, set_as_current=False)
    run = uuid.uuid4().hex[:8]
    with sender.producer_or_acquire() as producer:
        for i in range(n):
            headers = {CLAIM_HEADER: f"1|beat-a|1000|7|{run}-{i}"} if with_claim else {}
            sender.send_task("bench.noop", producer=producer, headers=headers)
    r = redis.Redis.from_url(url)
    r.delete("bench:starts")
    env = dict(os.environ, START_CHECK_BROKER=url)
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.start_check",
        "worker",
        "-P",
        "solo",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "warning",
    ]
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while r.llen("bench:starts") < n and time.time() < deadline:
            time.sleep(0.05)
        stamps = [float(x) for x in r.lrange("bench:starts", 0, -1)]
    finally:
        worker.terminate()
        worker.wait()
    if len(stamps) < n:
        return (
            f"in a worker (-P solo), {'claim' if with_claim else 'no header'}: only {len(stamps)} of {n} ran"
        )
    per = (stamps[-1] - stamps[0]) / (n - 1)
    label = "claim, checked" if with_claim else "no header"
    return f"in a worker (-P solo), {label:16}: {per * 1e6:7.1f} us per task start ({n} tasks, first to last)"


def main() -> None:
    from celery_delayq.devtools.embedded import EmbeddedRedis

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    with EmbeddedRedis() as server:
        url = server.url + "/0"
        for line in in_consumer(url, n):
            print(line, flush=True)
        for with_claim in (False, True, False, True):
            print(in_worker(url, n, with_claim), flush=True)


if __name__ == "__main__":
    main()
