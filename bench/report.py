"""Result lines and the table: what | ours | baseline | ratio | target | met?"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Line:
    """One line of the table.

    ``ratio`` is ours / baseline unless given. ``target`` is read against ``check``: ``">=x"``
    or ``"<=x"`` on the ratio (``x`` is a factor) or, with ``on="ours"``, on ours in its unit.
    No target: the line is a figure to read, not a gate.
    """

    what: str
    ours: float | None
    unit: str
    baseline: float | None = None
    ratio: float | None = None
    target: str = ""
    on: str = "ratio"  # "ratio" or "ours": what the target is checked against
    skipped: str = ""  # why the line could not be measured
    #: ours / the baseline is a lower bound (some jobs had not run when the wait ended): "≥"
    ours_at_least: bool = False
    baseline_at_least: bool = False

    def __post_init__(self) -> None:
        if self.ratio is None and _ok(self.ours) and _ok(self.baseline) and self.baseline:
            self.ratio = float(self.ours) / float(self.baseline)  # type: ignore[arg-type]

    @property
    def met(self) -> bool | None:
        if not self.target or self.skipped:
            return None
        value = self.ratio if self.on == "ratio" else self.ours
        if not _ok(value):
            return None
        op, limit = self.target[:2], float(self.target[2:])
        assert value is not None
        return value >= limit if op == ">=" else value <= limit

    def cells(self) -> list[str]:
        if self.skipped:
            return [self.what, "skipped", "", "", self._target_text(), ""]
        met = self.met
        ratio = f"{self.ratio:.2f}x" if _ok(self.ratio) else ""
        if ratio and (self.ours_at_least or self.baseline_at_least):
            ratio = "~" + ratio  # one side is only a lower bound
        return [
            self.what,
            ("≥" if self.ours_at_least else "") + fmt(self.ours, self.unit),
            ("≥" if self.baseline_at_least else "") + fmt(self.baseline, self.unit),
            ratio,
            self._target_text(),
            "" if met is None else ("yes" if met else "NO"),
        ]

    def _target_text(self) -> str:
        if not self.target:
            return ""
        op = "≥" if self.target[:2] == ">=" else "≤"
        limit = float(self.target[2:])
        if self.on == "ratio":
            return f"{op}{limit:g}x"
        return f"{op}{fmt(limit, self.unit)}"


@dataclass
class RowResult:
    name: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


def _ok(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def fmt(value: float | None, unit: str) -> str:
    if not _ok(value):
        return ""
    assert value is not None
    if unit in ("jobs/s", "rows/s", "calls/s", "points/s"):
        return f"{value:,.0f} {unit}"
    if unit == "ms":
        return f"{value:,.2f} ms" if abs(value) < 100 else f"{value:,.0f} ms"
    if unit == "s":
        return f"{value:,.2f} s"
    if unit == "MiB":
        return f"{value:,.1f} MiB"
    if unit == "B":
        return f"{value:,.0f} B"
    if unit == "cmd/s":
        return f"{value:.2f} cmd/s"
    if unit == "%":
        return f"{value:.2f} %"
    return f"{value:,.3g} {unit}"


HEADERS = ["what", "ours", "baseline", "ratio", "target", "met?"]


def table(results: list[RowResult]) -> str:
    rows: list[list[str]] = []
    for result in results:
        if result.error:
            rows.append([f"{result.name}: ERROR", "", "", "", "", ""])
        rows.extend(line.cells() for line in result.lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)]
    right = {1, 2, 3}

    def render(cells: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    out = [
        render(HEADERS),
        "|"
        + "|".join(("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths))
        + "|",
    ]
    out.extend(render(r) for r in rows)
    return "\n".join(out)


def notes(results: list[RowResult]) -> str:
    out = []
    for result in results:
        if result.error:
            out.append(f"- {result.name}: ERROR after {result.seconds:.0f} s: {result.error}")
        for note in result.notes:
            out.append(f"- {result.name}: {note}")
        for line in result.lines:
            if line.skipped:
                out.append(f"- {result.name}: skipped: {line.skipped}")
    return "\n".join(out)
