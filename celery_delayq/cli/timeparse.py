"""Times and durations as a person types them: :mod:`celery_delayq.admin.timeparse`, kept here under
its old name for the CLI's modules (the dashboard imports it from the package itself, so that
it needs no part of the CLI)."""

from __future__ import annotations

from ..admin.timeparse import is_relative, parse_duration, parse_when

__all__ = ["is_relative", "parse_duration", "parse_when"]
