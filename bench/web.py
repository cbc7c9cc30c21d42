"""Row ``web``: the dashboard with ``web_jobs`` (1,000,000) jobs pending.

``celery -A bench.app delayq web`` (waitress, in its own process) serves a store holding the
jobs, due over the next 24 hours from 10 minutes on, and a lateness record in each of the last
60 minutes. Over HTTP (one keep-alive connection, like a browser tab), ``web_requests`` loads
each of the overview (``/``), ``/api/status`` and the first jobs page (``/jobs``), one at a
time after a warm-up: p50 and p99 of the time to the last byte, against the issue's 200 ms.

The dashboard's load on Redis: ``INFO commandstats`` (commands run inside scripts included)
before and after loads of each page; less the ``INFO`` calls of the measure, over the loads,
is the commands per load, and over the live refresh interval (5 s) the commands per second one
open page costs. Beside it, an idle beat on the same store and server: the commands/s it sends
over ``idle`` seconds, counted the same way (the ``idle_beat`` row counts with ``MONITOR``,
which leaves out the commands inside scripts).
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable
from typing import Any

from .harness import Context, fill, percentile, producer, wait_until, wake_channel
from .report import Line, RowResult

#: Seconds the fill may take through apply_at_many before it switches to the fast path.
FILL_BUDGET = 5.0
#: The p99 the issue asks of each page with 1M pending.
TARGET_MS = 200.0
#: The dashboard's live refresh interval (``--refresh``, ``web.context.REFRESH_SECONDS``).
REFRESH_S = 5.0
PAGES = (("/", "overview"), ("/api/status", "/api/status"), ("/jobs", "first jobs page"))
WARMUP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One keep-alive HTTP connection to the dashboard: ``get(path)`` -> (status, ms to last byte)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def get(self, path: str) -> tuple[int, float, int]:
        t0 = time.perf_counter()
        try:
            self.conn.request("GET", path, headers={"Accept": "text/html"})
            response = self.conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            raise
        return response.status, (time.perf_counter() - t0) * 1000.0, len(body)

    def close(self) -> None:
        self.conn.close()


def commands_total(client: Any) -> int:
    """Calls of every command so far, from ``INFO commandstats`` (calls inside scripts included)."""
    return sum(int(s.get("calls", 0)) for s in client.info("commandstats").values())


def commands_during(client: Any, work: Callable[[], Any]) -> int:
    """Commands the server ran while ``work()`` ran, less this measure's own ``INFO``."""
    before = commands_total(client)
    work()
    return commands_total(client) - before - 1  # the second INFO counts the first, not itself


def row_web(ctx: Context) -> RowResult:
    result = RowResult("web")
    sz = ctx.sizes
    n, loads = sz.web_jobs, sz.web_requests
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        from celery_delayq.lateness import key_for, tally
        from celery_delayq.store import get_store

        start = time.time() + 600
        spread = 86_400.0 / n
        ctx.say(f"web: storing {n:,} jobs due over 24 h")
        filled = fill(p, n, lambda i: start + i * spread, FILL_BUDGET).method
        store = get_store(p.app)
        minute = store.server_now_ms() // 60_000
        for back in range(60):  # a beat and workers recording lateness through the last hour
            for kind in ("publish", "start"):
                store.add_lateness(key_for("delayq", kind), tally([1.5, 3, 3, 7, 40]), minute=minute - back)
        port = _free_port()
        web = ctx.start_web(url, port)
        browser = Browser(port)

        def answers() -> bool:
            try:
                return browser.get("/")[0] == 200
            except (OSError, http.client.HTTPException):
                return False

        wait_until(answers, 60, 0.2, [web], "the dashboard did not answer")
        times: dict[str, list[float]] = {}
        sizes: dict[str, int] = {}
        per_load: dict[str, float] = {}
        for path, _ in PAGES:
            for _ in range(WARMUP):
                browser.get(path)
            ctx.say(f"web: {loads} loads of {path}")
            took: list[float] = []

            def load(path: str = path, took: list[float] = took) -> None:
                for _ in range(loads):
                    status, ms, size = browser.get(path)
                    if status != 200:
                        raise RuntimeError(f"GET {path} answered {status}")
                    took.append(ms)
                    sizes[path] = size

            per_load[path] = commands_during(p.client, load) / loads
            times[path] = took
        browser.close()
        ctx.stop(web)

        idle_s = max(3.0, min(30.0, sz.idle_seconds))
        ctx.say(f"web: an idle beat on the same store, {idle_s:.0f} s")
        beat = ctx.start_beat(url, url)
        ctx.wait_beats(p.client, wake_channel(p), [beat])
        time.sleep(2.0)  # past its start-up passes
        idle_cmds = commands_during(p.client, lambda: time.sleep(idle_s))
        ctx.stop(beat)
    ctx.stop_redis(server)

    idle_rate = idle_cmds / idle_s
    for path, name in PAGES:
        p50, p99 = percentile(times[path], 50), percentile(times[path], 99)
        result.lines.append(Line(f"web: {name} ({path}), {n:,} pending, p50", p50, "ms"))
        result.lines.append(Line(f"web: {name} ({path}), {n:,} pending, p99", p99, "ms",
                                 target=f"<={TARGET_MS:g}", on="ours"))
    overview = per_load["/"] / REFRESH_S
    result.lines.append(Line(f"web: Redis commands/s of one open overview (refresh {REFRESH_S:g} s) vs "
                             "an idle beat", overview, "cmd/s", baseline=idle_rate))
    result.notes.append(
        f"{n:,} jobs pending, due over 24 h from 10 min on ({filled}); a lateness record in each of "
        f"the last 60 minutes; `celery -A bench.app delayq web` (waitress) in its own process; "
        f"{loads} GETs of each page one after the other on one keep-alive connection after {WARMUP} "
        "of warm-up, time to the last byte; page sizes "
        + ", ".join(f"{path} {sizes[path] / 1024:,.0f} KiB" for path, _ in PAGES)
    )
    result.notes.append(
        "Redis commands per load (INFO commandstats, commands inside scripts included): "
        + ", ".join(f"{path} {per_load[path]:,.1f}" for path, _ in PAGES)
        + f"; one open page refreshes every {REFRESH_S:g} s; the idle beat: {idle_cmds} commands in "
        f"{idle_s:.0f} s on the same server (its safety poll is every 20 s)"
    )
    return result

