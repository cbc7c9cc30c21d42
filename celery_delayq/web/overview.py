"""The overview: pending jobs by shard, what falls due in the next hour (per minute) and the next
24 hours (per hour), the oldest overdue job, the beats and their heartbeats, the lateness
histograms of the last hour (all-time p50/p99 beside them), the dead letters. ``/api/status``
is ``celery delayq status --json`` plus ``due_24h`` and ``lateness_last_hour`` (the per-minute
record of :mod:`celery_delayq.store.lateness`, summed over the last 60 minutes).
"""

from __future__ import annotations

import math
from typing import Any

from flask import Blueprint, jsonify, render_template

from ..admin.status import GATED_BY, lateness_view, status_view
from ..admin.views import bucket_ms, iso
from ..store import lateness
from .charts import bar_chart
from .context import dashboard

__all__ = ["bp", "chart_counts", "overview_view"]

bp = Blueprint("overview", __name__)

#: The next hour, per minute; the next 24 hours, per hour.
HOUR_MS = 3_600_000
DAY_BUCKETS = 24


def overview_view() -> dict[str, Any]:
    """``status --json`` (a one-hour window, per minute), the next 24 h per hour and the
    lateness histograms of the last hour: read once for every open page of the process in
    :attr:`.Dashboard.shared`'s age (shared: not to be changed). The two charts' counts are
    read at most once in :attr:`.Dashboard.chart_seconds` for every dashboard process
    (:func:`chart_counts`); each says the time it starts at (``start``, ``start_ms``)."""
    board = dashboard()
    return board.shared.get("overview", _read_overview)


def _read_overview() -> dict[str, Any]:
    board = dashboard()
    view = status_view(board.store, board.url, 0)  # its due counts: chart_counts' "hour"
    now = view["now_ms"]
    charts = chart_counts(now)
    view["due"], view["due_24h"] = charts["hour"], charts["day"]
    store, window = board.store, lateness.WINDOW_MINUTES
    view["lateness_last_hour"] = {
        kind: lateness_view(board.lateness.read_window(store, store.config.prefix, kind, window, now))
        for kind in lateness.KINDS
    }
    return view


#: Each chart's buckets: span ms, how many.
CHARTS = {
    "hour": (bucket_ms(HOUR_MS), math.ceil(HOUR_MS / bucket_ms(HOUR_MS))),
    "day": (HOUR_MS, DAY_BUCKETS),
}


def chart_counts(now_ms: int) -> dict[str, dict[str, Any]]:
    """The jobs due in each bucket of each chart of :data:`CHARTS` from ``now_ms``: what is kept
    in Redis (:meth:`.Store.kept_counts`: a ``GET`` each) when a dashboard read it less than
    :attr:`.Dashboard.chart_seconds` ago, else read now (:meth:`.Store.due_count_series`: one
    script a shard for every chart read) and kept. Each: ``{"start", "start_ms",
    "bucket_seconds", "counts"}``, ``start_ms`` the time it was read from."""
    board = dashboard()
    names = list(CHARTS)
    ages = board.chart_seconds
    kept = board.store.kept_counts([n for n in names if ages[n] > 0])
    out: dict[str, dict[str, Any]] = {}
    for name, value in zip([n for n in names if ages[n] > 0], kept, strict=True):
        span_ms, buckets = CHARTS[name]
        if _is_chart(value, span_ms, buckets):
            out[name] = value  # type: ignore[assignment]
    missing = [name for name in names if name not in out]
    if missing:
        series = [(now_ms, *CHARTS[name]) for name in missing]
        for name, counts in zip(missing, board.store.due_count_series(series), strict=True):
            span_ms = CHARTS[name][0]
            out[name] = {
                "start": iso(now_ms),
                "start_ms": now_ms,
                "bucket_seconds": span_ms // 1000,
                "counts": counts,
            }
            if ages[name] > 0:
                board.store.keep_counts(name, out[name], max(1, round(ages[name] * 1000)))
    return {name: out[name] for name in names}


def _is_chart(value: Any, span_ms: int, buckets: int) -> bool:
    """Whether ``value`` (kept in Redis) reads as a chart of ``buckets`` spans of ``span_ms``."""
    if not isinstance(value, dict) or value.get("bucket_seconds") != span_ms // 1000:
        return False
    counts, start = value.get("counts"), value.get("start_ms")
    return (
        isinstance(start, int)
        and isinstance(value.get("start"), str)
        and isinstance(counts, list)
        and len(counts) == buckets
        and all(isinstance(n, int) for n in counts)
    )


@bp.get("/api/status")
def api_status() -> Any:
    return jsonify(overview_view())


@bp.get("/")
def overview() -> str:
    board = dashboard()
    view = overview_view()
    now = view["now_ms"]
    hour, day = view["due"], view["due_24h"]
    minute = hour["bucket_seconds"] * 1000
    hour_counts, day_counts = hour["counts"], day["counts"]
    charts = {
        "hour": bar_chart(
            hour_counts,
            [board.hhmm(hour["start_ms"] + i * minute) for i in range(len(hour_counts))],
            "jobs due per minute, next hour",
            label_every=10,
        ),
        "day": bar_chart(
            day_counts,
            [board.hhmm(day["start_ms"] + i * HOUR_MS) for i in range(len(day_counts))],
            "jobs due per hour, next 24 hours",
            label_every=3,
        ),
    }
    for kind in lateness.KINDS:
        buckets = view["lateness_last_hour"][kind]["buckets"]
        labels = [_bound(b["le_ms"]) for b in buckets]
        charts[kind] = bar_chart(
            [b["count"] for b in buckets],
            labels,
            f"due → {kind} lateness in the last hour, jobs per bucket"
            if kind != "gated"
            else "time held back by flow control in the last hour, jobs per bucket",
            height=110,
            label_every=2,
        )
    shards = [
        s for s in view["shards"] if s["waiting"] or s["leased"] or s["running"] or s["gated"] or s["dead"]
    ]
    return render_template(
        "overview.html", view=view, charts=charts, shards=shards, now=now, gated_by=GATED_BY
    )


def _bound(le_ms: float | None) -> str:
    """A histogram bucket's upper bound as a label: ``≤5ms``, ``≤2.5s``, ``>300s``.

    >>> _bound(5), _bound(2500), _bound(None)
    ('≤5ms', '≤2.5s', '>300s')
    """
    if le_ms is None:
        return f">{lateness.BOUNDS[-1] / 1000:g}s"
    return f"≤{le_ms:g}ms" if le_ms < 1000 else f"≤{le_ms / 1000:g}s"
