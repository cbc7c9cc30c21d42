"""The dashboard's Flask app: its security (auth,
CSRF, read-only mode, headers) and how it answers an error.

Security, in the order a request meets it:

1. **Auth** (when configured): HTTP Basic with ``user:password``, or a token, sent as
   ``Authorization: Bearer <token>`` or as the Basic password (any user name; a browser's login
   prompt then works). Compared in constant time. Without auth, :func:`.serve.check_bind`
   refuses any address but loopback.
2. **CSRF**: every POST carries the session's token (Flask-WTF's ``CSRFProtect``): the
   ``csrf_token`` form field the pages put in each form, or the ``X-CSRFToken`` header.
3. **Read-only**: every action answers 403 unless the app was made with ``allow_actions``.
4. **Headers**: a Content-Security-Policy allowing only the package's own scripts and styles
   (no inline script), ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``.

Jinja escapes every value (a job argument of ``<script>`` shows as text); an id or a name
holding a control character shows as its ``repr`` (the ``shown`` filter), and the Redis URL
shown is redacted (:func:`..config.redact_url`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
from typing import Any

from flask import Flask, Response, g, jsonify, render_template, request
from flask_wtf.csrf import CSRFError, CSRFProtect
from jinja2 import BytecodeCache
from jinja2.bccache import Bucket
from werkzeug.exceptions import HTTPException
from werkzeug.routing import PathConverter

from ..admin.views import shown
from ..exceptions import DelayQError, StoreFull, StoreRefused, StoreUnreachable
from ..store.connection import error_text, redis_error_kind
from . import dead, flow, jobs, overview, schedules
from .context import (
    REFRESH_SECONDS,
    Dashboard,
    dashboard,
    nav_counts,
    relative,
    reshown_form,
    reshown_message,
    span,
    typed,
    wants_json,
)
from .forms import form_field

__all__ = ["CSP", "create_app"]


def _auth_ok(auth: tuple[str, str] | None, token: str | None) -> bool:
    given = request.authorization
    if given is None:
        return False
    if given.type == "bearer":
        return token is not None and hmac.compare_digest((given.token or "").encode(), token.encode())
    if given.type != "basic":
        return False
    user, password = given.username or "", given.password or ""
    if token is not None and hmac.compare_digest(password.encode(), token.encode()):
        return True
    if auth is None:
        return False
    return hmac.compare_digest(user.encode(), auth[0].encode()) & hmac.compare_digest(
        password.encode(), auth[1].encode()
    )


#: The Content-Security-Policy of every answer: the package's own scripts, styles and images only.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class _CompiledTemplates(BytecodeCache):
    """The pages' templates compiled once a process, in memory: each :func:`create_app` (a
    process serving several dashboards, or the tests, which make one a test) reuses the code
    instead of parsing and compiling each page again (about 0.1 s a page). Jinja keys the code
    by template name and checks it against the template's source: an edited template compiles
    again."""

    def __init__(self) -> None:
        self._code: dict[str, bytes] = {}

    def load_bytecode(self, bucket: Bucket) -> None:
        code = self._code.get(bucket.key)
        if code is not None:
            bucket.bytecode_from_string(code)

    def dump_bytecode(self, bucket: Bucket) -> None:
        self._code[bucket.key] = bucket.bytecode_to_string()


_COMPILED = _CompiledTemplates()


class _AnyPath(PathConverter):
    """The pages' ``<path:...>`` part (a job id, a schedule's name, a key, a batch id) with any
    character in it: Werkzeug's own stops at a newline (its ``.``), so the page of a job whose
    id holds one (stored by an older version) answered 404 from its own link."""

    regex = "[^/](?s:.)*?"


def create_app(
    app: Any,
    *,
    allow_actions: bool = False,
    auth: tuple[str, str] | None = None,
    token: str | None = None,
    refresh_seconds: float = REFRESH_SECONDS,
    secret_key: str | None = None,
) -> Flask:
    """The dashboard of Celery app ``app`` as a WSGI app (serve it with :func:`.serve.serve`, or
    mount it in any WSGI server).

    ``allow_actions``: the pages may change what is stored (else every action answers 403).
    ``auth`` (user, password) and ``token``: what a request must send (either one; none: no
    auth, for a loopback bind). ``secret_key`` signs the session cookie that holds the CSRF
    token (default: random per process, so a restart asks forms to be loaded again).
    """
    web = Flask(__name__)
    web.jinja_options = {**web.jinja_options, "bytecode_cache": _COMPILED}
    web.config.update(
        SECRET_KEY=secret_key or secrets.token_hex(32),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_NAME="delayq_session",
        WTF_CSRF_TIME_LIMIT=None,  # valid for the session: a page left open still posts
        JSON_SORT_KEYS=False,
    )
    web.json.sort_keys = False  # type: ignore[attr-defined]
    web.extensions["delayq"] = Dashboard(app, allow_actions=allow_actions, refresh_seconds=refresh_seconds)
    CSRFProtect(web)

    @web.before_request
    def _authenticate() -> Response | None:
        if (auth is None and token is None) or _auth_ok(auth, token):
            return None
        answer = Response("authentication required\n", 401, mimetype="text/plain")
        answer.headers["WWW-Authenticate"] = 'Basic realm="delayq", charset="UTF-8"'
        return answer

    @web.teardown_request
    def _forget_reads(exc: BaseException | None) -> None:
        if g.get("delayq_action"):  # an action ran (require_actions let it through)
            board = dashboard()
            board.shared.clear()
            with contextlib.suppress(Exception):  # the page already answered
                board.store.forget_counts(list(board.chart_seconds))

    @web.after_request
    def _headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        if request.path.startswith("/api/") or response.mimetype == "text/html":
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    @web.errorhandler(CSRFError)
    def _csrf(exc: CSRFError) -> Any:
        return _error(400, f"refused: {exc.description} (load the page again and retry)")

    @web.errorhandler(400)
    def _bad_request(exc: Any) -> Any:
        message = getattr(exc, "description", "bad request")
        return reshown_form(400, message) or _error(400, message)

    @web.errorhandler(403)
    def _forbidden(exc: Any) -> Any:
        return _error(403, getattr(exc, "description", "forbidden"))

    @web.errorhandler(404)
    def _missing(exc: Any) -> Any:
        return _error(404, getattr(exc, "description", "not found"))

    @web.errorhandler(DelayQError)
    def _delayq_error(exc: DelayQError) -> Any:
        if isinstance(exc, StoreFull):  # a full Redis, as the OOM reply of any other write
            return _error(507, f"Redis at {dashboard().url} is full (maxmemory reached): {exc}")
        if isinstance(exc, StoreUnreachable | StoreRefused):  # names the URL and the setting itself
            return _error(503, str(exc))
        return reshown_form(400, str(exc)) or _error(400, str(exc))

    @web.errorhandler(Exception)
    def _store_down(exc: Exception) -> Any:
        if isinstance(exc, HTTPException):
            return exc
        kind = redis_error_kind(exc)
        if kind == "unreachable":
            return _error(503, f"cannot reach Redis at {dashboard().url}: {error_text(exc)}")
        if kind == "oom":
            return _error(
                507,
                f"Redis at {dashboard().url} is full (maxmemory reached): it refused this change; "
                "nothing stored was lost. Free memory or raise maxmemory, then retry.",
            )
        raise exc

    web.jinja_env.filters["when"] = lambda ms: dashboard().when(ms)
    web.jinja_env.filters["span"] = span
    web.jinja_env.filters["relative"] = relative
    web.jinja_env.globals["board"] = dashboard
    web.jinja_env.globals["nav_counts"] = nav_counts
    web.jinja_env.globals["typed"] = typed
    web.jinja_env.globals["form_field"] = form_field
    web.jinja_env.globals["reshown_message"] = reshown_message
    web.jinja_env.filters["jsontext"] = _json_inline
    web.jinja_env.filters["shown"] = _shown
    web.jinja_env.filters["jsonblock"] = _json_text

    web.url_map.converters["path"] = _AnyPath
    for blueprint in (overview.bp, jobs.bp, schedules.bp, dead.bp, flow.bp):
        web.register_blueprint(blueprint)
    return web


def _shown(value: Any) -> Any:
    """An id or a name as text on a page (:func:`..admin.views.shown`): its ``repr`` when it holds
    a control character (``'old\\nid'``), else as it is; anything not text (None) as it is.
    Links and form fields carry the value itself."""
    return shown(value) if isinstance(value, str) else value


def _json_text(value: Any) -> str:
    """``value`` as indented JSON, for the detail pages: a plain string, so Jinja escapes it
    (``"<script>"`` shows as those characters; Jinja's own ``tojson`` would show ``\u003c``)."""
    return json.dumps(value, indent=2, sort_keys=True, default=repr, ensure_ascii=False)


def _json_inline(value: Any) -> str:
    """``value`` as one line of JSON (a job's arguments in a listing), escaped when shown."""
    return json.dumps(value, default=repr, ensure_ascii=False)


def _error(status: int, message: str) -> Any:
    g.delayq_error = True  # the error page's navigation shows no counts (Redis may be away)
    if wants_json():
        response = jsonify({"error": message, "status": status})
        response.status_code = status
        return response
    return render_template("error.html", status=status, message=message), status
