"""Row ``web``: the dashboard with ``web_jobs`` (1,000,000) jobs pending.

``celery -A bench.app delayq web`` (waitress, in its own process) serves a store holding the
jobs, due over the next 24 hours from 10 minutes on, and a lateness record in each of the last
60 minutes.

Page times: over HTTP (one keep-alive connection, like a browser tab), ``web_requests`` loads
of each of the overview (``/``), ``/api/status`` and the first jobs page (``/jobs``), one at a
time after a warm-up, from a dashboard started with ``--refresh 0`` (nothing shared between
loads: every load reads Redis, the most a load costs): p50 and p99 of the time to the last
byte, against the issue's 200 ms.

The load on Redis of open overview pages, as browsers make it: a dashboard with the default
refresh (5 s); each page is loaded once (``GET /``), then asks ``GET /`` with
``X-Delayq-Live: 1`` every 5 s, as ``app.js`` does, each page on its own keep-alive
connection and at its own phase of the interval (tabs opened at different times). Over a
window of ``web_refreshes`` intervals (each page refreshes exactly that many times in it,
its first load before it), the server's own counters, read with one ``INFO`` at each end:
``total_commands_processed`` (the commands clients sent: a script call is one), the calls of
``INFO commandstats`` (the commands run inside scripts counted too) and ``used_cpu_user`` +
``used_cpu_sys`` (the server's CPU). Less the measure's own ``INFO``, over the window: the
commands/s of 1 open page and of 5, side by side, and the p50/p99 of their refreshes.

The charts' counts (a ``ZCOUNT`` a bucket and shard) are kept in Redis for 12 refresh intervals
(the next hour) and 60 (the next 24 hours): a window of a few refreshes would hold one count
of them or none by chance. So the window starts with the kept counts deleted (its first
refresh counts both charts, once), and besides the window's own figure the row prints the
steady state of the same pages: the window's commands less that count of both charts (measured
on its own through the same ``Store.due_count_series``), plus each chart's count (measured the
same way, with the ``SET`` that keeps it) over its period; that figure against issue 26's
50 commands/s and against what one open page ran before (:data:`BEFORE_CMDS`).
Beside it, an idle beat on the same store and server: the calls/s it makes over ``idle``
seconds, counted the same way as the commandstats figure (the ``idle_beat`` row counts with
``MONITOR``, which leaves out the commands inside scripts).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .harness import Context, fill, percentile, producer, wait_until, wake_channel
from .report import Line, RowResult
from .resources import Monitor, commandstats, server_delta

#: Seconds the fill may take through apply_at_many before it switches to the fast path.
FILL_BUDGET = 5.0
#: The p99 the issue asks of each page with 1M pending.
TARGET_MS = 200.0
#: The dashboard's live refresh interval (``--refresh``, ``web.context.REFRESH_SECONDS``).
REFRESH_S = 5.0
PAGES = (("/", "overview"), ("/api/status", "/api/status"), ("/jobs", "first jobs page"))
WARMUP = 3
#: Open overview pages counted together (besides one alone).
MANY_PAGES = 5
#: What a page's live refresh sends (``app.js``: ``fetch(location.href, {headers: ...})``).
LIVE = {"X-Delayq-Live": "1", "Accept": "*/*"}
#: The most commands/s one open overview may cost the server (issue 26).
TARGET_CMDS = 50.0
#: Commands/s the server ran (inside scripts included) for 1 open overview before issue 26's
#: change, measured at 7614b5f by ``python -m bench --quick --only web`` (each refresh
#: counted both charts: a ZCOUNT a bucket and shard, 1,623 commands a refresh).
BEFORE_CMDS = 324.6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One keep-alive HTTP connection to the dashboard: ``get(path)`` -> (status, ms to last byte)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> tuple[int, float, int]:
        t0 = time.perf_counter()
        try:
            self.conn.request("GET", path, headers=dict(headers or {"Accept": "text/html"}))
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


def cpu_s(client: Any) -> float:
    """The server's CPU so far: ``used_cpu_user`` + ``used_cpu_sys`` of ``INFO cpu``."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@dataclass(frozen=True)
