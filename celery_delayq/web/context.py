"""What every page works with: the :class:`Dashboard` (the Celery app, its store, how times
are written, the settings), and the helpers of the blueprints (JSON or page, read-only,
the answer of an action)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from flask import abort, current_app, flash, g, jsonify, redirect, request
from werkzeug.exceptions import HTTPException

from ..admin.jobs import DelayQ
from ..admin.views import local_text, shown
from ..config import DelayQConfig, redact_url
from ..due import ms_to_datetime
from ..schedules.api import Schedules
from ..store.facade import get_store
from ..store.lateness import WindowReader
from .forms import form_values

__all__ = [
    "CHART_REFRESHES",
    "REFRESH_SECONDS",
    "Dashboard",
    "SharedReads",
    "action_response",
    "dashboard",
    "local_target",
    "nav_counts",
    "relative",
    "require_actions",
    "span",
    "under_root",
    "wants_json",
]

#: Seconds to wait for a TCP connection to Redis before a page says it cannot be reached.
CONNECT_TIMEOUT = 5.0
#: Seconds between two live refreshes of a page (``--refresh``; 0: none).
REFRESH_SECONDS = 5.0
#: What is read for every page alike (the overview, the navigation counts) is kept this part
#: of the refresh interval and shared by every open page: 4 s at the default 5 s refresh.
SHARED_PART = 0.8
#: The overview's chart counts (a ``ZCOUNT`` a bucket and shard: 1,344 commands a read with 16
#: shards) are read at most once in this many refresh intervals and kept in Redis for every
#: dashboard process and page: the next hour per minute every 12 (60 s at the default 5 s),
#: the next 24 hours per hour every 60 (5 min). Each chart shows the time it starts at.
CHART_REFRESHES = {"hour": 12, "day": 60}

T = TypeVar("T")


class SharedReads:
    """Reads shared by every page of the process for ``max_age`` seconds: N open pages cost
    Redis what one costs. One read at a time per name: a page that asks while another reads
    waits for that read and shows it. Every action clears it (:meth:`clear`), so the page
    after an action shows what it changed. ``max_age`` 0: nothing kept, every page reads.

    What :meth:`get` returns is shared: the caller must not change it.
    """

    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self.clock = clock
        self._kept: dict[str, tuple[float, Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._generation = 0

    def get(self, name: str, read: Callable[[], T]) -> T:
        """What ``read()`` returned less than ``max_age`` seconds ago under ``name``, or what it
        returns now (kept unless an action cleared the reads meanwhile)."""
        if self.max_age <= 0:
            return read()
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            with self._lock:
                kept = self._kept.get(name)
                generation = self._generation
            if kept is not None and self.clock() - kept[0] < self.max_age:
                value: T = kept[1]
                return value
            started = self.clock()
            value = read()
            with self._lock:
                if generation == self._generation:
                    self._kept[name] = (started, value)
            return value

    def clear(self) -> None:
        """Forget every read: the next page reads again (after an action)."""
        with self._lock:
            self._kept.clear()
            self._generation += 1


class Dashboard:
    """What the pages work with: the Celery app, its store, ``DelayQ``, ``Schedules``, how
    times are written, and the dashboard's settings."""

    def __init__(
        self, app: Any, allow_actions: bool = False, refresh_seconds: float = REFRESH_SECONDS
    ) -> None:
        self.app = app
        self.store = get_store(app, connect_timeout=CONNECT_TIMEOUT)
        self.dq = DelayQ(app)
        self.schedules = Schedules(app)
        self.allow_actions = allow_actions
        self.refresh_seconds = refresh_seconds
        #: The overview and the navigation counts, shared by the open pages (see SharedReads).
        self.shared = SharedReads(max(refresh_seconds, 0.0) * SHARED_PART)
        #: Seconds each chart's counts are kept in Redis (:data:`CHART_REFRESHES`; 0: none).
        self.chart_seconds = {name: max(refresh_seconds, 0.0) * n for name, n in CHART_REFRESHES.items()}
        #: The minute hashes of the last hour's lateness, each kept once it no longer changes.
        self.lateness = WindowReader()
        #: The store's URL with its password replaced by ``***``: the only form any page shows.
        self.url = redact_url(DelayQConfig.from_app(app).url)

    @property
    def default_queue(self) -> str:
        return str(self.app.conf.task_default_queue)

    def when(self, ms: int | float | None) -> str:
        """A time for humans, in the app's timezone: ``2026-11-21 15:03:07Z``."""
        return local_text(ms, self.app.timezone)

    def hhmm(self, ms: int | float) -> str:
        return ms_to_datetime(ms).astimezone(self.app.timezone).strftime("%H:%M")


