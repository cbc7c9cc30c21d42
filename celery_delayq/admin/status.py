"""The status view: shards, beats and lateness, what ``delayq status --json`` prints and the
dashboard's overview and ``/api/status`` serve.
"""

from __future__ import annotations

import math
from typing import Any

from ..store import lateness
from ..store.facade import Store
from ..store.reads import ShardStats
from .views import bucket_ms, iso

__all__ = [
    "BEAT_ALIVE_MS",
    "GATED_BY",
    "beat_view",
    "gated_counts",
    "lateness_view",
    "lateness_window_view",
    "shard_view",
    "status_view",
    "stored_lateness",
]

#: A beat whose heartbeat is older than this (ms) is shown as stale.
BEAT_ALIVE_MS = 60_000


def stored_lateness(store: Store, kind: str) -> lateness.Snapshot:
    """The ``kind`` (``publish``: the beats', ``start``: the workers', ``gated``: the time flow
    control held jobs back, from the beats) lateness histogram in Redis."""
    return lateness.read(store, store.config.prefix, kind)


def lateness_view(snap: lateness.Snapshot) -> dict[str, Any]:
    """A lateness histogram: count, mean, p50, p99 (bucket bounds, ms) and its buckets."""

    def finite(v: float | None) -> float | None:
        return v if v is not None and math.isfinite(v) else None

    return {
        "count": snap.count,
        "mean_ms": round(snap.mean_ms, 3) if snap.mean_ms is not None else None,
        "p50_ms": finite(snap.quantile(0.5)),
        "p99_ms": finite(snap.quantile(0.99)),
        "buckets": [
            {"le_ms": bound if math.isfinite(bound) else None, "count": n}
            for bound, n in zip((*lateness.BOUNDS, math.inf), snap.buckets, strict=True)
        ],
    }


def lateness_window_view(
    store: Store, kind: str, minutes: int = lateness.WINDOW_MINUTES, now_ms: int | None = None
) -> dict[str, Any]:
    """:func:`lateness_view` of the ``kind`` histogram over the last ``minutes`` minutes (the
    per-minute record, :func:`..store.lateness.read_window`; ``now_ms`` defaults to the server's now):
    the same shape."""
    return lateness_view(lateness.read_window(store, store.config.prefix, kind, minutes, now_ms))


def beat_view(token: str, raw: Any, now_ms: int) -> dict[str, Any]:
    """One beat's heartbeat: who, since when, last seen, counters, alive (seen in the last 60 s)."""
    entry = raw if isinstance(raw, dict) else {}
    keys = ("host", "pid", "started_ms", "seen_ms", "passes", "published", "dead_lettered", "errors")
    out: dict[str, Any] = {"token": token, **{k: entry.get(k) for k in keys}}
    seen = entry.get("seen_ms")
    seen_ok = isinstance(seen, int | float) and not isinstance(seen, bool)
    out["alive"] = bool(seen_ok and now_ms - float(seen or 0) <= BEAT_ALIVE_MS)
    out["seen"] = iso(seen) if seen_ok else None
    started = entry.get("started_ms")
    out["started"] = (
        iso(started) if isinstance(started, int | float) and not isinstance(started, bool) else None
    )
    if not isinstance(raw, dict):
        out["error"] = f"unreadable heartbeat {str(raw)[:60]!r}"
    return out


#: Why a gated job waits, as ``status --json`` counts them (``gated_by``) and ``show --json``
#: names a job's (``gated_by``), with the words every page and the CLI use for each.
GATED_BY = {
    "slot": "waiting for a slot",
    "paused": "key paused",
    "batch": "batch not complete",
    "rate": "deferred by rate",
}


def gated_counts(st: ShardStats) -> dict[str, int]:
    """A shard's gated jobs by what they wait for (the keys of :data:`GATED_BY`)."""
    return {"slot": st.gated_slot, "paused": st.gated_paused, "batch": st.gated_batch, "rate": st.gated_rate}


def shard_view(st: ShardStats) -> dict[str, Any]:
    """One shard's counts, oldest overdue and next due job."""
    return {
        "shard": st.shard,
        "waiting": st.waiting,
        "leased": st.leased,
        "running": st.running,
        "gated": st.gated,
        "gated_by": gated_counts(st),
        "dead": st.dead,
        "overdue": st.overdue,
        "oldest_overdue": iso(st.head_due_ms),
        "oldest_overdue_ms": st.head_due_ms,
        "oldest_overdue_id": st.head_id,
        "next_due": iso(st.next_due_ms),
        "next_due_ms": st.next_due_ms,
        "next_due_id": st.next_id,
        "schedules": st.schedules,
    }


def status_view(store: Store, url: str, window_ms: int = 3_600_000) -> dict[str, Any]:
    """``delayq status --json``: shards, totals, beats, lateness, and the jobs due in each
    bucket (:func:`bucket_ms`) of the next ``window_ms``. ``url`` is shown as given: pass it
    redacted (``config.redact_url``)."""
    stats = store.shard_stats()
    now = stats[0].now_ms
    bucket = bucket_ms(window_ms)
    buckets = math.ceil(window_ms / bucket) if window_ms else 0
    counts = store.due_counts(now, bucket, buckets)
    beats = sorted(
        (beat_view(token, raw, now) for token, raw in store.beats().items()),
        key=lambda b: (not b["alive"], -(b["seen_ms"] or 0) if isinstance(b["seen_ms"], int | float) else 0),
    )
    late = {kind: lateness_view(stored_lateness(store, kind)) for kind in lateness.KINDS}
    heads = [st for st in stats if st.head_due_ms is not None]
    nexts = [st for st in stats if st.next_due_ms is not None]
    oldest = min(heads, key=lambda st: st.head_due_ms or 0) if heads else None
    soonest = min(nexts, key=lambda st: st.next_due_ms or 0) if nexts else None
    totals = {
        "waiting": sum(st.waiting for st in stats),
        "leased": sum(st.leased for st in stats),
        "running": sum(st.running for st in stats),
        "gated": sum(st.gated for st in stats),
        "gated_by": {name: sum(gated_counts(st)[name] for st in stats) for name in GATED_BY},
        "dead": sum(st.dead for st in stats),
        "overdue": sum(st.overdue for st in stats),
        "schedules": sum(st.schedules for st in stats),
        "oldest_overdue": iso(oldest.head_due_ms) if oldest else None,
        "oldest_overdue_ms": oldest.head_due_ms if oldest else None,
        "oldest_overdue_id": oldest.head_id if oldest else None,
        "next_due": iso(soonest.next_due_ms) if soonest else None,
        "next_due_ms": soonest.next_due_ms if soonest else None,
        "next_due_id": soonest.next_id if soonest else None,
    }
    return {
        "prefix": store.config.prefix,
        "url": url,
        "now": iso(now),
        "now_ms": now,
        "shards": [shard_view(st) for st in stats],
        "totals": totals,
        "beats": beats,
        "lateness": late,
        "due": {"start": iso(now), "bucket_seconds": bucket // 1000, "counts": counts},
    }