class PagesLoad:
    """What ``pages`` open overview pages cost the server over ``seconds``."""

    pages: int
    seconds: float
    sent: Counter[str]  # commands clients sent (MONITOR), by name: a script call counts once
    ran: Counter[str]  # commands the server ran (INFO commandstats), inside scripts included
    cpu_s: float  # used_cpu_user + used_cpu_sys of the server
    refreshes: list[float]  # ms to the last byte of each live refresh in the window
    #: What one count of each chart runs (its ``due_count_series`` and the SET that keeps it),
    #: and the seconds it is kept: each chart is counted once in the window (its kept counts
    #: deleted as the window starts), and once in its period in the steady state.
    charts: dict[str, tuple[int, float]]
    #: What the count of both charts at once (as the first refresh of the window does: one
    #: script a shard for both) runs, with the SETs that keep them.
    both_charts: int

    @property
    def sent_per_s(self) -> float:
        return sum(self.sent.values()) / self.seconds

    @property
    def ran_per_s(self) -> float:
        return sum(self.ran.values()) / self.seconds

    @property
    def steady_per_s(self) -> float:
        """Commands/s run with open pages in the steady state: the window less the one count of
        each chart in it, plus each chart's count once in its period."""
        return (sum(self.ran.values()) - self.both_charts) / self.seconds + sum(
            cost / period for cost, period in self.charts.values()
        )

    @property
    def cpu_ms_per_s(self) -> float:
        return self.cpu_s * 1000.0 / self.seconds


def chart_costs(client: Any, store: Any, refresh_s: float) -> tuple[dict[str, tuple[int, float]], int]:
    """What one count of each chart of the overview runs on the server (``INFO commandstats``:
    its ``due_count_series`` and the ``SET`` that keeps it) and the seconds it is kept; and
    what counting all of them at once runs (one script a shard for all, a SET each)."""
    from celery_delayq.web.context import CHART_REFRESHES
    from celery_delayq.web.overview import CHARTS

    now = store.server_now_ms()
    each = {
        name: (
            commands_during(client, lambda series=series: store.due_count_series([(now, *series)])) + 1,
            CHART_REFRESHES[name] * refresh_s,
        )
        for name, series in CHARTS.items()
    }
    every = [(now, *series) for series in CHARTS.values()]
    return each, commands_during(client, lambda: store.due_count_series(every)) + len(every)


def open_pages(
    client: Any,
    redis_port: int,
    port: int,
    pages: int,
    refresh_s: float,
    refreshes: int,
    charts: dict[str, tuple[int, float]],
    both_charts: int,
    chart_keys: list[str],
) -> PagesLoad:
    """``pages`` browsers each open the overview (one full load), then refresh it live every
    ``refresh_s`` seconds, page ``i`` at ``(i + 0.5) / pages`` of the interval. The first round
    of refreshes is a warm-up; the server's counters are read over the ``refreshes`` intervals
    that follow (each page refreshes exactly ``refreshes`` times in them). The window starts
    with the charts' kept counts (``chart_keys``) deleted: the first refresh in it counts each
    chart once, as the steady state does once in each chart's period (``charts``)."""
    browsers = [Browser(port) for _ in range(pages)]
    for browser in browsers:
        status = browser.get("/")[0]
        if status != 200:
            raise RuntimeError(f"GET / answered {status}")
    took: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    start = time.monotonic() + 0.5
    counted = start + refresh_s  # after the warm-up round

    def poll(i: int, browser: Browser) -> None:
        for k in range(refreshes + 1):
            at = start + (i + 0.5) * refresh_s / pages + k * refresh_s
            time.sleep(max(0.0, at - time.monotonic()))
            status, ms, _ = browser.get("/", LIVE)
            with lock:
                if k:
                    took.append(ms)
                if status != 200:
                    failed.append(f"live GET / answered {status}")

    threads = [threading.Thread(target=poll, args=(i, b), daemon=True) for i, b in enumerate(browsers)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, counted - time.monotonic()))
    cpu0, ran0 = cpu_s(client), commandstats(client)
    monitor = Monitor(redis_port)
    client.delete(*chart_keys)
    time.sleep(max(0.0, counted + refreshes * refresh_s - time.monotonic()))
    ran1, cpu1 = commandstats(client), cpu_s(client)
    monitor.stop()
    for thread in threads:
        thread.join(60)
    for browser in browsers:
        browser.close()
    if failed:
        raise RuntimeError(failed[0])
    sent = +(monitor.counts - Counter(INFO=monitor.counts["INFO"], DEL=1))  # the measure's own
    ran = server_delta(ran0, ran1)
    ran["INFO"] -= 1  # the cpu INFO between the two commandstats
    ran["DEL"] -= 1  # the kept charts deleted as the window starts
    if sent["SET"] != len(chart_keys):
        raise RuntimeError(f"the charts were counted {sent['SET']} times in the window, not once each")
    return PagesLoad(pages, refreshes * refresh_s, sent, +ran, cpu1 - cpu0, took, charts, both_charts)


