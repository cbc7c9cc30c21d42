"""``status``: the shards' counts, the beats' heartbeats, the lateness histograms and a chart of
the jobs due soon; with the views (JSON) of each.
"""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.text import Text

from ..admin.status import BEAT_ALIVE_MS, GATED_BY, status_view, stored_lateness
from ..store import lateness
from .base import Session, json_option, session
from .errors import usage
from .render import ago, chart_lines, listing, plain_row, relative
from .timeparse import parse_duration

__all__ = ["BEAT_ALIVE_MS", "SHARD_ROWS", "status", "stored_lateness"]

#: Most rows of the per-shard table before only the shards holding something are shown.
SHARD_ROWS = 32


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
    view = status_view(store, s.url, window_ms)
    if as_json:
        s.emit_json(view)
        return
    now, totals, beats, late = view["now_ms"], view["totals"], view["beats"], view["lateness"]
    stats, counts = view["shards"], view["due"]["counts"]
    bucket, buckets = view["due"]["bucket_seconds"] * 1000, len(counts)
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
    s: Session,
    console: Console,
    stats: list[dict[str, Any]],
    totals: dict[str, Any],
    now: int,
    all_shards: bool,
) -> None:
    table = listing()
    for name in ("SHARD", "WAITING", "LEASED", "RUNNING", "GATED", "DEAD", "OVERDUE"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("OLDEST OVERDUE", no_wrap=True)
    table.add_column("NEXT DUE", no_wrap=True)
    rows = stats
    hidden = 0
    if len(stats) > SHARD_ROWS and not all_shards:
        rows = [
            st for st in stats if st["waiting"] or st["leased"] or st["running"] or st["gated"] or st["dead"]
        ]
        hidden = len(stats) - len(rows)

    def late(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({ago(now - ms)} late)"

    def soon(ms: int | None) -> str:
        return "-" if ms is None else f"{s.when(ms)} ({relative(ms, now)})"

    for st in rows:
        plain_row(
            table,
            str(st["shard"]), f"{st['waiting']:,}", f"{st['leased']:,}", f"{st['running']:,}",
            f"{st['gated']:,}", f"{st['dead']:,}", f"{st['overdue']:,}", late(st["oldest_overdue_ms"]),
            soon(st["next_due_ms"]),
        )  # fmt: skip
    oldest, soonest = totals["oldest_overdue_ms"], totals["next_due_ms"]
    table.add_section()
    plain_row(
        table,
        "total", f"{totals['waiting']:,}", f"{totals['leased']:,}", f"{totals['running']:,}",
        f"{totals['gated']:,}", f"{totals['dead']:,}", f"{totals['overdue']:,}", late(oldest), soon(soonest),
        style="bold",
    )  # fmt: skip
    console.print(table)
    if hidden:
        console.print(f"({hidden} empty shards not shown; --all-shards shows them)")
    if totals["gated"]:
        why = ", ".join(f"{totals['gated_by'][name]:,} {label}" for name, label in GATED_BY.items())
        console.print(f"gated (held back by flow control; no beat holds them): {why}")
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


#: The lateness lines of ``status``: kind, label. A job flow control held back counts in
#: "due → publish" from when it was let go; how long it was held back is the "held back" line.
LATENESS_LINES = (("publish", "due → publish"), ("start", "due → start  "), ("gated", "held back    "))


def _print_lateness(console: Console, late: dict[str, dict[str, Any]]) -> None:
    console.print("[bold]Lateness[/] (histogram buckets: p50 ≤ 5 ms means at most 5 ms)")

    def ms(v: float | None) -> str:
        if v is None:
            return f"> {lateness.BOUNDS[-1] / 1000:g} s"
        return f"≤ {v:g} ms" if v < 1000 else f"≤ {v / 1000:g} s"

    for kind, label in LATENESS_LINES:
        view = late[kind]
        n, mean = view["count"], view["mean_ms"]
        if not n:
            hint = " (workers record it with delayq_record_lateness)" if kind == "start" else ""
            if kind != "gated":  # (no flow control used: no line)
                console.print(Text(f"  {label}  none recorded{hint}"))
            continue
        average = f"{mean:.1f} ms" if mean < 1000 else f"{mean / 1000:.2f} s"
        console.print(
            Text(
                f"  {label}  p50 {ms(view['p50_ms'])}  p99 {ms(view['p99_ms'])}  mean {average}  ({n:,} jobs)"
            )
        )


# -- schedules ----------------------------------------------------------------------------------
