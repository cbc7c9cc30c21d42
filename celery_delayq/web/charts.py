"""Charts drawn on the server as inline SVG: no script, no library, the page's own CSS colours.

>>> svg = bar_chart([0, 3, 1], ["09:00", "09:01", "09:02"], "jobs due per minute")
>>> svg.count("<rect"), 'aria-label="jobs due per minute"' in svg, "09:01: 3" in svg
(3, True, True)
>>> "<script>" in bar_chart([1], ["<script>"], "x")
False
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

__all__ = ["bar_chart"]


def bar_chart(
    values: Sequence[float],
    labels: Sequence[str],
    title: str,
    width: int = 720,
    height: int = 140,
    label_every: int | None = None,
    unit: str = "",
) -> Markup:
    """Bars of ``values`` (one per label) with a y scale and every ``label_every``-th label under
    them; each bar's tooltip (``<title>``) says its label and value."""
    n = max(1, len(values))
    top = max(values, default=0) or 1
    pad_left, pad_bottom, pad_top = 44, 18, 8
    plot_w, plot_h = width - pad_left - 4, height - pad_bottom - pad_top
    step = plot_w / n
    bar = max(1.0, step * 0.8)
    every = label_every or max(1, n // 8)
    base = pad_top + plot_h
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<line class="axis" x1="{pad_left}" y1="{base}" x2="{width - 4}" y2="{base}"/>',
        f'<text class="tick" x="{pad_left - 4}" y="{pad_top + 8}" text-anchor="end">'
        f"{_num(top)}{escape(unit)}</text>",
        f'<text class="tick" x="{pad_left - 4}" y="{base}" text-anchor="end">0</text>',
    ]
    for i, (value, label) in enumerate(zip(values, labels, strict=True)):
        h = plot_h * (value / top) if value > 0 else 0.0
        if 0 < h < 1:
            h = 1.0
        x = pad_left + i * step + (step - bar) / 2
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{base - h:.1f}" width="{bar:.1f}" height="{h:.1f}">'
            f"<title>{escape(label)}: {_num(value)}{escape(unit)}</title></rect>"
        )
        if i % every == 0:
            parts.append(
                f'<text class="tick" x="{pad_left + i * step:.1f}" y="{height - 4}">{escape(label)}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def _num(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
