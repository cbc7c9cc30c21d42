"""How the CLI writes things: times and spans as text, rich tables and consoles, the due chart.

The only CLI module that imports ``rich`` (the ``cli`` extra). Nothing here reads Redis.

>>> iso(1_700_000_000_500), ago(252_000), relative(0, 90_000)
('2023-11-14T22:13:20.500Z', '4m12s', '1m30s ago')
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import IO, Any, cast

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..admin.views import bucket_ms, iso, shown

__all__ = [
    "ago",
    "bucket_ms",
    "call_text",
    "chart_lines",
    "emit_json",
    "iso",
    "kv_table",
    "listing",
    "make_console",
    "plain_row",
    "relative",
    "short",
    "shown",
]


def ago(ms: float) -> str:
    """``ms`` as a short span: ``4m12s``, ``3h``, ``2d5h``.

    >>> ago(252_000), ago(3 * 3_600_000), ago(0.5), ago(2 * 86_400_000 + 5 * 3_600_000)
    ('4m12s', '3h', '0s', '2d5h')
    """
    s = int(abs(ms) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60}m" if s % 3600 // 60 else f"{s // 3600}h"
    return f"{s // 86_400}d{s % 86_400 // 3600}h" if s % 86_400 // 3600 else f"{s // 86_400}d"


def relative(ms: float, now_ms: float) -> str:
    """``now``, ``in 4m12s`` or ``3h ago``."""
    if abs(ms - now_ms) < 1000:
        return "now"
    return f"in {ago(ms - now_ms)}" if ms >= now_ms else f"{ago(now_ms - ms)} ago"


def short(value: Any, width: int = 48) -> str:
    """``value`` (JSON unless a string) cut to ``width`` characters with an ellipsis.

    >>> short([1, 2, 3]), short("x" * 10, 5)
    ('[1,2,3]', 'xxxx…')
    """
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def call_text(view: dict[str, Any]) -> str:
    """A job view's args and kwargs, short, for a table cell."""
    args, kwargs = view["args"], view["kwargs"]
    parts = []
    if args not in (None, [], "()"):
        parts.append(short(args, 40))
    if kwargs not in (None, {}, "{}"):
        parts.append(short(kwargs, 40))
    return " ".join(parts)


def emit_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (the ``--json`` output of every command)."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


# -- rich -----------------------------------------------------------------------------------------

_PADDING = re.compile(r" +((?:\x1b\[[0-9;]*m)*)\n")


class _Trimmed:
    """A text stream that drops the spaces rich pads table rows with at the end of each line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            done, self.pending = self.pending.rsplit("\n", 1)
            self.stream.write(_PADDING.sub(r"\1\n", done + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def make_console(no_color: bool) -> Console:
    """A console on stdout: 160 columns when piped or captured (lines are not cut at 80)."""
    stream = sys.stdout
    width = None if stream.isatty() else 160
    return Console(
        file=cast(IO[str], _Trimmed(stream)),
        width=width,
        highlight=False,
        no_color=no_color,
        soft_wrap=False,
        emoji=False,
    )


def listing() -> Table:
    """A borderless table with bold headers, as every listing draws."""
    return Table(box=None, pad_edge=False, header_style="bold")


def plain_row(table: Table, *cells: str, style: str | None = None) -> None:
    """A row of plain text (ids, task names and arguments are never read as rich markup; a cell
    with a control character is shown escaped, :func:`shown`)."""
    table.add_row(*(Text(shown(cell)) for cell in cells), style=style)


def kv_table(title: str, rows: Sequence[tuple[str, Any]]) -> Table:
    """Two columns, name and value (``None``: ``-``; not a string: JSON), under ``title``."""
    out = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    out.add_column(style="bold", no_wrap=True)
    out.add_column(overflow="fold")
    for key, value in rows:
        if value is None:
            text = "-"
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, ensure_ascii=False, default=str)
        out.add_row(key, Text(text))
    return out


# -- the chart of jobs due ----------------------------------------------------------------------

_EIGHTHS = " ▁▂▃▄▅▆▇█"


def chart_lines(counts: Sequence[int], labels: Sequence[str], height: int = 8, indent: int = 8) -> list[str]:
    """A column chart: one column per count, ``height`` rows of eighth blocks, a time axis.

    >>> print("\\n".join(chart_lines([0, 4, 8, 2], ["a", "b", "c", "d"], height=2, indent=3)))
    8 ┤    ██
      │  ████▄▄
    0 └────────
       a
    """
    peak = max(counts) if counts else 0
    cell = 1 if len(counts) > 40 else 2
    levels = [0 if not peak or not c else max(1, round(c / peak * height * 8)) for c in counts]
    lines = []
    for row in range(height, 0, -1):
        base = (row - 1) * 8
        bars = "".join(_EIGHTHS[min(8, max(0, lv - base))] * cell for lv in levels)
        label = f"{peak:,}" if row == height else ""
        lines.append(f"{label:>{indent - 2}} {'┤' if row == height else '│'}{bars}")
    lines.append(f"{'0':>{indent - 2}} └{'─' * (len(counts) * cell)}")
    step = next((n for n in (1, 5, 10, 15, 30, 60) if n * cell >= 8), 60)
    axis = [" "] * (len(counts) * cell + 8)
    for i in range(0, len(counts), step):
        for j, ch in enumerate(labels[i]):
            axis[i * cell + j] = ch
    lines.append(" " * indent + "".join(axis).rstrip())
    return [line.rstrip() for line in lines]