def nav_counts() -> dict[str, int] | None:
    """The counts the navigation shows beside its links: jobs stored, schedules, dead letters and
    gate keys, in one pipeline of ``ZCARD``/``HLEN`` a shard (4 commands a shard, whatever is
    stored), shared by the pages for :attr:`Dashboard.shared`'s age. None for a live refresh
    (it swaps the main part only) and when Redis does not answer (the page says why on its
    own), and on an error page."""
    if request.headers.get("X-Delayq-Live") or g.get("delayq_error"):
        return None
    try:
        board = dashboard()
        return board.shared.get("nav_counts", board.store.nav_counts)
    except Exception:  # the page's own read says what is wrong
        return None


def dashboard() -> Dashboard:
    """The running app's :class:`Dashboard` (inside a request)."""
    board: Dashboard = current_app.extensions["delayq"]
    return board


def span(ms: float | None) -> str:
    """``ms`` as a short span: ``4m12s``, ``3h``, ``2d5h``, ``850ms``.

    >>> span(252_000), span(3 * 3_600_000), span(850), span(None)
    ('4m12s', '3h', '850ms', '-')
    """
    if ms is None or not math.isfinite(ms):
        return "-"
    ms = abs(ms)
    if ms < 1000:
        return f"{ms:.0f}ms"
    s = int(ms // 1000)
    parts = [(s // 86_400, "d"), (s % 86_400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    shown = [f"{n}{u}" for n, u in parts if n]
    first = next(i for i, (n, _) in enumerate(parts) if n)
    return "".join(shown[:2]) if first < 2 else "".join(f"{n}{u}" for n, u in parts[first:] if n)


def relative(ms: float | None, now_ms: float | None = None) -> str:
    """``in 4m12s`` or ``3h ago`` (``now_ms``: default this machine's clock).

    >>> relative(0, 90_000), relative(90_000, 0)
    ('1m30s ago', 'in 1m30s')
    """
    if ms is None:
        return ""
    now = time.time() * 1000 if now_ms is None else now_ms
    return f"in {span(ms - now)}" if ms >= now else f"{span(now - ms)} ago"


def wants_json() -> bool:
    """Whether the request is the JSON API's (``/api/...``) or asks for JSON first."""
    if request.path.startswith("/api/"):
        return True
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return (
        best == "application/json" and request.accept_mimetypes[best] > request.accept_mimetypes["text/html"]
    )


def require_actions() -> None:
    """403 unless the dashboard was started with ``--allow-actions``. An action let through
    clears the shared reads once its request ends (:class:`SharedReads`)."""
    if not dashboard().allow_actions:
        abort(
            403, description="this dashboard is read-only: start it with --allow-actions to change anything"
        )
    g.delayq_action = True


def local_target(target: str | None, default: str) -> str:
    r"""``target`` when it is a path on this site (``/jobs?task=x``), else ``default``: a form's
    ``next`` never sends the browser elsewhere. A backslash or a control character is refused
    too: browsers read ``/\evil.example`` as ``//evil.example``.

    >>> local_target("/jobs?q=1", "/"), local_target("https://evil.example/", "/"), local_target("//x", "/")
    ('/jobs?q=1', '/', '/')
    >>> local_target("/\\evil.example/", "/"), local_target("/\t/evil.example", "/")
    ('/', '/')
    """
    if not target:
        return default
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return default
    if "\\" in target or not target.isprintable():
        return default
    return target


def action_response(
    results: Iterable[Mapping[str, Any]], ok: set[str], default_next: str, gone: Iterable[str] = ()
) -> Any:
    """How an action answers: JSON ``{"results": [...]}`` (status 200 when every outcome is in
    ``ok``, else 409), or, for a form, one flash message per result and a redirect back to the
    form's ``next`` (POST, redirect, GET: a reload does not repeat the action).

    ``gone``: the pages (``url_for`` paths) of the items the action removed or may have removed
    (a deleted schedule, a job run now, which the beat delivers in a moment): a ``next`` naming
    one of them goes to ``default_next`` instead, so that an action never lands on a 404."""
    listed = [dict(r) for r in results]
    failed = [r for r in listed if r.get("outcome") not in ok]
    if wants_json():
        response = jsonify({"results": listed})
        response.status_code = 409 if failed else 200
        return response
    for r in listed:
        name = r.get("id") or r.get("name") or r.get("key") or ""
        flash(
            f"{shown(name)}: {r.get('message', r.get('outcome'))}",
            "ok" if r.get("outcome") in ok else "error",
        )
    target = local_target(request.form.get("next"), default_next)
    if _page_path(target) in {_page_path(page) for page in gone}:
        target = default_next
    return redirect(under_root(target), code=303)


#: A form's fields that are not typed by the person (the page's own hidden fields).
_ITEM_FIELDS = ("ids", "id", "name", "key")
_NOT_TYPED = ("csrf_token", "next", "action", *_ITEM_FIELDS, *(f"{f}.json" for f in _ITEM_FIELDS))


def reshown_form(status: int, message: str) -> Any:
    """A form refused for what was typed (a bad time, a bad limit): the page the form was on
    (its ``next``), shown again with ``message`` above it and the form's typed fields filled
    in as they were sent (the template's ``typed(name)``), with ``status``. None when it is no
    form of a page (the JSON API, a GET, a form with no page of this site to go back to)."""
    target = request.form.get("next") if request.method == "POST" else None
    if not target or wants_json() or local_target(target, "") != target:
        return None
    path = _page_path(target)
    typed = {k: v for k, v in request.form.items() if k not in _NOT_TYPED}
    try:
        typed["_for"] = next((v for k in ("key", "id", "name") for v in form_values(request.form, k)), "")
    except HTTPException:  # a bad ``<item>.json``: refused already; the page names no item
        typed["_for"] = ""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    body = ("content-type", "content-length")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in body]
    with app.test_request_context(path, base_url=request.url_root, method="GET", headers=headers):
        g.reshown = {"message": message, "typed": typed}
        try:
            page = app.full_dispatch_request()
        finally:
            g.pop("reshown", None)
    if page.status_code != 200:
        return None
    page.status_code = status
    page.headers.pop("Set-Cookie", None)  # the session is the request's own; nothing changed it
    return page


def typed(name: str, for_item: str | None = None) -> str:
    """What was typed in the form field ``name`` when the page is shown again after a refusal
    (:func:`reshown_form`); "" otherwise. ``for_item``: only when the refused form was that
    item's (a key's limit field on a page listing many keys)."""
    reshown = g.get("reshown")
    if not reshown:
        return ""
    values: dict[str, str] = reshown["typed"]
    if for_item is not None and values.get("_for") != for_item:
        return ""
    return values.get(name, "")


def reshown_message() -> str | None:
    """The refusal a page is shown again with (:func:`reshown_form`), or None."""
    reshown = g.get("reshown")
    return reshown["message"] if reshown else None


def _page_path(target: str) -> str:
    """``target``'s path without the app's root and query: the page it names."""
    path = urlsplit(target).path
    root = request.script_root
    return path[len(root) :] if root and path.startswith(root + "/") else path


def under_root(path: str, root: str | None = None) -> str:
    """``path`` under the app's root (``request.script_root``: ``--url-prefix`` or a proxy's
    ``X-Forwarded-Prefix``) unless it already is: a redirect after an action stays where the
    proxy forwards, whether the form's ``next`` was written with the prefix or without.

    >>> under_root("/jobs?q=a", "/delayq"), under_root("/delayq/jobs", "/delayq"), under_root("/jobs", "")
    ('/delayq/jobs?q=a', '/delayq/jobs', '/jobs')
    """
    root = request.script_root if root is None else root
    if not root or path == root or path.startswith(root + "/") or path.startswith(root + "?"):
        return path
    return root + path
