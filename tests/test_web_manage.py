"""The dashboard's management pages over real HTTP (waitress on a free port, the test Redis):
schedules (list, detail, pause, resume, run now, delete, the edit and new forms), dead letters
(requeue and delete, one, a selection or all), gate keys (pause, resume, limit) and batches
(progress, cancel). Each action is checked in the store; each refusal (read-only, no CSRF
token, bad input) leaves the store as it was; each JSON twin equals what the CLI prints."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.gate import Gate, member_id
from celery_delayq.schedules import Schedules
from celery_delayq.store import Store, get_store
from tests.support.cli import as_json, invoke
from tests.support.store import bury, server_ms, snapshot
from tests.support.web import Answer, Client

Dashboard = Callable[..., Client]


def rows(page: str, attribute: str) -> list[str]:
    """The values of ``attribute`` on a page's table rows, in order (unescaped)."""
    return [html.unescape(v) for v in re.findall(rf'<tr {attribute}="([^"]*)"', page)]


def errors_of(page: str) -> list[str]:
    """The texts of ``ul.errors li`` (unescaped)."""
    found = re.search(r'<ul class="errors"[^>]*>(.*?)</ul>', page, flags=re.S)
    return [html.unescape(li) for li in re.findall(r"<li>(.*?)</li>", found.group(1), flags=re.S)] if found else []


def flashes_of(answer: Answer, client: Client) -> list[str]:
    page = client.follow(answer).text
    return [html.unescape(li) for li in re.findall(r'<li class="(?:ok|error)">(.*?)</li>', page, flags=re.S)]


def without(view: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in view.items() if k not in names}


# -- schedules ---------------------------------------------------------------------------------------


@pytest.fixture
def two_schedules(app: Celery) -> Schedules:
    schedules = Schedules(app)
    schedules.add("digest", "t.add", "0 18 * * 1-5", [1, 2], tz="Europe/Paris", options={"queue": "reports"})
    schedules.add("tick", "t.noop", 30.0)
    return schedules


def test_schedules_list_and_detail_show_rule_timezone_state_next_and_last_run(
    app: Celery, dashboard: Dashboard, two_schedules: Schedules
) -> None:
    client = dashboard()
    page = client.get("/schedules").text
    assert rows(page, "data-schedule") == ["digest", "tick"]
    digest = page[page.index('data-schedule="digest"') :].split("</tr>")[0]
    assert "cron &#39;0 18 * * 1-5&#39; Europe/Paris" in digest and '<td class="tz">Europe/Paris</td>' in digest
    assert 'class="state active"' in digest and re.search(r'class="next-run">\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ', digest)
    assert 'name="action" value="pause"' in digest and 'value="run-now"' in digest and 'value="delete"' in digest
    assert "disabled" in digest  # read-only: the buttons are shown disabled

    detail = client.get("/schedules/digest")
    assert detail.status == 200 and 'id="schedule-rule">cron &#39;0 18 * * 1-5&#39; Europe/Paris' in detail.text
    assert 'id="schedule-runs">0' in detail.text and "{digest}@" in detail.text  # the next point's job
    assert client.get("/schedules/ghost").status == 404
    assert client.get("/api/schedules/ghost").json()["status"] == 404
    assert client.get("/api/schedules/digest").json() == as_json(invoke(app, "schedules", "show", "digest", "--json"))


def test_schedule_actions_pause_resume_run_now_delete(
    app: Celery, dashboard: Dashboard, two_schedules: Schedules
) -> None:
    client = dashboard(allow_actions=True)
    paused = client.action("/schedules/action", [("action", "pause"), ("name", "tick"), ("next", "/schedules")])
    assert paused.status == 303 and paused.location and paused.location.endswith("/schedules")
    assert flashes_of(paused, client) == ["tick: paused"]
    assert two_schedules.get("tick").enabled is False  # type: ignore[union-attr]
    page = client.get("/schedules").text
    assert 'data-schedule="tick"' in page and 'class="state paused"' in page

    # The JSON twin: the CLI's `schedules resume --json` plus outcome and message.
    resumed = client.api("/api/schedules/action", {"action": "resume", "name": "tick"})
    assert resumed.status == 200
    [result] = resumed.json()["results"]
    assert (result["outcome"], result["message"], result["enabled"]) == ("resumed", "resumed", True)
    shown = as_json(invoke(app, "schedules", "show", "tick", "--json"))
    assert without(result, "outcome", "message") == shown

    ran = client.api("/api/schedules/action", {"action": "run-now", "name": "digest"}).json()["results"][0]
    assert ran["outcome"] == "stored" and ran["id"].startswith("{digest}@run-now-")
    assert get_store(app).get(ran["id"]) is not None

    gone = client.api("/api/schedules/action", {"action": "delete", "name": ["digest", "ghost"]})
    assert gone.status == 409
    assert gone.json()["results"] == [
        {"name": "digest", "outcome": "deleted", "message": "deleted"},
        {"name": "ghost", "outcome": "missing", "message": "no schedule named 'ghost'"},
    ]
    assert two_schedules.get("digest") is None
    missing = client.api("/api/schedules/action", {"action": "pause", "name": "ghost"})
    assert missing.status == 409 and missing.json()["results"][0]["outcome"] == "missing"
    assert client.api("/api/schedules/action", {"action": "explode", "name": "tick"}).status == 400


def test_schedule_actions_refused_read_only_without_csrf_and_on_bad_input(
    app: Celery, redis_url: str, dashboard: Dashboard, two_schedules: Schedules
) -> None:
    before = snapshot(redis_url)
    read_only = dashboard()
    refused = read_only.action("/schedules/action", [("action", "delete"), ("name", "tick")])
    assert refused.status == 403 and "read-only" in refused.text
    assert read_only.api("/api/schedules/action", {"action": "pause", "name": "tick"}).status == 403
    assert read_only.action("/schedules/tick/edit", [("every", "5m")]).status == 403
    client = dashboard(allow_actions=True)
    client.token()  # a session, but the form below does not send its token
    no_csrf = client.post("/schedules/action", [("action", "delete"), ("name", "tick")])
    assert no_csrf.status == 400 and "CSRF" in no_csrf.text
    assert client.post("/api/schedules/action", json_body={"action": "delete", "name": "tick"}).status == 400
    assert client.action("/schedules/action", [("action", "pause")]).status == 400  # no name
    assert snapshot(redis_url) == before


def test_a_schedule_named_with_markup_shows_escaped(app: Celery, dashboard: Dashboard) -> None:
    Schedules(app).add("<b>bold</b>", "t.add", 60.0, ["<script>alert(1)</script>", 2])
    client = dashboard()
    for path in ("/schedules", "/schedules/<b>bold</b>", "/schedules/<b>bold</b>/edit"):
        page = client.get(path).text
        assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page, path
        assert "<script>alert" not in page
