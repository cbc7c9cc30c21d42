"""``status``: the shards' counts, the beats' heartbeats, the lateness histograms and a chart of
the jobs due soon; with the views (JSON) of each.
"""

from __future__ import annotations

import math
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from .. import lateness
from ..store import ShardStats, Store
from .base import Session, json_option, session
from .errors import usage
from .render import ago, bucket_ms, chart_lines, iso, listing, plain_row, relative
from .timeparse import parse_duration

__all__ = ["BEAT_ALIVE_MS", "SHARD_ROWS", "status", "stored_lateness"]

#: A beat whose heartbeat is older than this (ms) is shown as stale.
BEAT_ALIVE_MS = 60_000
#: Most rows of the per-shard table before only the shards holding something are shown.
SHARD_ROWS = 32


def stored_lateness(store: Store, kind: str) -> lateness.Snapshot:
    """The ``kind`` (``publish``: the beats', ``start``: the workers') lateness histogram in Redis.

    The CLI's one read of Redis that does not go through a ``Store`` method (yet)."""
    return lateness.read(store, store.config.prefix, kind)


def _lateness_view(snap: lateness.Snapshot) -> dict[str, Any]:
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


def _beat_view(token: str, raw: Any, now_ms: int) -> dict[str, Any]:
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


def _shard_view(st: ShardStats) -> dict[str, Any]:
    return {
        "shard": st.shard,
        "waiting": st.waiting,
        "leased": st.leased,
        "dead": st.dead,
        "overdue": st.overdue,
        "oldest_overdue": iso(st.head_due_ms),
        "oldest_overdue_id": st.head_id,
        "next_due": iso(st.next_due_ms),
        "next_due_id": st.next_id,
        "schedules": st.schedules,
    }


