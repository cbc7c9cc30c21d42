"""Reading a Prometheus ``/metrics`` page: :func:`scrape` and :func:`value`."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """``{family: {(sample name, labels): value}}`` of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(page: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    return float(page[family][(sample or family, tuple(sorted(labels.items())))])
