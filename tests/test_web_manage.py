"""The dashboard's management pages over real HTTP (waitress on a free port, the test Redis):
schedules (list, detail, pause, resume, run now, delete, the edit and new forms), dead letters
(requeue and delete, one, a selection or all), gate keys (pause, resume, limit) and batches
(progress, cancel). Each action is checked in the store; each refusal (read-only, no CSRF
token, bad input) leaves the store as it was; each JSON twin equals what the CLI prints."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.flow.gate import member_id
from celery_delayq.schedules.api import Schedules
from celery_delayq.store.facade import Store, get_store
from tests.support.apps import add_task, make_app
from tests.support.cli import as_json, invoke
from tests.support.store import bury, gate_due, open_batch, server_ms
from tests.support.store import snapshot as every_key
from tests.support.web import Answer, Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

Dashboard = Callable[..., Client]


def snapshot(url: str) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key with its type and DUMP but the chart counts a page keeps a while
    (``<prefix>:web:counts:*``): equal snapshots mean no action changed anything."""
    return {key: value for key, value in every_key(url).items() if b":web:counts:" not in key}


def rows(page: str, attribute: str) -> list[str]:
    """The values of ``attribute`` on a page's table rows, in order (unescaped)."""
    return [html.unescape(v) for v in re.findall(rf'<tr {attribute}="([^"]*)"', page)]


def errors_of(page: str) -> list[str]:
    """The texts of ``ul.errors li`` (unescaped)."""
    found = re.search(r'<ul class="errors"[^>]*>(.*?)</ul>', page, flags=re.S)
    return (
        [html.unescape(li) for li in re.findall(r"<li>(.*?)</li>", found.group(1), flags=re.S)]
        if found
        else []
    )


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
    assert (
        "cron &#39;0 18 * * 1-5&#39; Europe/Paris" in digest and '<td class="tz">Europe/Paris</td>' in digest
    )
    assert 'class="state active"' in digest and re.search(
        r'class="next-run">\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ', digest
    )
    assert (
        'name="action" value="pause"' in digest and 'value="run-now"' in digest and 'value="delete"' in digest
    )
    assert "disabled" in digest  # read-only: the buttons are shown disabled

    detail = client.get("/schedules/digest")
    assert (
        detail.status == 200 and 'id="schedule-rule">cron &#39;0 18 * * 1-5&#39; Europe/Paris' in detail.text
    )
    assert 'id="schedule-runs">0' in detail.text and "{digest}@" in detail.text  # the next point's job
    assert client.get("/schedules/ghost").status == 404
    assert client.get("/api/schedules/ghost").json()["status"] == 404
    assert client.get("/api/schedules/digest").json() == as_json(
        invoke(app, "schedules", "show", "digest", "--json")
    )


def test_schedule_actions_pause_resume_run_now_delete(
    app: Celery, dashboard: Dashboard, two_schedules: Schedules
) -> None:
    client = dashboard(allow_actions=True)
    paused = client.action(
        "/schedules/action", [("action", "pause"), ("name", "tick"), ("next", "/schedules")]
    )
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
    printed = invoke(app, "schedules", "rm", "ghost", "--json")  # exit 1: not done
    assert json.loads(printed.stdout)["results"] == gone.json()["results"][1:]
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


