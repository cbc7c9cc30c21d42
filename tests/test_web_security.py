"""The dashboard's security over real HTTP (docs/dashboard.md#security): read-only mode refuses
every action and changes nothing, a POST needs the session's CSRF token, a bind other than
loopback needs authentication and then every request needs it, stored values show as text,
the Redis password never reaches a page, an action's ``next`` never leaves the site, and the
pages work under a URL prefix (``--url-prefix``, or ``X-Forwarded-Prefix`` with
``--behind-proxy``).

The servers are waitress on loopback (tests/support/web.py) or the real command
(``python -m celery_delayq web``) in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayQ, Schedules
from celery_delayq.devtools.embedded import EmbeddedRedis, free_port
from celery_delayq.web.context import local_target
from tests.support.apps import add_task, make_app
from tests.support.cli import invoke
from tests.support.processes import ROOT, stop_processes
from tests.support.store import bury
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

HOUR = 3600.0

#: Every action of the dashboard, as its form posts it: (path, fields). ``{job}``, ``{dead}``,
#: ``{schedule}``, ``{key}`` and ``{batch}`` are replaced by what :func:`stored` made.
FORM_ACTIONS: list[tuple[str, list[tuple[str, str]]]] = [
    ("/jobs/action", [("action", "cancel"), ("ids", "{job}")]),
    ("/jobs/action", [("action", "run-now"), ("ids", "{job}")]),
    ("/jobs/action", [("action", "reschedule"), ("ids", "{job}"), ("when", "+10m")]),
    ("/schedules/action", [("action", "pause"), ("name", "{schedule}")]),
    ("/schedules/action", [("action", "resume"), ("name", "{schedule}")]),
    ("/schedules/action", [("action", "run-now"), ("name", "{schedule}")]),
    ("/schedules/action", [("action", "delete"), ("name", "{schedule}")]),
    ("/schedules/new", [("name", "made-by-a-post"), ("task", "t.noop"), ("kind", "every"), ("every", "60")]),
    ("/schedules/{schedule}/edit", [("kind", "every"), ("every", "30")]),
    ("/dead/action", [("action", "requeue"), ("ids", "{dead}")]),
    ("/dead/action", [("action", "delete"), ("ids", "{dead}")]),
    ("/dead/action", [("action", "requeue-all")]),
    ("/dead/action", [("action", "delete-all")]),
    ("/keys/action", [("action", "pause"), ("key", "{key}")]),
    ("/keys/action", [("action", "resume"), ("key", "{key}")]),
    ("/keys/action", [("action", "limit"), ("key", "{key}"), ("limit", "1")]),
    ("/batches/action", [("action", "cancel"), ("id", "{batch}")]),
]
#: The JSON twins: (path, body).
API_ACTIONS: list[tuple[str, dict[str, Any]]] = [
    ("/api/jobs/action", {"action": "cancel", "ids": ["{job}"]}),
    ("/api/jobs/action", {"action": "run-now", "ids": ["{job}"]}),
    ("/api/jobs/action", {"action": "reschedule", "ids": ["{job}"], "when": "+10m"}),
    ("/api/schedules/action", {"action": "pause", "name": "{schedule}"}),
    ("/api/schedules/action", {"action": "delete", "name": "{schedule}"}),
    ("/api/schedules/{schedule}", {"every": 30}),
    ("/api/schedules", {"name": "made-by-a-post", "task": "t.noop", "every": 60}),
    ("/api/dead/action", {"action": "requeue", "ids": ["{dead}"]}),
    ("/api/dead/action", {"action": "delete-all"}),
    ("/api/keys/action", {"action": "pause", "key": "{key}"}),
    ("/api/keys/action", {"action": "limit", "key": "{key}", "limit": "1"}),
    ("/api/batches/action", {"action": "cancel", "id": "{batch}"}),
]
#: Pages and JSON endpoints that list what is stored.
PAGES = ["/", "/jobs", "/schedules", "/dead", "/keys", "/batches"]
APIS = ["/api/status", "/api/jobs", "/api/schedules", "/api/dead", "/api/keys", "/api/batches"]


def _fill(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**names)
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    return value


def stored(app: Celery) -> dict[str, str]:
    """One of everything an action acts on: a waiting job, a dead letter, a schedule, a gate
    key and a batch; their ids and names."""
    add = app.tasks["t.add"]
    job = add.apply_in(HOUR, args=(1, 2), task_id="job-1")
    dead = add.apply_at(time.time() - 1, args=(3, 4), task_id="dead-1")
    bury(app, dead.id)
    Schedules(app).add("nightly", "t.add", "0 3 * * *", args=[5, 6])
    add.apply_in(HOUR, args=(7, 8), concurrency_key="tenant:1", concurrency_limit=2)
    batch = DelayQ(app).batch([add.s(i, i) for i in range(3)], eta=time.time() + HOUR)
    return {"job": job.id, "dead": dead.id, "schedule": "nightly", "key": "tenant:1", "batch": batch.id}


def snapshot(url: str) -> dict[bytes, bytes | None]:
    """Every key of the store's database and its serialized value (``DUMP``), but the chart
    counts the overview keeps a while (``<prefix>:web:counts:*``, the one thing a read-only
    dashboard writes)."""
    client = redis.Redis.from_url(url)
    try:
        keys = sorted(key for key in client.scan_iter(count=1000) if b":web:counts:" not in key)
        return {key: client.dump(key) for key in keys}
    finally:
        client.close()


def links_of(html: str) -> list[str]:
    """Every ``href``, ``src`` and ``action`` (and ``formaction``) of a page."""
    return re.findall(r'\s(?:href|src|action|formaction)="([^"]*)"', html)


# -- read-only, CSRF ------------------------------------------------------------------------------


def test_read_only_refuses_every_action_with_403_and_changes_nothing(
    app: Celery, redis_url: str, dashboard: Callable[..., Client]
) -> None:
    names = stored(app)
    before = snapshot(redis_url)
    client = dashboard()  # read-only: no allow_actions
    answers = [(path, fields[0][1], client.action(_fill(path, names), _fill(fields, names)))
               for path, fields in FORM_ACTIONS]  # fmt: skip
    answers += [(path, str(body.get("action", "update")), client.api(_fill(path, names), _fill(body, names)))
                for path, body in API_ACTIONS]  # fmt: skip
    assert [(path, action, a.status) for path, action, a in answers if a.status != 403] == []
    for path, _, answer in answers:
        assert "--allow-actions" in answer.text and "Traceback" not in answer.text, path
        if path.startswith("/api/"):
            assert answer.json()["status"] == 403
    assert snapshot(redis_url) == before


@pytest.mark.parametrize("token", [None, "", "not-the-session-token"], ids=["none", "empty", "wrong"])
def test_a_post_without_the_sessions_csrf_token_is_refused_with_400(
    app: Celery, redis_url: str, dashboard: Callable[..., Client], token: str | None
) -> None:
    names = stored(app)
    before = snapshot(redis_url)
    client = dashboard(allow_actions=True)
    client.get("/jobs")  # a session, with its own token: not the one sent
    fields = [("action", "cancel"), ("ids", names["job"]), ("next", "/jobs")]
    form = client.post("/jobs/action", fields if token is None else [("csrf_token", token), *fields])
    assert form.status == 400, form.text[:300]
    assert "CSRF" in form.text and "Traceback" not in form.text
    headers = {} if token is None else {"X-CSRFToken": token}
    api = client.post(
        "/api/jobs/action", json_body={"action": "cancel", "ids": [names["job"]]}, headers=headers
    )
    assert api.status == 400 and "CSRF" in api.json()["error"]
    assert snapshot(redis_url) == before


# -- authentication -------------------------------------------------------------------------------


def test_a_bind_other_than_loopback_without_auth_exits_2_and_says_why(app: Celery) -> None:
    result = invoke(app, "web", "--address", "0.0.0.0")
    assert result.exit_code == 2, result.output
    assert "refusing to serve on 0.0.0.0 without authentication" in result.output
    assert "--auth" in result.output and "--token-file" in result.output


def test_with_auth_every_request_needs_the_credentials(app: Celery, dashboard: Callable[..., Client]) -> None:
    base = dashboard(auth=("admin", "s3cret-pass")).base
    for path in ("/", "/jobs", "/api/status", "/static/app.css"):
        anonymous = Client(base).get(path)
        assert anonymous.status == 401, path
        assert anonymous.headers["www-authenticate"].startswith("Basic")
        assert Client(base, auth=("admin", "wrong")).get(path).status == 401
        assert Client(base, auth=("root", "s3cret-pass")).get(path).status == 401
        assert Client(base, auth=("admin", "s3cret-pass")).get(path).status == 200


@contextmanager
def served_by_the_cli(*args: str, tmp_path: Path) -> Iterator[str]:
    """``python -m celery_delayq web <args> --port P`` in a subprocess: its base URL (no
    prefix), once it answers."""
    port = free_port()
    log = tmp_path / f"web-{port}.log"
    with open(log, "wb") as out:
        command = [sys.executable, "-m", "celery_delayq", "web", *args, "--port", str(port)]
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(base + "/", timeout=5).close()
                break
            except urllib.error.HTTPError:
                break  # it answers (401, 404 out of its prefix)
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield base
    finally:
        stop_processes([proc])


@pytest.mark.slow  # starts the real command in a subprocess
def test_a_token_files_token_works_as_bearer_and_a_wrong_one_is_401(redis_url: str, tmp_path: Path) -> None:
    token = "t0ken-0123456789abcdef"
    (tmp_path / "token").write_text(token + "\n")
    options = ["--url", redis_url, "--address", "127.0.0.1", "--token-file", str(tmp_path / "token")]
    with served_by_the_cli(*options, tmp_path=tmp_path) as base:
        assert Client(base).get("/api/status").status == 401
        assert Client(base, bearer=token).get("/api/status").status == 200
        assert Client(base, bearer=token).get("/").status == 200
        assert Client(base, auth=("anyone", token)).get("/").status == 200  # a browser's prompt
        assert Client(base, bearer=token + "x").get("/").status == 401
        assert Client(base, bearer="t0ken").get("/").status == 401


# -- what a page shows ----------------------------------------------------------------------------


SCRIPT = "<script>alert(1)</script>"


def test_a_stored_script_shows_as_text(app: Celery, dashboard: Callable[..., Client]) -> None:
    job = app.tasks["t.add"].apply_in(HOUR, args=(SCRIPT, 2), kwargs={}, task_id="xss-1")
    dead = app.tasks["t.add"].apply_at(time.time() - 1, args=(SCRIPT, 3), task_id="xss-dead")
    bury(app, dead.id, reason=f"publish failed: {SCRIPT}")
    client = dashboard()
    for path in ("/jobs", f"/jobs/{job.id}", "/dead", f"/jobs/{dead.id}"):
        page = client.get(path)
        assert page.status == 200, path
        assert SCRIPT not in page.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, path
        scripts = re.findall(r"<script\b[^>]*>", page.text)
        assert all("src=" in s for s in scripts), scripts  # no inline script at all
    assert client.get(f"/api/jobs/{job.id}").json()["args"][0] == SCRIPT  # JSON keeps the value


@pytest.fixture
def password_server() -> Iterator[tuple[EmbeddedRedis, str]]:
    """A Redis server that requires a password (set once it answered), and the password."""
    password = "redis-pw-9f8e7d"
    with EmbeddedRedis() as server:
        setup = redis.Redis(host="127.0.0.1", port=server.port)
        setup.config_set("requirepass", password)
        setup.close()
        yield server, password


def test_the_redis_password_never_appears_in_a_page_or_json(
    password_server: tuple[EmbeddedRedis, str], dashboard: Callable[..., Client]
) -> None:
    server, password = password_server
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    app = make_app(url, delayq_url=url)

    add_task(app)

    try:
        names = stored(app)
        client = dashboard(app)
        job, dead = names["job"], names["dead"]
        paths = [*PAGES, *APIS, f"/jobs/{job}", f"/api/jobs/{job}", f"/jobs/{dead}",
                 "/jobs/no-such-job", "/api/jobs/no-such-job", "/no-such-page"]  # fmt: skip
        for path in paths:
            answer = client.get(path)
            assert answer.status in (200, 404), (path, answer.status, answer.text[:300])
            assert password not in answer.text, path
        overview = client.get("/").text
        assert f"redis://:***@127.0.0.1:{server.port}/0" in overview
    finally:
        app.close()


def test_an_unreachable_redis_is_503_with_the_url_redacted(dashboard: Callable[..., Client]) -> None:
    password = "pw-of-a-server-that-is-not-there"
    url = f"redis://:{password}@127.0.0.1:{free_port()}/0"
    app = make_app(url, delayq_url=url)
    try:
        client = dashboard(app)
        for path in ("/", "/jobs", "/api/status", "/api/jobs"):
            answer = client.get(path)
            assert answer.status == 503, (path, answer.status, answer.text[:300])
            assert password not in answer.text and "Traceback" not in answer.text
            assert "cannot reach Redis at redis://:***@127.0.0.1" in answer.text
    finally:
        app.close()


# -- where the browser is sent --------------------------------------------------------------------

OFF_SITE = ["https://evil.example/", "//evil.example/", "/\\evil.example/", "\\\\evil.example/",
            "javascript:alert(1)", "http:/evil.example", " //evil.example/"]  # fmt: skip


@pytest.mark.parametrize("target", OFF_SITE)
def test_local_target_refuses_every_off_site_next(target: str) -> None:
    assert local_target(target, "/jobs") == "/jobs"


@pytest.mark.parametrize("target", OFF_SITE)
def test_an_actions_next_never_redirects_off_site(
    app: Celery, dashboard: Callable[..., Client], target: str
) -> None:
    job = app.tasks["t.add"].apply_in(HOUR, args=(1, 2))
    client = dashboard(allow_actions=True)
    answer = client.action("/jobs/action", [("action", "reschedule"), ("ids", job.id), ("when", "+2h"),
                                            ("next", target)])  # fmt: skip
    assert answer.status == 303, answer.text[:300]
    location = answer.location or ""
    assert location.startswith("/") and not location.startswith("//") and "\\" not in location, location
    assert "evil" not in location


# -- a URL prefix ---------------------------------------------------------------------------------


def test_url_prefix_serves_every_page_under_it_and_links_carry_it(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    names = stored(app)
    client = dashboard(url_prefix="/delayq")
    assert client.base.endswith("/delayq")
    for path in [*PAGES, f"/jobs/{names['job']}"]:
        page = client.get(path)
        assert page.status == 200, path
        links = [link for link in links_of(page.text) if not link.startswith(("data:", "#", "?"))]
        assert links and all(link.startswith("/delayq/") for link in links), (path, links)


def test_url_prefix_every_form_posts_to_a_page_and_returns_under_it(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    """Every form posts under the prefix, to a page's route (not its ``/api/`` twin, which reads
    JSON), and where it sends the browser back after its action (its ``next``, whether the page
    writes it with the prefix or the action adds it) is under the prefix too: a proxy that
    forwards only ``/delayq/...`` would answer 404 anywhere else."""
    names = stored(app)
    client = dashboard(allow_actions=True, url_prefix="/delayq")
    details = [f"/jobs/{names['job']}", f"/dead/{names['dead']}", f"/schedules/{names['schedule']}",
               f"/keys/{names['key']}", f"/batches/{names['batch']}", f"/schedules/{names['schedule']}/edit",
               "/schedules/new"]  # fmt: skip
    nexts: set[str] = set()
    for path in [*PAGES, *details]:
        page = client.get(path + ("?task=t.add" if path in ("/jobs", "/dead") else ""))
        assert page.status == 200, (path, page.status)
        nexts.update(re.findall(r'name="next" value="([^"]*)"', page.text))
        posts = re.findall(r'<form method="post"[^>]*\saction="([^"]*)"', page.text)
        # a page's form posts to a page route: the /api/ twin reads a JSON body, not a form
        assert all(p.startswith("/delayq/") and "/api/" not in p for p in posts), (path, posts)
    assert nexts
    for target in sorted(nexts):
        fields = [("action", "reschedule"), ("ids", names["job"]), ("when", "+2h"), ("next", target)]
        answer = client.action("/jobs/action", fields)
        location = answer.location or ""
        assert answer.status == 303 and location.startswith("/delayq/"), (target, location)


def test_url_prefix_an_action_redirects_under_the_prefix(
    app: Celery, dashboard: Callable[..., Client]
) -> None:
    names = stored(app)
    client = dashboard(allow_actions=True, url_prefix="/delayq")
    answer = client.action("/jobs/action", [("action", "reschedule"), ("ids", names["job"]), ("when", "+2h")])
    assert answer.status == 303 and (answer.location or "").startswith("/delayq/"), answer.location
    origin = client.base.removesuffix("/delayq")
    assert client.get(origin + (answer.location or "")).status == 200


@pytest.mark.slow  # starts the real command in a subprocess
def test_behind_proxy_honours_x_forwarded_prefix(redis_url: str, tmp_path: Path) -> None:
    forwarded = {
        "X-Forwarded-Prefix": "/ops/delayq",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "ops.example",
    }
    with served_by_the_cli("--url", redis_url, "--behind-proxy", "1", tmp_path=tmp_path) as base:
        page = Client(base).get("/jobs", headers=forwarded)
        assert page.status == 200
        links = [link for link in links_of(page.text) if not link.startswith(("data:", "#", "?"))]
        assert links and all(link.startswith("/ops/delayq/") for link in links), links
    with served_by_the_cli("--url", redis_url, tmp_path=tmp_path) as base:  # no proxy trusted
        page = Client(base).get("/jobs", headers=forwarded)
        assert not [link for link in links_of(page.text) if "/ops/" in link]


@pytest.mark.slow  # starts the real command in a subprocess
def test_url_prefix_of_the_cli(redis_url: str, tmp_path: Path) -> None:
    with served_by_the_cli("--url", redis_url, "--url-prefix", "/delayq", tmp_path=tmp_path) as base:
        page = Client(base).get("/delayq/schedules")
        assert page.status == 200
        assert all(link.startswith("/delayq/") for link in links_of(page.text) if link.startswith("/"))
