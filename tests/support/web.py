"""The dashboard over real HTTP: a waitress server on a free loopback port in a thread
(:func:`serve_dashboard`, the ``dashboard`` fixture) and a small cookie-keeping client on the
standard library (:class:`Client`): no mock of Flask, the bytes cross a socket.

>>> csrf_of('<meta name="csrf-token" content="abc.def">')
'abc.def'
"""

from __future__ import annotations

import http.cookiejar
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_delayq.web import create_app


@dataclass
class Answer:
    """One HTTP answer: status, headers (lower-case names), body as text."""

    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)

    @property
    def location(self) -> str | None:
        return self.headers.get("location")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


@dataclass
class Client:
    """A browser-like client of ``base`` (``http://127.0.0.1:<port>``) that keeps cookies.

    ``get``/``post`` do not follow redirects (a 303 after an action is what a test checks);
    ``follow`` reads the page a redirect names."""

    base: str
    auth: tuple[str, str] | None = None
    bearer: str | None = None
    jar: http.cookiejar.CookieJar = field(default_factory=http.cookiejar.CookieJar)

    def _open(self, request: urllib.request.Request) -> Answer:
        if self.auth is not None:
            import base64

            pair = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {pair}")
        elif self.bearer is not None:
            request.add_header("Authorization", f"Bearer {self.bearer}")
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect)
        try:
            with opener.open(request, timeout=30) as response:
                return Answer(response.status, {k.lower(): v for k, v in response.headers.items()},
                              response.read().decode())  # fmt: skip
        except urllib.error.HTTPError as exc:
            body = exc.read().decode()
            return Answer(exc.code, {k.lower(): v for k, v in exc.headers.items()}, body)

    def url(self, path: str) -> str:
        return path if path.startswith("http") else self.base + path

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> Answer:
        return self._open(urllib.request.Request(self.url(path), headers=dict(headers or {})))

    def post(
        self,
        path: str,
        data: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """A form POST (``data``; a list of pairs repeats a field, as ``ids=a&ids=b``) or a
        JSON one (``json_body``)."""
        sent = dict(headers or {})
        if json_body is not None:
            body = json.dumps(json_body).encode()
            sent.setdefault("Content-Type", "application/json")
        else:
            pairs = list(data.items()) if isinstance(data, Mapping) else list(data or [])
            body = urllib.parse.urlencode(pairs, doseq=True).encode()
            sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
        return self._open(urllib.request.Request(self.url(path), data=body, headers=sent, method="POST"))

    def token(self, path: str = "/") -> str:
        """The CSRF token of this client's session, read from a page's ``<meta name=csrf-token>``."""
        return csrf_of(self.get(path).text)

    def action(self, path: str, data: Sequence[tuple[str, Any]] | Mapping[str, Any] = ()) -> Answer:
        """A form POST with this session's CSRF token, as a page's form sends it."""
        pairs = list(data.items()) if isinstance(data, Mapping) else list(data)
        return self.post(path, [("csrf_token", self.token()), *pairs])

    def api(self, path: str, body: Any) -> Answer:
        """A JSON POST with the CSRF token in ``X-CSRFToken``, as a script sends it."""
        return self.post(path, json_body=body, headers={"X-CSRFToken": self.token()})

    def follow(self, answer: Answer) -> Answer:
        assert answer.location, f"no redirect: {answer.status} {answer.text[:300]}"
        return self.get(answer.location)


def csrf_of(html: str) -> str:
    found = re.search(r'<meta name="csrf-token" content="([^"]+)"', html)
    assert found, f"no csrf-token meta in {html[:300]!r}"
    return found.group(1)


@contextmanager
def serve_dashboard(app: Celery, url_prefix: str = "", **options: Any) -> Iterator[str]:
    """``create_app(app, **options)`` served by waitress on a free loopback port: its base URL."""
    import waitress.server
    from waitress import wasyncore

    server = waitress.server.create_server(
        create_app(app, **options), host="127.0.0.1", port=0, threads=4, url_prefix=url_prefix
    )
    stopping = threading.Event()

    def run() -> None:
        # The loop's own thread closes the sockets once told to stop: closed from another
        # thread, its select() could meet a closed descriptor (EBADF, a thread exception).
        while not stopping.is_set():
            wasyncore.loop(timeout=0.05, map=server._map, count=1)
        server.task_dispatcher.shutdown()
        wasyncore.close_all(server._map)

    thread = threading.Thread(target=run, name="dashboard", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}{url_prefix}"
    finally:
        stopping.set()
        thread.join(5)
        assert not thread.is_alive(), "the dashboard's server did not stop"


@pytest.fixture
def dashboard(app: Celery) -> Iterator[Callable[..., Client]]:
    """``dashboard(allow_actions=True)``: the test app's dashboard served over HTTP, and a
    client of it (servers started here stop at the test's end)."""
    with ExitStack() as stack:

        def start(celery_app: Celery | None = None, url_prefix: str = "", **options: Any) -> Client:
            base = stack.enter_context(serve_dashboard(celery_app or app, url_prefix, **options))
            return Client(base)

        yield start