def test_the_edit_form_changes_what_was_changed_and_the_json_twin_equals_the_cli(
    app: Celery, dashboard: Dashboard, two_schedules: Schedules
) -> None:
    client = dashboard(allow_actions=True)
    form = client.get("/schedules/digest/edit").text
    assert 'id="schedule-edit"' in form and 'name="cron" value="0 18 * * 1-5"' in form
    assert 'name="queue" value="reports"' in form
    # The form as the browser sends it, with the rule and the queue changed.
    fields = dict(re.findall(r'<input name="(\w+)" value="([^"]*)"', form))
    fields.update(
        {k: html.unescape(v) for k, v in re.findall(r'<textarea name="(\w+)"[^>]*>([^<]*)</textarea>', form)}
    )
    fields = {k: html.unescape(v) for k, v in fields.items()}
    fields.update(cron="", every="5m", queue="q9", missed="once")
    saved = client.action("/schedules/digest/edit", sorted(fields.items()))
    assert saved.status == 303, errors_of(saved.text)
    assert flashes_of(saved, client) == ["digest: updated"]
    digest = two_schedules.get("digest")
    assert digest is not None and digest.rule.to_json()["every_ms"] == 300_000
    assert digest.options == {"queue": "q9"} and digest.args == [1, 2] and digest.tz == "Europe/Paris"

    # The API twin: the fields given are the changes, answered as `schedules update --json`.
    updated = client.api("/api/schedules/tick", {"cron": "0 9 * * *", "tz": "UTC", "args": "[]"})
    assert updated.status == 200, updated.text
    assert updated.json() == as_json(invoke(app, "schedules", "show", "tick", "--json"))
    assert updated.json()["rule"] == {"type": "cron", "expr": "0 9 * * *", "tz": "UTC"}
    assert client.api("/api/schedules/ghost", {"every": "1m"}).status == 404


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cron": "61 * * * *", "every": ""}, "malformed cron expression '61 * * * *'"),
        ({"tz": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ({"args": "{x"}, "args must be JSON"),
        ({"kwargs": "[1]"}, "kwargs must be a JSON object"),
        ({"task": "proj.missing"}, "task 'proj.missing' is not registered in this app"),
        ({"every": "often", "cron": ""}, "every: bad duration 'often'"),
        ({"every": "1m"}, "give one of cron, every or at"),
        ({"cron": ""}, "give the rule"),
        ({"max_missed": "x"}, "max_missed must be a whole number >= 1"),
        ({"missed": "never"}, "missed must be one of"),
        ({"args": "[1, 2, 3]"}, "the arguments do not fit the task of schedule 'digest'"),
    ],
)
def test_the_edit_form_shows_each_error_keeps_the_input_and_stores_nothing(
    app: Celery,
    redis_url: str,
    dashboard: Dashboard,
    two_schedules: Schedules,
    changes: dict[str, str],
    message: str,
) -> None:
    client = dashboard(allow_actions=True)
    initial = {"cron": "0 18 * * 1-5", "every": "", "at": "", "tz": "Europe/Paris", "args": "[1, 2]",
               "kwargs": "{}", "options": '{"queue": "reports"}', "queue": "reports", "missed": "once",
               "max_missed": "10", "grace": "60", "task": "t.add"}  # fmt: skip
    before = snapshot(redis_url)
    sent = {**initial, **changes}
    answer = client.action("/schedules/digest/edit", sorted(sent.items()))
    assert answer.status == 400
    [error] = errors_of(answer.text)
    assert message in error, error
    for name, value in changes.items():
        if value and name not in ("missed",):
            assert html.escape(value) in answer.text, name  # the input kept
    assert snapshot(redis_url) == before
    if message in ("give the rule", "give one of cron, every or at"):
        return  # the API takes the fields given as the changes: one rule field alone is one
    api = client.api("/api/schedules/digest", {k: v for k, v in changes.items() if v})
    assert api.status == 400 and message in api.json()["error"], api.text
    assert snapshot(redis_url) == before


