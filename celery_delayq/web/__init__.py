"""The web dashboard: ``celery -A proj delayq web`` (extra ``web``: Flask, Flask-WTF, waitress).

What is waiting, as pages that work without JavaScript (a small script refreshes them live),
and a JSON API that serves the shapes ``celery delayq ... --json`` prints (:mod:`..views`).
Read-only unless started with ``--allow-actions``; every action is a POST with a CSRF token.
See docs/dashboard.md.

The modules: :mod:`.app` (the Flask app: security, errors), :mod:`.context` (what the pages
work with, the helpers of actions), :mod:`.overview`,
:mod:`.jobs`, :mod:`.schedules`, :mod:`.dead`, :mod:`.flow` (one blueprint each: the pages and
their ``/api/...`` twins), :mod:`.charts` (server-side SVG), :mod:`.serve` (the server, the
bind rules).
"""

from __future__ import annotations

from .app import create_app
from .context import Dashboard
from .serve import BindRefused, check_bind, serve

__all__ = ["BindRefused", "Dashboard", "check_bind", "create_app", "serve"]
