"""What open dashboard pages cost Redis (issue 26), counted by the test server's own
``INFO commandstats``: the overview and the navigation counts are read once for every open page
for 4/5 of the refresh interval, and an action from a page is not hidden by it; the chart
buckets are one script a shard and the last hour's lateness reads again only the minutes that
may still change, with the same figures as the reads they replace."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.store import lateness
from celery_delayq.store.facade import get_store
from celery_delayq.store.lateness import WindowReader, key_for, tally
from celery_delayq.web import context
from celery_delayq.web.context import SharedReads
from tests.support.store import gate_due
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

#: What a page's live refresh sends (static/app.js).
LIVE = {"X-Delayq-Live": "1"}
#: A refresh interval long enough that nothing kept expires during a test (kept 48 s).
LONG = 60.0


def ran(r: redis.Redis) -> Counter[str]:
    """Calls of each command so far on the test server (inside scripts included), less INFO."""
    stats = r.info("commandstats")
    return Counter(
        {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"}
    )


def cost(r: redis.Redis, work: Callable[[], Any]) -> Counter[str]:
    """The commands the server ran while ``work()`` ran."""
    before = ran(r)
    work()
    return ran(r) - before


def some_jobs(app: Celery, n: int) -> list[str]:
    """``n`` jobs due in the middle of the minutes from 10 minutes on, one a minute: they stay
    in the same bucket of each chart while the clock moves a few seconds."""
    store = get_store(app)
    now_s = store.server_now_ms() / 1000
    return [app.tasks["t.add"].apply_at(now_s + 630 + 60 * i, args=(i, i)).id for i in range(n)]


def without_times(view: dict[str, Any]) -> dict[str, Any]:
    """``/api/status`` less what moves with the clock (now, the charts' start)."""
    out = {k: v for k, v in view.items() if k not in ("now", "now_ms")}
    out["due"] = {k: v for k, v in view["due"].items() if k not in ("start", "start_ms")}
    out["due_24h"] = {k: v for k, v in view["due_24h"].items() if k not in ("start", "start_ms")}
    return out


def test_a_second_page_in_the_window_costs_redis_nothing(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    some_jobs(app, 5)
    first = dashboard(refresh_seconds=LONG)
    read = cost(r, lambda: first.get("/"))
    assert read["evalsha"] >= 2 * 16  # the stats and the chart buckets, a script a shard each
    assert read["zcount"] >= 16 * (60 + 24)  # the buckets: one ZCOUNT each, inside the scripts
    assert read["zcard"] and read["hlen"]  # the navigation counts
    second = Client(first.base)
    again = cost(
        r, lambda: (second.get("/"), second.get("/", LIVE), first.get("/", LIVE), second.get("/api/status"))
    )
    assert again == Counter()

    uncached = dashboard(refresh_seconds=0)  # --refresh 0: nothing kept, each page reads
    uncached.get("/")
    assert cost(r, lambda: uncached.get("/", LIVE))["evalsha"] >= 2 * 16


def test_the_shared_page_shows_the_figures_a_fresh_read_shows(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    some_jobs(app, 60)
    store = get_store(app)
    minute = store.server_now_ms() // lateness.MINUTE_MS
    for back in range(0, 70, 7):  # the last hour, and older minutes outside it
        store.add_lateness(key_for("delayq", "publish"), tally([3, 40, 900]), minute=minute - back)
    shared = dashboard(refresh_seconds=LONG)
    fresh = dashboard(refresh_seconds=0)
    kept = shared.get("/api/status").json()
    assert sum(kept["due"]["counts"]) == 50  # due 10.5 to 59.5 min from now; 60.5 on: later
    assert sum(kept["due_24h"]["counts"]) == 60
    assert kept["lateness_last_hour"]["publish"]["count"] == 3 * 9
    assert without_times(shared.get("/api/status").json()) == without_times(fresh.get("/api/status").json())
    assert without_times(kept) == without_times(fresh.get("/api/status").json())


def test_an_action_from_a_page_shows_on_the_next_page(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    ids = some_jobs(app, 3)
    gate_due(app, r, "tenant:1", 3, limit=1)  # one runs, two wait for its slot
    client = dashboard(allow_actions=True, refresh_seconds=LONG)
    assert client.get("/api/status").json()["totals"]["waiting"] == 3
    assert 'id="total-waiting">3<' in client.get("/").text
    cancelled = client.action("/jobs/action", [("action", "cancel"), ("ids", ids[0])])
    assert cancelled.status == 303
    assert 'id="total-waiting">2<' in client.get("/").text  # the page the browser is sent to
    assert client.get("/api/status").json()["totals"]["waiting"] == 2
    assert 'id="nav-count-jobs">5<' in client.get("/jobs").text  # and the 3 gated ones

    refused = dashboard(refresh_seconds=LONG)  # read-only: its refused actions change nothing
    refused.get("/")
    assert refused.action("/jobs/action", [("action", "cancel"), ("ids", ids[1])]).status == 403
    assert refused.post("/jobs/action", {"action": "cancel", "ids": ids[1]}).status == 400  # no CSRF
    assert cost(r, lambda: refused.get("/", LIVE)) == Counter()  # still the reads it kept

    before = client.get("/api/status").json()["totals"]["gated_by"]
    assert before["paused"] == 0 and before["slot"] == 2
    assert client.api("/api/keys/action", {"action": "pause", "key": "tenant:1"}).status == 200
    after = client.get("/api/status").json()["totals"]["gated_by"]
    assert after["paused"] == 2 and after["slot"] == 0


def test_shared_reads_keep_a_read_for_their_age_and_forget_it_on_clear() -> None:
    now = [100.0]
    reads = SharedReads(4.0, clock=lambda: now[0])
    count = [0]

    def read() -> int:
        count[0] += 1
        return count[0]

    assert (reads.get("a", read), reads.get("a", read)) == (1, 1)
    now[0] += 3.9
    assert reads.get("a", read) == 1
    now[0] += 0.1  # 4 s after the read started: read again
    assert reads.get("a", read) == 2
    assert reads.get("b", read) == 3  # each name its own
    reads.clear()
    assert reads.get("a", read) == 4

    def read_across_an_action() -> int:
        reads.clear()  # an action ends while this read runs: what it read may be older
        return read()

    assert reads.get("c", read_across_an_action) == 5
    assert reads.get("c", read) == 6  # not kept
    assert SharedReads(0.0).get("a", read) == 7 and SharedReads(0.0).get("a", read) == 8


def test_the_chart_buckets_are_the_zcounts_they_replace(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    now = store.server_now_ms()
    start = now + 600_000
    add = app.tasks["t.add"]
    edges = [start, start + 59_999, start + 60_000, start + 3_600_000 - 1, start + 3_600_000, start - 1]
    for i, due in enumerate([*edges, start + 86_400_000 + 5]):
        add.apply_at(due / 1000, args=(i, i))
    hour, day = store.due_count_series([(start, 60_000, 60), (start, 3_600_000, 24)])
    direct = []
    for span, n in ((60_000, 60), (3_600_000, 24)):
        direct.append(
            [
                sum(int(r.zcount(shard.due, lo, f"({lo + span}")) for shard in store.keys.all_shards())
                for lo in (start + i * span for i in range(n))
            ]
        )
    assert [hour, day] == direct
    assert hour[:2] == [2, 1] and sum(hour) == 4 and day[:2] == [4, 1]
    assert store.due_counts(start, 60_000, 60) == hour
    assert store.due_counts(start, 60_000, 0) == [] and store.due_count_series([]) == []


def test_the_window_reader_sums_what_read_window_sums_and_reads_two_minutes_again(
    app: Celery, r: redis.Redis
) -> None:
    store = get_store(app)
    key = key_for("delayq", "start")
    now = store.server_now_ms()
    minute = now // lateness.MINUTE_MS
    for back in range(0, 60, 3):
        store.add_lateness(key, tally([2, 2, 30]), minute=minute - back)
    reader = WindowReader()
    first = cost(r, lambda: reader.read_window(store, "delayq", "start", now_ms=now))
    assert first["hgetall"] == lateness.WINDOW_MINUTES
    assert reader.read_window(store, "delayq", "start", now_ms=now) == lateness.read_window(
        store, "delayq", "start", now_ms=now
    )
    store.add_lateness(key, tally([7000]), minute=minute)  # a recorder's flush, this minute
    store.add_lateness(key, tally([9]), minute=minute - 1)  # a late one, the minute before
    again = cost(r, lambda: reader.read_window(store, "delayq", "start", now_ms=now))
    assert again["hgetall"] == lateness.OPEN_MINUTES
    snap = reader.read_window(store, "delayq", "start", now_ms=now)
    assert snap == lateness.read_window(store, "delayq", "start", now_ms=now)
    assert snap.count == 20 * 3 + 2
    later = now + 5 * lateness.MINUTE_MS  # five minutes on: five new minutes, and two read again
    assert cost(r, lambda: reader.read_window(store, "delayq", "start", now_ms=later))["hgetall"] == 7
    assert reader.read_window(store, "delayq", "start", now_ms=later) == lateness.read_window(
        store, "delayq", "start", now_ms=later
    )


def test_the_charts_are_counted_once_in_their_window_for_every_dashboard(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    some_jobs(app, 5)
    shards = len(get_store(app).keys.all_shards())
    first = dashboard(refresh_seconds=LONG)
    read = cost(r, lambda: first.get("/"))
    assert read["zcount"] >= shards * (60 + 24) and read["set"] == 2  # both charts, kept
    assert r.pttl("delayq:web:counts:hour") > (LONG * 11) * 1000  # 12 refreshes, less the read
    assert r.pttl("delayq:web:counts:day") > (LONG * 59) * 1000

    other = dashboard(refresh_seconds=LONG)  # another process: its own shared reads, no charts
    again = cost(r, lambda: other.get("/", LIVE))
    assert again["evalsha"] == shards and again["get"] == 2  # the stats only, and the kept charts
    assert again["zcount"] <= shards  # the stats' overdue count: no bucket counted
    assert again["set"] == 0
    assert without_times(other.get("/api/status").json()) == without_times(first.get("/api/status").json())


def test_the_charts_show_a_new_job_once_their_window_passes(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(context.CHART_REFRESHES, "hour", 4)
    monkeypatch.setitem(context.CHART_REFRESHES, "day", 4)
    some_jobs(app, 5)
    page = dashboard(refresh_seconds=0.25)  # the charts kept 1 s, the rest 0.2 s
    fresh = dashboard(refresh_seconds=0)
    kept = page.get("/api/status").json()
    assert sum(kept["due"]["counts"]) == sum(kept["due_24h"]["counts"]) == 5
    some_jobs(app, 1)  # one more, due 10.5 min from now
    shown = page.get("/api/status").json()  # counted before it, kept: the same charts
    assert (shown["due"], shown["due_24h"]) == (kept["due"], kept["due_24h"])
    # Kept in Redis for 4 refreshes (1 s): the window passes on the server (the keys expire now).
    chart_keys = [get_store(app).keys.web_counts(name) for name in ("hour", "day")]
    assert all(0 < r.pttl(key) <= 1000 for key in chart_keys)
    assert all(r.pexpire(key, 1) for key in chart_keys)

    def counted_anew() -> bool:
        view = page.get("/api/status").json()
        return bool(view["due"]["start_ms"] != kept["due"]["start_ms"])

    deadline = time.monotonic() + 10
    while not counted_anew():
        assert time.monotonic() < deadline, "the kept charts did not expire"
        time.sleep(0.1)
    after = page.get("/api/status").json()
    assert sum(after["due"]["counts"]) == sum(after["due_24h"]["counts"]) == 6
    now = fresh.get("/api/status").json()
    assert (after["due"]["counts"], after["due_24h"]["counts"]) == (
        now["due"]["counts"],
        now["due_24h"]["counts"],
    )
    assert 'id="chart-hour"' in page.get("/").text


def test_an_action_counts_the_charts_again(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    ids = some_jobs(app, 3)
    client = dashboard(allow_actions=True, refresh_seconds=LONG)
    assert sum(client.get("/api/status").json()["due"]["counts"]) == 3
    assert client.action("/jobs/action", [("action", "cancel"), ("ids", ids[0])]).status == 303
    assert r.exists("delayq:web:counts:hour", "delayq:web:counts:day") == 0
    view = client.get("/api/status").json()
    assert sum(view["due"]["counts"]) == sum(view["due_24h"]["counts"]) == 2


def test_a_kept_chart_that_does_not_read_is_counted_again(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    some_jobs(app, 2)
    r.set("delayq:web:counts:hour", "not json", px=600_000)
    r.set(
        "delayq:web:counts:day", '{"start":"x","start_ms":1,"bucket_seconds":3600,"counts":[1]}', px=600_000
    )
    view = dashboard(refresh_seconds=LONG).get("/api/status").json()
    assert sum(view["due"]["counts"]) == sum(view["due_24h"]["counts"]) == 2
    assert len(view["due"]["counts"]) == 60 and len(view["due_24h"]["counts"]) == 24


def test_the_stats_of_a_shard_without_lease_entries_read_no_gate_key(app: Celery, r: redis.Redis) -> None:
    store = get_store(app)
    some_jobs(app, 3)
    shards = len(store.keys.all_shards())
    read = cost(r, store.shard_stats)
    assert read["evalsha"] == shards
    assert not (read["smembers"] or read["hgetall"] or read["hexists"] or read["hget"])
    assert read["zcount"] == shards and read["zrange"] == shards  # nothing overdue: no head read
    assert sum(s.waiting for s in store.shard_stats()) == 3