def test_the_new_form_adds_a_schedule_as_schedules_add_does(
    app: Celery, redis_url: str, dashboard: Dashboard
) -> None:
    client = dashboard(allow_actions=True)
    assert 'id="schedule-edit"' in client.get("/schedules/new").text
    before = snapshot(redis_url)
    bad = [
        ({"name": "x", "task": "t.noop", "cron": "* *"}, "cron expression must have 5 fields"),
        ({"name": "x", "task": "proj.missing", "every": "1m"}, "task 'proj.missing' is not registered"),
        ({"name": "x", "task": "t.add", "every": "1m"}, "the arguments do not fit task 't.add'"),
        ({"name": "x", "task": "t.noop", "at": "-1h"}, "the one-shot time is in the past"),
        ({"name": "x", "task": "t.noop"}, "give the rule"),
        ({"name": "x", "task": "t.noop", "every": "1m", "options": "[]"}, "options must be a JSON object"),
    ]
    for form, message in bad:
        answer = client.action("/schedules/new", sorted(form.items()))
        assert answer.status == 400 and message in " ".join(errors_of(answer.text)), (
            form,
            answer.text[:2000],
        )
        assert f'value="{html.escape(form["task"])}"' in answer.text  # the input kept
        assert snapshot(redis_url) == before
    nameless = client.action("/schedules/new", [("task", ""), ("every", "1m")])
    assert errors_of(nameless.text)[:2] == [
        "give the schedule a name",
        "give the task to run (its registered name)",
    ]

    made = client.action("/schedules/new", [("name", "nightly"), ("task", "t.add"), ("cron", "0 3 * * *"),
                                            ("tz", "Europe/Paris"), ("args", "[1, 2]"), ("queue", "reports"),
                                            ("paused", "on")])  # fmt: skip
    assert made.status == 303 and flashes_of(made, client) == ["nightly: stored"]
    stored = Schedules(app).get("nightly")
    assert stored is not None and (stored.enabled, stored.args, stored.options) == (
        False,
        [1, 2],
        {"queue": "reports"},
    )
    taken = client.action("/schedules/new", [("name", "nightly"), ("task", "t.noop"), ("every", "1m")])
    assert taken.status == 400 and "a schedule named 'nightly' exists" in errors_of(taken.text)[0]

    # The API twin answers what `schedules add --json` prints; unknown tasks with no_check_task.
    added = client.api("/api/schedules", {"name": "api", "task": "proj.missing", "every": "90s",
                                          "no_check_task": True, "kwargs": {"k": 1}})  # fmt: skip
    assert added.status == 200, added.text
    assert added.json() == as_json(invoke(app, "schedules", "show", "api", "--json"))
    assert added.json()["kwargs"] == {"k": 1} and added.json()["rule"]["every_ms"] == 90_000
    refused = client.api("/api/schedules", {"name": "api2", "task": "t.noop", "cron": "nope nope"})
    assert refused.status == 400 and "cron expression must have 5 fields" in refused.json()["error"]


# -- dead letters ------------------------------------------------------------------------------------


@pytest.fixture
def dead_ids(app: Celery, r: redis.Redis) -> list[str]:
    """Three dead letters of ``t.add``, buried as a beat buries them; d3 died last."""
    now = server_ms(r)
    ids = ["d1", "d2", "d3"]
    for i, job_id in enumerate(ids):
        app.tasks["t.add"].apply_at((now - 5000) / 1000, (i, i), task_id=job_id)
        bury(app, job_id, reason=f"boom <{i}>", dead_at=now - 10_000 + i)
    return ids


def corrupt_dead_letter(app: Celery, r: redis.Redis, job_id: str) -> None:
    r.hset(get_store(app).keys.for_job(job_id).dead, job_id, "{not json")


def test_dead_letters_list_and_detail_and_their_json_twins(
    app: Celery, r: redis.Redis, dashboard: Dashboard, dead_ids: list[str]
) -> None:
    client = dashboard()
    page = client.get("/dead").text
    assert rows(page, "data-job-id") == ["d3", "d2", "d1"]
    assert '<td class="reason">boom &lt;2&gt;</td>' in page and 'id="requeue-all"' in page
    assert 'id="delete-all"' in page and "data-confirm" in page and 'name="ids" value="d1"' in page
    assert client.get("/api/dead").json() == as_json(invoke(app, "dead", "ls", "--json"))
    assert client.get("/api/dead?task=t.add&offset=1").json() == as_json(
        invoke(app, "dead", "ls", "--json", "--task", "t.add", "--offset", "1"))  # fmt: skip
    assert client.get("/api/dead?offset=x").status == 400
    detail = client.get("/dead/d2")
    assert detail.status == 200 and 'id="dead-reason">boom &lt;1&gt;' in detail.text
    assert client.get("/api/dead/d2").json() == as_json(invoke(app, "dead", "show", "d2", "--json"))
    assert client.get("/dead/ghost").status == 404

    corrupt_dead_letter(app, r, "bad-1")
    listed = client.get("/dead")
    assert listed.status == 200 and 'data-job-id="bad-1"' in listed.text
    shown = client.get("/dead/bad-1")
    assert shown.status == 200 and "dead-letter record of &#39;bad-1&#39;" in shown.text
    assert client.get("/api/dead/bad-1").json()["envelope_error"]


