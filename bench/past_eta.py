"""What it would cost to publish delayq jobs with their due time (already past) as ``eta``.

The question (issue 12, Flower): a worker's ``task-received`` event, and so Flower, shows a
message's ``eta`` but none of its headers. Could the beat publish each job with ``eta`` = its
due time, which is past at publish, so that Flower shows it, without the worker holding it?

``python -m bench.past_eta [N]`` fills a throwaway Redis with N messages of ``bench.sleepy``,
without ``eta`` or with ``eta`` = now - 60 s, then starts one real worker
(``-P prefork -c 2``, Celery's default prefetch) and reports, per mode:

* with a 0.5 s task, 12 s after the worker starts: messages still in the queue, messages the
  worker has taken (Redis ``unacked``), tasks done, worker RSS (main process and children);
* with an empty task: the time until all N ran (worker start-up included), and the RSS.

Figures and the choice made: docs/benchmarks.md ("A past eta on delayq messages").
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import redis
from celery import Celery

BROKER = os.environ.get("PAST_ETA_BROKER", "redis://127.0.0.1:1/0")
app = Celery("past_eta", broker=BROKER, set_as_current=False)
app.conf.update(broker_connection_retry_on_startup=True, task_ignore_result=True)


@app.task(name="bench.sleepy")
def sleepy(seconds: float, pad: str = "") -> None:
    if seconds:
        time.sleep(seconds)
    redis.Redis.from_url(BROKER).incr("bench:done")


def _rss_mib(pid: int) -> float:
    out = subprocess.run(
        ["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)], capture_output=True, text=True
    ).stdout
    return sum(int(x) for x in out.split()) / 1024


def run(n: int, mode: str, task_seconds: float) -> str:
    from celery_delayq.devtools.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        url = server.url + "/0"
        sender = Celery("past_eta", broker=url, set_as_current=False)
        past = datetime.now(UTC) - timedelta(seconds=60)
        with sender.producer_or_acquire() as producer:
            for _ in range(n):
                options = {"eta": past} if mode == "past-eta" else {}
                sender.send_task("bench.sleepy", (task_seconds, "x" * 200), producer=producer, **options)
        r = redis.Redis.from_url(url)
        env = dict(os.environ, PAST_ETA_BROKER=url)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.past_eta",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "warning",
        ]
        started = time.time()
        worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if task_seconds:
                time.sleep(12)
                return (
                    f"{mode:8} task {task_seconds} s, 12 s after worker start: "
                    f"in queue {r.llen('celery')}, taken (unacked) {r.hlen('unacked')}, "
                    f"done {int(r.get('bench:done') or 0)}, "
                    f"worker RSS {_rss_mib(worker.pid):.0f} MiB"
                )
            while int(r.get("bench:done") or 0) < n and time.time() - started < 300:
                time.sleep(0.05)
            return (
                f"{mode:8} empty task: {n} ran {time.time() - started:.1f} s after worker start "
                f"(start-up included), worker RSS {_rss_mib(worker.pid):.0f} MiB"
            )
        finally:
            worker.terminate()
            worker.wait()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for task_seconds in (0.5, 0.0):
        for mode in ("no-eta", "past-eta"):
            print(run(n, mode, task_seconds), flush=True)


if __name__ == "__main__":
    main()
