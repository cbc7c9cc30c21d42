"""What ``delayq_publish_eta`` costs when a worker's clock is behind.

``python -m bench.eta_clock [SHIFT] [N]`` starts a throwaway Redis, one real ``celery beat``
and one real worker of ``tests.apps.e2e_app`` whose wall clock is shifted by SHIFT seconds
(libfaketime, default ``-5``: 5 s behind; its monotonic clock is left alone, as a wrong
wall clock leaves it), then, with ``delayq_publish_eta`` off and on, stores N jobs
(``apply_in(1 + i/10)``) and prints each mode's due → start lateness (seen from this
process, by the real clock) and how many runs read ``self.request.eta``.

libfaketime is found at Debian's path or ``DELAYQ_LIBFAKETIME``
(``apt-get install libfaketime``). Figures: docs/settings.md (``delayq_publish_eta``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import redis

from celery_delayq.devtools.embedded import EmbeddedRedis
from tests.support.polling import wait_for
from tests.support.processes import Procs, subprocess_env

LIBFAKETIME = os.environ.get("DELAYQ_LIBFAKETIME", "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def run(url: str, shift: str, publish_eta: bool, n: int) -> str:
    r = redis.Redis.from_url(url)
    r.flushall()
    procs = Procs(Path(tempfile.mkdtemp()))
    env = subprocess_env(url, url, DELAYQ_TEST_CONF=json.dumps({"delayq_publish_eta": publish_eta}))
    fake = {
        "LD_PRELOAD": LIBFAKETIME,
        "FAKETIME": shift,
        "FAKETIME_DONT_RESET": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    procs.start("worker", dict(env, **fake))
    procs.start("beat", env)
    try:
        from tests.apps.e2e_app import record  # reads DELAYQ_TEST_* on import (set by main)

        warm = record.apply_in(0)  # with the eta on and the clock behind, it waits too
        assert wait_for(lambda: r.hexists("e2e:runs", warm.id), 120, 0.05), procs.logs()
        r.delete("e2e:runs", "e2e:starts")
        jobs = [record.apply_in(1.0 + i * 0.1) for i in range(n)]
        late: dict[str, float] = {}
        deadline = time.monotonic() + 120
        while len(late) < n and time.monotonic() < deadline:
            for job in jobs:
                if job.id not in late and r.hexists("e2e:runs", job.id):
                    late[job.id] = time.time() - job.due.timestamp()
            time.sleep(0.01)
        ms = sorted(x * 1000.0 for x in late.values())
        starts = [json.loads(s) for s in r.lrange("e2e:starts", 0, -1)]
        with_eta = sum(s["eta"] is not None for s in starts)
        return (
            f"worker clock {shift} s, publish_eta={publish_eta!s:5}: {len(ms)}/{n} ran, "
            f"due -> start p50 {ms[len(ms) // 2]:.0f} ms, max {ms[-1]:.0f} ms; "
            f"request.eta set in {with_eta}/{len(starts)}"
        )
    finally:
        procs.stop_all()
        r.close()


def main() -> None:
    shift = sys.argv[1] if len(sys.argv) > 1 else "-5"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    if not Path(LIBFAKETIME).exists():
        sys.exit(
            f"libfaketime not found at {LIBFAKETIME} (apt-get install libfaketime, or set DELAYQ_LIBFAKETIME)"
        )
    with EmbeddedRedis() as server:
        url = server.url + "/0"
        os.environ.update(DELAYQ_TEST_BROKER=url, DELAYQ_TEST_STORE=url)
        for publish_eta in (False, True):
            print(run(url, shift, publish_eta, n), flush=True)


if __name__ == "__main__":
    main()