def test_requeue_and_delete_one_a_selection_and_all(
    app: Celery, r: redis.Redis, redis_url: str, dashboard: Dashboard, dead_ids: list[str]
) -> None:
    client = dashboard(allow_actions=True)
    store: Store = get_store(app)
    requeued = client.action("/dead/action", [("action", "requeue"), ("ids", "d1"), ("ids", "ghost")])
    assert requeued.status == 303
    said = flashes_of(requeued, client)
    assert said[0].startswith("d1: requeued, due ") and said[1] == "ghost: no dead letter with id 'ghost'"
    job = store.get("d1")
    assert job is not None and job.state == "waiting" and store.dead_record("d1") is None

    # The API twin answers what `dead requeue --json` prints (the due time aside).
    api = client.api("/api/dead/action", {"action": "requeue", "ids": ["d2"], "at": "+1h"})
    assert api.status == 200
    [result] = api.json()["results"]
    assert (result["id"], result["outcome"]) == ("d2", "requeued")
    job2 = store.get("d2")
    assert job2 is not None and abs(job2.due_ms - (server_ms(r) + 3_600_000)) < 60_000
    assert client.api("/api/dead/action", {"action": "requeue", "ids": ["d2"]}).status == 409  # gone

    before = snapshot(redis_url)
    assert client.action("/dead/action", [("action", "requeue"), ("ids", "d3"), ("at", "soon")]).status == 400
    assert client.action("/dead/action", [("action", "delete")]).status == 400  # nothing ticked
    assert dashboard().action("/dead/action", [("action", "delete-all")]).status == 403
    assert client.post("/dead/action", [("action", "delete-all")]).status == 400  # no CSRF token
    assert snapshot(redis_url) == before

    deleted = client.api("/api/dead/action", {"action": "delete", "ids": ["d3", "ghost"]})
    assert deleted.status == 409
    assert deleted.json()["results"] == [
        {"id": "d3", "outcome": "deleted", "message": "deleted"},
        {"id": "ghost", "outcome": "missing", "message": "no dead letter with id 'ghost'"},
    ]
    assert store.count_dead() == 0
    printed = invoke(app, "dead", "rm", "d3", "ghost", "--json")  # exit 1: neither is there now
    assert json.loads(printed.stdout)["results"][1] == deleted.json()["results"][1]

    for i in range(3):
        corrupt_dead_letter(app, r, f"c{i}")
    everything = client.action("/dead/action", [("action", "delete-all")])
    assert flashes_of(everything, client) == ["all dead letters: removed 3 dead letter(s)"]
    assert store.count_dead() == 0


def test_an_action_that_removes_an_item_from_its_own_page_lands_on_its_list(
    app: Celery, dashboard: Dashboard, dead_ids: list[str], two_schedules: Schedules
) -> None:
    """A dead letter requeued or deleted, or a schedule deleted, from its own page: the form's
    ``next`` is that page, which is a 404 now; the browser goes to the list instead (200)."""
    client = dashboard(allow_actions=True)
    for action, item in (("requeue", "d1"), ("delete", "d2")):
        answer = client.action("/dead/action", [("action", action), ("ids", item), ("next", f"/dead/{item}")])
        assert answer.location == "/dead"
        assert client.follow(answer).status == 200 and client.get(f"/dead/{item}").status == 404
    kept = client.action("/dead/action", [("action", "requeue"), ("ids", "d3"), ("next", "/dead/d1")])
    assert kept.location == "/dead/d1"  # another page than the item's: kept (a 404 here, as asked)
    gone = client.action(
        "/schedules/action", [("action", "delete"), ("name", "tick"), ("next", "/schedules/tick")]
    )
    assert gone.location == "/schedules" and client.follow(gone).status == 200
    paused = client.action(
        "/schedules/action", [("action", "pause"), ("name", "digest"), ("next", "/schedules/digest")]
    )
    assert paused.location == "/schedules/digest" and client.follow(paused).status == 200


def test_requeue_all(app: Celery, dashboard: Dashboard, dead_ids: list[str]) -> None:
    client = dashboard(allow_actions=True)
    answer = client.api("/api/dead/action", {"action": "requeue-all"})
    assert answer.status == 200
    assert sorted(x["id"] for x in answer.json()["results"]) == dead_ids
    store = get_store(app)
    assert store.count_dead() == 0 and all(store.get(job_id) is not None for job_id in dead_ids)


# -- keys and batches --------------------------------------------------------------------------------