def top(counts: Counter[str], per: float, n: int = 6) -> str:
    """The ``n`` commands most counted, each as its count divided by ``per``."""
    return ", ".join(f"{name} {count / per:,.1f}" for name, count in counts.most_common(n)) or "none"


def row_web(ctx: Context) -> RowResult:
    result = RowResult("web")
    sz = ctx.sizes
    n, loads = sz.web_jobs, sz.web_requests
    # The dashboard's default refresh, but 1 s in the smoke run (its figures compare with nothing;
    # the two open-pages windows take 4 s in all instead of 20).
    refresh_s = 1.0 if ctx.mode == "smoke" else REFRESH_S
    server = ctx.redis()
    url = server.url + "/0"
    with producer(url, url) as p:
        from celery_delayq.store.facade import get_store
        from celery_delayq.store.lateness import key_for, tally

        start = time.time() + 600
        spread = 86_400.0 / n
        ctx.say(f"web: storing {n:,} jobs due over 24 h")
        filled = fill(p, n, lambda i: start + i * spread, FILL_BUDGET).method
        store = get_store(p.app)
        minute = store.server_now_ms() // 60_000
        for back in range(60):  # a beat and workers recording lateness through the last hour
            for kind in ("publish", "start"):
                store.add_lateness(key_for("delayq", kind), tally([1.5, 3, 3, 7, 40]), minute=minute - back)

        def serve(*args: str) -> tuple[Any, int]:
            port = _free_port()
            web = ctx.start_web(url, port, *args)
            probe = Browser(port)

            def answers() -> bool:
                try:
                    return probe.get("/")[0] == 200
                except (OSError, http.client.HTTPException):
                    return False

            wait_until(answers, 60, 0.2, [web], "the dashboard did not answer")
            probe.close()
            return web, port

        web, port = serve("--refresh", "0")  # nothing shared between loads: each one reads
        browser = Browser(port)
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

        web, port = serve("--refresh", f"{refresh_s:g}")  # as `delayq web` runs (but in --smoke)
        charts, both_charts = chart_costs(p.client, store, refresh_s)
        chart_keys = [store.keys.web_counts(name) for name in charts]
        opened: dict[int, PagesLoad] = {}
        for pages in (1, MANY_PAGES):
            ctx.say(f"web: {pages} open overview page(s), {sz.web_refreshes} refreshes of {refresh_s:g} s")
            opened[pages] = open_pages(
                p.client,
                server.port,
                port,
                pages,
                refresh_s,
                sz.web_refreshes,
                charts,
                both_charts,
                chart_keys,
            )
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
        result.lines.append(Line(f"web: {name} ({path}), {n:,} pending, read at each load, p50", p50, "ms"))
        result.lines.append(
            Line(
                f"web: {name} ({path}), {n:,} pending, read at each load, p99",
                p99,
                "ms",
                target=f"<={TARGET_MS:g}",
                on="ours",
            )
        )
    one, many = opened[1], opened[MANY_PAGES]
    every = f"refresh {refresh_s:g} s"
    result.lines.append(
        Line(
            f"web: Redis commands/s sent, 1 open overview ({every})",
            one.sent_per_s,
            "cmd/s",
            target=f"<={TARGET_CMDS:g}",
            on="ours",
        )
    )
    result.lines.append(
        Line(
            f"web: Redis commands/s sent, {MANY_PAGES} open overviews vs 1",
            many.sent_per_s,
            "cmd/s",
            baseline=one.sent_per_s,
        )
    )
    periods = " / ".join(f"{period:g} s" for _, period in one.charts.values())
    result.lines.append(
        Line(
            f"web: Redis commands/s run (scripts' too), 1 open overview ({every}, charts counted "
            f"every {periods}) vs before (7614b5f)",
            one.steady_per_s,
            "cmd/s",
            baseline=BEFORE_CMDS,
            target=f"<={TARGET_CMDS:g}",
            on="ours",
        )
    )
    result.lines.append(
        Line(
            f"web: Redis commands/s run (scripts' too), 1 open overview, the window counting both charts "
            f"once ({one.seconds:g} s) vs an idle beat",
            one.ran_per_s,
            "cmd/s",
            baseline=idle_rate,
        )
    )
    result.lines.append(
        Line(
            f"web: Redis commands/s run (scripts' too), {MANY_PAGES} open overviews vs 1 (charts amortized)",
            many.steady_per_s,
            "cmd/s",
            baseline=one.steady_per_s,
        )
    )
    result.lines.append(
        Line(
            f"web: Redis server CPU, {MANY_PAGES} open overviews vs 1",
            many.cpu_ms_per_s,
            "ms/s",
            baseline=one.cpu_ms_per_s,
        )
    )
    for load in (one, many):
        result.lines.append(
            Line(
                f"web: live refresh of the overview, {load.pages} open, p50",
                percentile(load.refreshes, 50),
                "ms",
            )
        )
        result.lines.append(
            Line(
                f"web: live refresh of the overview, {load.pages} open, p99",
                percentile(load.refreshes, 99),
                "ms",
                target=f"<={TARGET_MS:g}",
                on="ours",
            )
        )
    result.notes.append(
        f"{n:,} jobs pending, due over 24 h from 10 min on ({filled}); a lateness record in each of "
        f"the last 60 minutes; `celery -A bench.app delayq web` (waitress) in its own process; "
        f"page times: `--refresh 0` (every load reads Redis), {loads} GETs of each page one after "
        f"the other on one keep-alive connection after {WARMUP} of warm-up, time to the last byte; "
        "page sizes " + ", ".join(f"{path} {sizes[path] / 1024:,.0f} KiB" for path, _ in PAGES)
    )
    result.notes.append(
        "Redis commands per load read at each load (INFO commandstats, commands inside scripts "
        "included): " + ", ".join(f"{path} {per_load[path]:,.1f}" for path, _ in PAGES)
    )
    for load in (one, many):
        result.notes.append(
            f"{load.pages} open overview(s), a refresh of {refresh_s:g} s (the default "
            f"{REFRESH_S:g} s but in --smoke): each page loaded once, "
            f"then refreshed live (X-Delayq-Live) at its own phase; over {sz.web_refreshes} refreshes "
            f"({load.seconds:g} s) after a warm-up one, per refresh interval: sent (MONITOR) "
            f"{sum(load.sent.values()) / sz.web_refreshes:,.1f} ({top(load.sent, sz.web_refreshes)}); run "
            f"(INFO commandstats) {sum(load.ran.values()) / sz.web_refreshes:,.1f} "
            f"({top(load.ran, sz.web_refreshes)}); server CPU {load.cpu_s * 1000 / sz.web_refreshes:,.1f} ms"
        )
    result.notes.append(
        "one count of each chart of the overview (its due_count_series, one script a shard with a "
        "ZCOUNT a bucket in it, and the SET that keeps it for every dashboard), INFO commandstats: "
        + ", ".join(
            f"{name} {cost:,} commands, kept {period:g} s" for name, (cost, period) in one.charts.items()
        )
        + f"; both at once {one.both_charts:,} (the first refresh of the window); the steady figure is "
        "the window's commands less both charts counted at once, over the window, plus each chart's "
        "count over its period"
    )
    result.notes.append(
        f"the idle beat: {idle_cmds} commands run in {idle_s:.0f} s on the same server (its safety poll "
        "is every 20 s)"
    )
    return result
