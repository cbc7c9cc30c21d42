"""The overview: pending jobs by shard, what falls due in the next hour (per minute) and the next
24 hours (per hour), the oldest overdue job, the beats and their heartbeats, the lateness
histograms of the last hour (all-time p50/p99 beside them), the dead letters. ``/api/status``
is ``celery delayq status --json`` plus ``due_24h`` and ``lateness_last_hour`` (the per-minute
record of :mod:`celery_delayq.store.lateness`, summed over the last 60 minutes).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, render_template

from ..admin.views import GATED_BY, lateness_view, status_view
from ..store import lateness
from .charts import bar_chart
from .context import dashboard

__all__ = ["bp", "overview_view"]

bp = Blueprint("overview", __name__)

#: The next hour, per minute; the next 24 hours, per hour.
HOUR_MS = 3_600_000
DAY_BUCKETS = 24


def overview_view() -> dict[str, Any]:
    """``status --json`` (a one-hour window, per minute), the next 24 h per hour and the
    lateness histograms of the last hour: read once for every open page of the process in
    :attr:`.Dashboard.shared`'s age (shared: not to be changed)."""
    board = dashboard()
    return board.shared.get("overview", _read_overview)


def _read_overview() -> dict[str, Any]:
    board = dashboard()
    view = status_view(board.store, board.url, HOUR_MS)
    now = view["now_ms"]
    counts = board.store.due_counts(now, HOUR_MS, DAY_BUCKETS)
    view["due_24h"] = {"start": view["now"], "bucket_seconds": HOUR_MS // 1000, "counts": counts}
    store, window = board.store, lateness.WINDOW_MINUTES
    view["lateness_last_hour"] = {
        kind: lateness_view(board.lateness.read_window(store, store.config.prefix, kind, window, now))
        for kind in lateness.KINDS
    }
    return view


@bp.get("/api/status")
def api_status() -> Any:
    return jsonify(overview_view())


@bp.get("/")
def overview() -> str:
    board = dashboard()
    view = overview_view()
    now = view["now_ms"]
    minute = view["due"]["bucket_seconds"] * 1000
    hour_counts = view["due"]["counts"]
    day_counts = view["due_24h"]["counts"]
    charts = {
        "hour": bar_chart(
            hour_counts,
            [board.hhmm(now + i * minute) for i in range(len(hour_counts))],
            "jobs due per minute, next hour",
            label_every=10,
        ),
        "day": bar_chart(
            day_counts,
            [board.hhmm(now + i * HOUR_MS) for i in range(len(day_counts))],
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
            f"due → {kind} lateness in the last hour, jobs per bucket",
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