def test_keys_list_detail_pause_resume_and_limit(
    app: Celery, r: redis.Redis, redis_url: str, dashboard: Dashboard
) -> None:
    gate_due(app, r, "tenant:42", 5, limit=2)
    gate_due(app, r, "tenant:<7>", 1, limit=None)
    client = dashboard(allow_actions=True)
    page = client.get("/keys").text
    assert rows(page, "data-key") == ["tenant:42", "tenant:<7>"]
    row = page[page.index('data-key="tenant:42"') :].split("</tr>")[0]
    assert '<td class="num limit">2</td>' in row and '<td class="num running">2</td>' in row
    assert '<td class="num waiting">3</td>' in row and 'name="limit"' in row and 'value="pause"' in row
    assert "tenant:&lt;7&gt;" in page
    assert client.get("/api/keys").json() == as_json(invoke(app, "keys", "--json"))
    assert client.get("/api/keys/tenant:42").json() == as_json(invoke(app, "key", "tenant:42", "--json"))
    assert 'id="key-waiting">3' in client.get("/keys/tenant:42").text

    raised = client.action("/keys/action", [("action", "limit"), ("key", "tenant:42"), ("limit", "4")])
    assert flashes_of(raised, client) == [
        "tenant:42: run-time limit 4; limit in force: 4; 2 waiting job(s) released"
    ]
    shown = as_json(invoke(app, "key", "tenant:42", "--json"))
    assert (shown["limit"], shown["override"], shown["waiting"]) == (4, "4", 1)
    assert re.search(r'<td class="override">4</td>', client.get("/keys").text)

    paused = client.api("/api/keys/action", {"action": "pause", "key": "tenant:42"})
    [result] = paused.json()["results"]
    assert paused.status == 200 and (result["outcome"], result["paused"], result["released"]) == (
        "paused",
        True,
        0,
    )
    assert without(result, "outcome", "message", "released") == as_json(
        invoke(app, "key", "tenant:42", "--json")
    )
    none = client.api("/api/keys/action", {"action": "limit", "key": "tenant:42", "limit": "none"}).json()
    assert (none["results"][0]["limit"], none["results"][0]["override"]) == (None, "none")
    resumed = client.api("/api/keys/action", {"action": "resume", "key": "tenant:42"}).json()["results"][0]
    assert resumed["message"] == "resumed; 1 waiting job(s) released" and resumed["paused"] is False
    cleared = client.api("/api/keys/action", {"action": "limit", "key": "tenant:42", "limit": "clear"})
    assert cleared.json()["results"][0]["override"] is None and cleared.json()["results"][0]["limit"] == 2

    before = snapshot(redis_url)
    for sent, message in (
        (
            [("action", "limit"), ("key", "tenant:42"), ("limit", "0")],
            "a concurrency limit is a whole number >= 1",
        ),
        (
            [("action", "limit"), ("key", "tenant:42"), ("limit", "x")],
            "a limit is a whole number >= 1, or 'none'",
        ),
        ([("action", "limit"), ("key", "tenant:42")], "limit: give a whole number"),
        ([("action", "pause"), ("key", "a{b}")], "a key is a non-empty string"),
        ([("action", "stop"), ("key", "tenant:42")], "action must be pause, resume or limit"),
    ):
        answer = client.action("/keys/action", sent)
        assert answer.status == 400 and message in html.unescape(answer.text), (sent, answer.text[:800])
        api = client.api("/api/keys/action", dict(sent))
        assert api.status == 400 and message in api.json()["error"]
    assert dashboard().action("/keys/action", [("action", "pause"), ("key", "tenant:42")]).status == 403
    assert client.post("/keys/action", [("action", "pause"), ("key", "tenant:42")]).status == 400
    assert snapshot(redis_url) == before