@click.command("status", short_help="Shards, beats, lateness, jobs due soon.")
@click.option(
    "--window", default="1h", show_default=True, metavar="DURATION",
    help="How far ahead the chart of jobs due looks (30m, 1h, 6h, 1d; 0: no chart).",
)  # fmt: skip
@click.option("--all-shards", is_flag=True, help=f"One row per shard even past {SHARD_ROWS} shards.")
@json_option
@click.pass_context
def status(ctx: click.Context, window: str, all_shards: bool, as_json: bool) -> None:
    """Shards, totals, beats, lateness, and a chart of the jobs due soon."""
    s = session(ctx)
    try:
        window_ms = parse_duration(window)
    except ValueError as exc:
        usage(f"--window: {exc}")
    if window_ms < 0 or window_ms > 31 * 86_400_000:
        usage(f"--window must be between 0 and 31d, got {window!r}")
    store = s.store
    stats = store.shard_stats()
    now = stats[0].now_ms
    bucket = bucket_ms(window_ms)
    buckets = math.ceil(window_ms / bucket) if window_ms else 0
    counts = store.due_counts(now, bucket, buckets)
    beats = sorted(
        (_beat_view(token, raw, now) for token, raw in store.beats().items()),
        key=lambda b: (not b["alive"], -(b["seen_ms"] or 0) if isinstance(b["seen_ms"], int | float) else 0),
    )
    late = {kind: _lateness_view(stored_lateness(store, kind)) for kind in ("publish", "start")}
    heads = [st for st in stats if st.head_due_ms is not None]
    nexts = [st for st in stats if st.next_due_ms is not None]
    oldest = min(heads, key=lambda st: st.head_due_ms or 0) if heads else None
    soonest = min(nexts, key=lambda st: st.next_due_ms or 0) if nexts else None
    totals = {
        "waiting": sum(st.waiting for st in stats),
        "leased": sum(st.leased for st in stats),
        "dead": sum(st.dead for st in stats),
        "overdue": sum(st.overdue for st in stats),
        "schedules": sum(st.schedules for st in stats),
        "oldest_overdue": iso(oldest.head_due_ms) if oldest else None,
        "oldest_overdue_id": oldest.head_id if oldest else None,
        "next_due": iso(soonest.next_due_ms) if soonest else None,
        "next_due_id": soonest.next_id if soonest else None,
    }
    if as_json:
        s.emit_json(
            {
                "prefix": store.config.prefix,
                "url": s.url,
                "now": iso(now),
                "shards": [_shard_view(st) for st in stats],
                "totals": totals,
                "beats": beats,
                "lateness": late,
                "due": {"start": iso(now), "bucket_seconds": bucket // 1000, "counts": counts},
            }
        )
        return
    console = s.console()
    header = Text.assemble(
        ("delayq", "bold"), " prefix ", (store.config.prefix, "bold"),
        f", {len(stats)} shards at {s.url} (server time {s.when(now)})",
    )  # fmt: skip
    console.print(header)
    console.print()
    _print_shards(s, console, stats, totals, now, all_shards)
    console.print()
    _print_beats(s, console, beats, now)
    console.print()
    _print_lateness(console, late)
    if buckets:
        console.print()
        total = sum(counts)
        unit = "minute" if bucket == 60_000 else f"{bucket // 60_000} minutes"
        console.print(
            f"[bold]Jobs due per {unit}[/], next {ago(window_ms)}: {total:,} "
            f"(peak {max(counts):,} per {unit})"
        )
        labels = [s.hhmm(now + i * bucket) for i in range(buckets)]
        for line in chart_lines(counts, labels):
            console.print(Text(line))


def _print_shards(
    s: Session, console: Console, stats: list[ShardStats], totals: dict[str, Any], now: int, all_shards: bool
) -> None:
    table = listing()
    for name in ("SHARD", "WAITING", "LEASED", "DEAD", "OVERDUE"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("OLDEST OVERDUE", no_wrap=True)
    table.add_column("NEXT DUE", no_wrap=True)
    rows = stats
    hidden = 0
    if len(stats) > SHARD_ROWS and not all_shards:
        rows = [st for st in stats if st.stored or st.dead]
        hidden = len(stats) - len(rows)

    def late(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({ago(now - ms)} late)"

    def soon(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({relative(ms, now)})"

    for st in rows:
        plain_row(
            table,
            str(st.shard), f"{st.waiting:,}", f"{st.leased:,}", f"{st.dead:,}", f"{st.overdue:,}",
            late(st.head_due_ms), soon(st.next_due_ms),
        )  # fmt: skip
    oldest = min((st.head_due_ms for st in stats if st.head_due_ms is not None), default=None)
    soonest = min((st.next_due_ms for st in stats if st.next_due_ms is not None), default=None)
    table.add_section()
    plain_row(
        table,
        "total", f"{totals['waiting']:,}", f"{totals['leased']:,}", f"{totals['dead']:,}",
        f"{totals['overdue']:,}", late(oldest), soon(soonest), style="bold",
    )  # fmt: skip
    console.print(table)
    if hidden:
        console.print(f"({hidden} empty shards not shown; --all-shards shows them)")
    console.print(f"recurring schedules: {totals['schedules']:,}")


def _print_beats(s: Session, console: Console, beats: list[dict[str, Any]], now: int) -> None:
    if not beats:
        console.print("[bold]Beats[/]: no beat seen")
        return
    alive = sum(1 for b in beats if b["alive"])
    console.print(f"[bold]Beats[/]: {alive} alive, {len(beats) - alive} stale (alive: seen in the last 60 s)")
    table = listing()
    for name in ("BEAT", "STATE", "SEEN", "UP", "PASSES", "PUBLISHED", "DEAD", "ERRORS"):
        table.add_column(
            name,
            no_wrap=True,
            justify="right" if name in ("PASSES", "PUBLISHED", "DEAD", "ERRORS") else "left",
        )

    def num(v: Any) -> str:
        return f"{v:,}" if isinstance(v, int) else "-"

    for b in beats:
        seen, started = b["seen_ms"], b["started_ms"]
        plain_row(
            table,
            b["token"],
            "alive" if b["alive"] else ("unreadable" if b.get("error") else "stale"),
            f"{ago(now - seen)} ago" if isinstance(seen, int | float) else "-",
            ago(now - started) if isinstance(started, int | float) else "-",
            num(b["passes"]), num(b["published"]), num(b["dead_lettered"]), num(b["errors"]),
        )  # fmt: skip
    console.print(table)


def _print_lateness(console: Console, late: dict[str, dict[str, Any]]) -> None:
    console.print("[bold]Lateness[/] (histogram buckets: p50 ≤ 5 ms means at most 5 ms)")

    def ms(v: float | None) -> str:
        if v is None:
            return f"> {lateness.BOUNDS[-1] / 1000:g} s"
        return f"≤ {v:g} ms" if v < 1000 else f"≤ {v / 1000:g} s"

    for kind, label in (("publish", "due → publish"), ("start", "due → start  ")):
        view = late[kind]
        n, mean = view["count"], view["mean_ms"]
        if not n:
            hint = "" if kind == "publish" else " (workers record it with delayq_record_lateness)"
            console.print(Text(f"  {label}  none recorded{hint}"))
            continue
        average = f"{mean:.1f} ms" if mean < 1000 else f"{mean / 1000:.2f} s"
        console.print(
            Text(
                f"  {label}  p50 {ms(view['p50_ms'])}  p99 {ms(view['p99_ms'])}  mean {average}  ({n:,} jobs)"
            )
        )


# -- schedules ----------------------------------------------------------------------------------
