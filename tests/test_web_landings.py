"""Where the dashboard's actions land (docs/dashboard.md): on the item's page while it exists
(a schedule paused, resumed or run now from its page stays there; deleted, it goes to the
list), and a form refused for what was typed (a bad time, a bad limit) shows its page again
with the message and the typed value, status 400, instead of a dead-end error page. Over real
HTTP (waitress, the test Redis); the same in Chromium: tests/test_web_browser.py."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable
from datetime import timedelta

import redis
from celery import Celery

from celery_delayq.schedules.api import Schedules
from celery_delayq.store.facade import get_store
from tests.support.store import bury, gate_due
from tests.support.web import Answer, Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

Dashboard = Callable[..., Client]


def form_next(page: str, form: str) -> str:
    """The hidden ``next`` of the first form on ``page`` that holds ``form`` (a piece of it)."""
    for found in re.findall(r"<form\b.*?</form>", page, flags=re.S):
        if form in found:
            value = re.search(r'name="next" value="([^"]*)"', found)
            assert value, found
            return html.unescape(value.group(1))
    raise AssertionError(f"no form with {form!r}")


def landed(client: Client, answer: Answer) -> str:
    """The page an action's redirect lands on (which answers 200), without the leading /."""
    assert answer.status == 303 and answer.location, (answer.status, answer.text[:500])
    assert client.follow(answer).status == 200
    return (
        answer.location.split("://", 1)[-1].split("/", 1)[1]
        if "://" in answer.location
        else answer.location[1:]
    )


def test_a_schedules_actions_on_its_page_land_on_its_page(app: Celery, dashboard: Dashboard) -> None:
    Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    client = dashboard(allow_actions=True)
    for action in ("pause", "resume", "run-now"):
        page = client.get("/schedules/tick").text
        sent = [("action", action), ("name", "tick"), ("next", form_next(page, 'value="run-now"'))]
        answer = client.action("/schedules/action", sent)
        assert landed(client, answer) == "schedules/tick", action
    assert Schedules(app).get("tick").enabled  # paused, then resumed
    page = client.get("/schedules/tick").text
    sent = [("action", "delete"), ("name", "tick"), ("next", form_next(page, 'value="delete"'))]
    assert landed(client, client.action("/schedules/action", sent)) == "schedules"  # its page is gone


def test_a_bad_reschedule_time_shows_the_jobs_page_again_with_what_was_typed(
    app: Celery, dashboard: Dashboard
) -> None:
    job = app.tasks["t.add"].apply_in(3600, (1, 2), task_id="report-7").id
    due = get_store(app).get(job).due_ms
    client = dashboard(allow_actions=True)
    page = client.get(f"/jobs/{job}").text
    sent = [("action", "reschedule"), ("ids", job), ("when", "next tuesday <b>"),
            ("next", form_next(page, 'value="reschedule"'))]  # fmt: skip
    answer = client.action("/jobs/action", sent)
    assert answer.status == 400
    assert '<h1>Job <code id="job-id">report-7</code></h1>' in answer.text
    error = re.search(r'<ul class="flashes" id="form-error"><li class="error">(.*?)</li>', answer.text)
    assert error and html.unescape(error.group(1)).startswith("when: "), answer.text[:2000]
    assert 'name="when" value="next tuesday &lt;b&gt;"' in answer.text
    assert 'id="reschedule"' in answer.text and "data-live" not in answer.text
    assert get_store(app).get(job).due_ms == due  # nothing moved
    # the list's form too: its page again, the time typed kept
    listed = client.get("/jobs").text
    sent = [
        ("action", "reschedule"),
        ("ids", job),
        ("when", "soonish"),
        ("next", form_next(listed, 'value="reschedule"')),
    ]
    answer = client.action("/jobs/action", sent)
    assert (
        answer.status == 400 and 'id="jobs"' in answer.text and 'name="when" value="soonish"' in answer.text
    )


def test_a_bad_limit_and_a_bad_requeue_time_show_their_page_again(
    app: Celery, r: redis.Redis, dashboard: Dashboard
) -> None:
    gate_due(app, r, "tenant:42", 2, limit=1)
    client = dashboard(allow_actions=True)
    for path in ("/keys/tenant:42", "/keys"):
        page = client.get(path).text
        sent = [("action", "limit"), ("key", "tenant:42"), ("limit", "lots"),
                ("next", form_next(page, 'value="limit"'))]  # fmt: skip
        answer = client.action("/keys/action", sent)
        assert answer.status == 400, path
        assert "a limit is a whole number &gt;= 1, or &#39;none&#39;; got &#39;lots&#39;" in answer.text, path
        assert answer.text.count('value="lots"') == 1, path  # in tenant:42's field only
    app.tasks["t.add"].apply_at(time.time() - 1, (1, 2), task_id="dead-1")
    bury(app, "dead-1")
    page = client.get("/dead").text
    sent = [
        ("action", "requeue"),
        ("ids", "dead-1"),
        ("at", "whenever"),
        ("next", form_next(page, 'name="at"')),
    ]
    answer = client.action("/dead/action", sent)
    assert answer.status == 400 and 'name="at" value="whenever"' in answer.text, answer.text[:1500]
    assert get_store(app).get("dead-1").state == "dead"