def test_batches_progress_detail_and_cancel(app: Celery, r: redis.Redis, dashboard: Dashboard) -> None:
    store: Store = get_store(app)
    now = server_ms(r)
    open_batch(app, "b1", 4, (now + 3_600_000) / 1000)
    assert store.open_batch("b0", 1, None, {})
    client = dashboard(allow_actions=True)
    page = client.get("/batches").text
    assert sorted(rows(page, "data-batch")) == ["b0", "b1"]
    row = page[page.index('data-batch="b1"') :].split("</tr>")[0]
    assert '<progress max="4" value="0">' in row and '<td class="num waiting">4</td>' in row
    assert client.get("/api/batches").json() == as_json(invoke(app, "batches", "--json"))
    assert client.get("/api/batches/b1").json() == as_json(invoke(app, "batch", "b1", "--json"))
    assert 'id="batch-total">4' in client.get("/batches/b1").text
    assert client.get("/batches/nope").status == 404

    assert dashboard().action("/batches/action", [("action", "cancel"), ("id", "b1")]).status == 403
    cancelled = client.action("/batches/action", [("action", "cancel"), ("id", "b1")])
    assert flashes_of(cancelled, client) == ["b1: 4 waiting member(s) cancelled"]
    assert store.get(member_id("b1", 0)) is None
    after = as_json(invoke(app, "batch", "b1", "--json"))
    assert (after["cancelled"], after["waiting"], after["done"]) == (4, 0, True)
    assert '<progress max="4" value="4">' in client.get("/batches").text
    again = client.api("/api/batches/action", {"action": "cancel", "id": "b1"}).json()["results"][0]
    assert without(again, "outcome", "message") == {**after, "cancelled_now": 0}
    missing = client.api("/api/batches/action", {"action": "cancel", "id": "nope"})
    assert missing.status == 409 and missing.json()["results"][0]["message"] == "no batch with id 'nope'"


# -- a full Redis ------------------------------------------------------------------------------------


def test_a_full_redis_answers_507_and_loses_nothing(dashboard: Dashboard) -> None:
    """With ``maxmemory`` reached (``noeviction``), a change that would grow memory is refused:
    the page says 507 (full, nothing lost) and every key is as it was."""
    with EmbeddedRedis(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        url = server.url + "/0"
        full = make_app(url)

        add_task(full)

        try:
            Schedules(full).add("tick", "t.add", 60.0, [1, 2])
            client = dashboard(full, allow_actions=True)
            assert client.get("/schedules").status == 200
            raw = redis.Redis.from_url(url)
            raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 20_000)
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                raw.set("probe", "x")
            before = snapshot(url)
            page = client.action("/schedules/new", [("name", "more"), ("task", "t.add"), ("every", "1m"),
                                                    ("args", "[1, 2]")])  # fmt: skip
            assert page.status == 507 and "is full (maxmemory reached)" in page.text, page.text[:500]
            api = client.api(
                "/api/schedules", {"name": "more", "task": "t.add", "every": "1m", "args": [1, 2]}
            )
            assert api.status == 507 and "nothing stored was lost" in api.json()["error"]
            ran = client.api("/api/schedules/action", {"action": "run-now", "name": "tick"})
            assert ran.status == 507 and "1 job(s) not stored" in ran.json()["error"]
            assert snapshot(url) == before
            assert client.get("/schedules").status == 200  # reading still works
            raw.close()
        finally:
            full.close()


# -- Redis unreachable -------------------------------------------------------------------------------


def test_with_redis_unreachable_each_page_and_action_says_503_without_the_password(
    dashboard: Dashboard,
) -> None:
    away = make_app("redis://:hunter2@127.0.0.1:1/0")
    try:
        client = dashboard(away, allow_actions=True)
        for path in ("/schedules", "/schedules/x", "/schedules/x/edit", "/dead", "/dead/x", "/keys/k",
                     "/batches/b", "/api/schedules", "/api/dead/x", "/api/keys/k"):  # fmt: skip
            answer = client.get(path)
            assert answer.status == 503, (path, answer.status, answer.text[:300])
            assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in html.unescape(answer.text), path
            assert "hunter2" not in answer.text and "Traceback" not in answer.text
        new = [("name", "n"), ("task", "t.noop"), ("every", "1m"), ("no_check_task", "on")]
        for path, sent in (("/schedules/action", [("action", "pause"), ("name", "x")]),
                           ("/dead/action", [("action", "delete-all")]),
                           ("/keys/action", [("action", "pause"), ("key", "k")]),
                           ("/schedules/new", new)):  # fmt: skip
            answer = client.action(path, sent)
            assert answer.status == 503 and "hunter2" not in answer.text, (path, answer.status)
    finally:
        away.close()
