"""The overlap policy (``overlap``: allow, skip, buffer_one, cancel_previous) wherever a
schedule is defined and shown, as the DST choice is (tests/test_dst_surfaces.py): the CLI,
``beat_schedule`` (the beat's sync and its start check) and the dashboard's form, page and
JSON; each stored in a real Redis, and each refusing a bad value with a clear message."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_delayq.beat.scheduler import BeatConfigurationError, Scheduler
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.schedules.api import Schedules
from celery_delayq.schedules.spec import Schedule
from celery_delayq.store.facade import get_store
from tests.support.cli import as_json, invoke
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

Dashboard = Callable[..., Client]
POLICIES = "allow, skip, buffer_one, cancel_previous"


def stored(app: Celery, name: str) -> dict[str, Any]:
    """The definition of schedule ``name`` as Redis holds it."""
    definition, _ = get_store(app).schedule(name)
    assert definition is not None, f"schedule {name!r} is not stored"
    out: dict[str, Any] = json.loads(definition)
    return out


def schedule(app: Celery, name: str) -> Schedule:
    found = Schedules(app).get(name)
    assert found is not None, f"no schedule {name!r}"
    return found


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_add_update_show_ls_json(app: Celery) -> None:
    added = as_json(
        invoke(app, "schedules", "add", "n", "t.noop", "--cron", "*/5 * * * *", "--overlap", "skip", "--json")
    )
    assert added["overlap"] == "skip"
    assert stored(app, "n")["overlap"] == "skip"
    shown = invoke(app, "schedules", "show", "n").stdout
    assert re.search(r"^overlap\s+skip$", shown, flags=re.M), shown
    assert as_json(invoke(app, "schedules", "show", "n", "--json"))["overlap"] == "skip"

    # ls: an OVERLAP column once a listed schedule has a policy; "allow" left blank in it.
    as_json(invoke(app, "schedules", "add", "plain", "t.noop", "--every", "1m", "--json"))
    listed = invoke(app, "schedules", "ls").stdout
    header = listed.splitlines()[0]
    assert re.search(r"\bSTATE\s+OVERLAP\s+NEXT RUN\b", header), listed
    assert re.search(r"^n\s.*\bactive\s+skip\s", listed, flags=re.M), listed
    plain_row = next(line for line in listed.splitlines() if line.startswith("plain "))
    assert not re.search(r"\b(allow|skip|buffer_one|cancel_previous)\b", plain_row), listed
    by_name = {x["name"]: x for x in as_json(invoke(app, "schedules", "ls", "--json"))["schedules"]}
    assert (by_name["n"]["overlap"], by_name["plain"]["overlap"]) == ("skip", "allow")

    # update: another policy; another change keeps it; "allow" stores no field again.
    updated = as_json(invoke(app, "schedules", "update", "n", "--overlap", "buffer_one", "--json"))
    assert updated["overlap"] == "buffer_one" and stored(app, "n")["overlap"] == "buffer_one"
    kept = as_json(invoke(app, "schedules", "update", "n", "--grace", "5", "--json"))
    assert kept["overlap"] == "buffer_one"
    cancel = as_json(invoke(app, "schedules", "update", "n", "--overlap", "cancel_previous", "--json"))
    assert cancel["overlap"] == "cancel_previous"
    back = as_json(invoke(app, "schedules", "update", "n", "--overlap", "allow", "--json"))
    assert back["overlap"] == "allow" and "overlap" not in stored(app, "n")
    assert "OVERLAP" not in invoke(app, "schedules", "ls").stdout  # no policy left: no column
    assert re.search(r"^overlap\s+allow$", invoke(app, "schedules", "show", "n").stdout, flags=re.M)

    # A default schedule stores no field: its definition reads as before the choice existed.
    assert "overlap" not in stored(app, "plain") and schedule(app, "plain").overlap == "allow"


def test_cli_bad_values(app: Celery) -> None:
    bad = invoke(app, "schedules", "add", "m", "t.noop", "--every", "1m", "--overlap", "sometimes")
    assert bad.exit_code == 2, bad.output
    assert "'sometimes' is not one of 'allow', 'skip', 'buffer_one', 'cancel_previous'" in bad.stderr, (
        bad.stderr
    )
    piped = invoke(app, "schedules", "add", "a|b", "t.noop", "--every", "1m", "--overlap", "skip")
    assert piped.exit_code == 2 and "needs a name without '|'" in piped.stderr, piped.stderr
    assert Schedules(app).get("m") is None and Schedules(app).get("a|b") is None
    # "allow" is every name's (no slot is held).
    allowed = as_json(
        invoke(app, "schedules", "add", "a|b", "t.noop", "--every", "1m", "--overlap", "allow", "--json")
    )
    assert allowed["overlap"] == "allow"
    as_json(invoke(app, "schedules", "add", "u", "t.noop", "--every", "1m", "--json"))
    bad_update = invoke(app, "schedules", "update", "u", "--overlap", "later")
    assert bad_update.exit_code == 2 and "'later' is not one of 'allow'" in bad_update.stderr
    piped_update = invoke(app, "schedules", "update", "a|b", "--overlap", "cancel_previous")
    assert piped_update.exit_code == 2 and "needs a name without '|'" in piped_update.stderr
    assert schedule(app, "a|b").overlap == "allow" and schedule(app, "u").overlap == "allow"


# -- beat_schedule --------------------------------------------------------------------------------


def test_beat_schedule_entries_store_the_policy(app: Celery) -> None:
    schedules = Schedules(app)
    entries: dict[str, dict[str, Any]] = {
        "cron": {"task": "t.noop", "schedule": "*/5 * * * *", "overlap": "skip"},
        "every": {"task": "t.noop", "schedule": 30.0, "overlap": "cancel_previous"},
        "plain": {"task": "t.noop", "schedule": 60.0},
    }
    report = sync_config(schedules, entries)
    assert sorted(report["added"]) == ["cron", "every", "plain"]
    assert (stored(app, "cron")["overlap"], stored(app, "every")["overlap"]) == ("skip", "cancel_previous")
    assert "overlap" not in stored(app, "plain")
    cron = schedule(app, "cron")
    assert (cron.overlap, cron.origin) == ("skip", "config")
    # Unchanged entries are left alone; a changed policy is an update, and so is dropping it.
    assert sync_config(schedules, entries)["updated"] == []
    entries["cron"]["overlap"] = "buffer_one"
    assert sync_config(schedules, entries)["updated"] == ["cron"]
    assert schedule(app, "cron").overlap == "buffer_one"
    del entries["every"]["overlap"]
    assert sync_config(schedules, entries)["updated"] == ["every"]
    assert "overlap" not in stored(app, "every") and schedule(app, "every").overlap == "allow"


@pytest.mark.parametrize(
    ("name", "overlap", "message"),
    [
        ("tick", "sometimes", f"overlap must be one of {POLICIES}, got 'sometimes'"),
        ("tick", None, f"overlap must be one of {POLICIES}, got None"),
        ("tick", ["skip"], f"overlap must be one of {POLICIES}, got ['skip']"),
        ("a|b", "skip", "schedule 'a|b': overlap='skip' needs a name without '|'"),
    ],
)
def test_a_bad_policy_stops_the_beat_at_start(app: Celery, name: str, overlap: Any, message: str) -> None:
    app.conf.beat_schedule = {name: {"task": "t.noop", "schedule": 60.0, "overlap": overlap}}
    try:
        with pytest.raises(BeatConfigurationError) as raised:
            Scheduler(app)
    finally:
        app.conf.beat_schedule = {}
    text = str(raised.value)
    assert text.startswith(f"delayq: beat_schedule entry {name!r}: {message}"), text
    assert "\n" not in text  # one line: `Error: delayq: ...` from celery beat
    assert Schedules(app).get(name) is None  # nothing stored


def test_a_crontab_entry_with_a_policy_goes_to_redis_only(app: Celery) -> None:
    """Celery's ``ScheduleEntry`` cannot take ``overlap``: such an entry never reaches it."""
    app.conf.beat_schedule = {
        "c": {"task": "t.noop", "schedule": crontab(minute="*/10"), "overlap": "buffer_one"},
        "pipe|allowed": {"task": "t.noop", "schedule": 120.0, "overlap": "allow"},
        "plain": {"task": "t.noop", "schedule": crontab(minute="0", hour="4")},
    }
    beat = Scheduler(app)
    try:
        c = schedule(app, "c")
        assert c.rule.to_json()["expr"] == "*/10 * * * *"
        assert (c.overlap, c.origin) == ("buffer_one", "config")
        assert stored(app, "c")["overlap"] == "buffer_one"
        assert schedule(app, "pipe|allowed").overlap == "allow"
        assert schedule(app, "plain").overlap == "allow" and "overlap" not in stored(app, "plain")
        assert "c" not in beat.data and "c" not in beat.schedule  # not in Celery's memory
    finally:
        if beat.dispatcher is not None:
            beat.dispatcher.stop()
        app.conf.beat_schedule = {}


# -- the dashboard --------------------------------------------------------------------------------


def edit_fields(page: str) -> dict[str, str]:
    """The edit form as the browser sends it: inputs, text areas and selected options."""
    fields = dict(re.findall(r'<input name="(\w+)" value="([^"]*)"', page))
    fields.update(re.findall(r'<textarea name="(\w+)"[^>]*>([^<]*)</textarea>', page))
    for select, body in re.findall(r'<select name="(\w+)">(.*?)</select>', page, flags=re.S):
        fields[select] = re.findall(r'<option value="([^"]*)" selected>', body)[0]
    return {k: html.unescape(v) for k, v in fields.items()}


def form_errors(page: str) -> str:
    found = re.search(r'<ul class="errors"[^>]*>(.*?)</ul>', page, flags=re.S)
    return html.unescape(found.group(1)) if found else ""


@pytest.mark.slow
def test_dashboard_form_page_and_json(app: Celery, dashboard: Dashboard) -> None:
    client = dashboard(allow_actions=True)
    new_form = client.get("/schedules/new").text
    assert edit_fields(new_form)["overlap"] == "allow"  # the default, selected
    for policy in ("allow", "skip", "buffer_one", "cancel_previous"):
        assert f'<option value="{policy}"' in new_form
    made = client.action(
        "/schedules/new",
        [
            ("name", "n"),
            ("task", "t.noop"),
            ("every", "1m"),
            ("cron", ""),
            ("at", ""),
            ("overlap", "buffer_one"),
        ],
    )
    assert made.status == 303, form_errors(made.text) or made.text[:2000]
    assert schedule(app, "n").overlap == "buffer_one" and stored(app, "n")["overlap"] == "buffer_one"
    assert 'id="schedule-overlap">buffer_one<' in client.get("/schedules/n").text
    assert client.get("/api/schedules/n").json()["overlap"] == "buffer_one"
    assert {x["name"]: x["overlap"] for x in client.get("/api/schedules").json()["schedules"]} == {
        "n": "buffer_one"
    }

    # The edit form shows the policy; changing only it changes only it.
    fields = edit_fields(client.get("/schedules/n/edit").text)
    assert fields["overlap"] == "buffer_one"
    fields["overlap"] = "cancel_previous"
    saved = client.action("/schedules/n/edit", sorted(fields.items()))
    assert saved.status == 303, form_errors(saved.text)
    after = schedule(app, "n")
    assert (after.overlap, after.grace, after.rule.to_json()["every_ms"]) == ("cancel_previous", 60.0, 60_000)
    # The form sent unchanged changes nothing.
    same = client.action(
        "/schedules/n/edit", sorted(edit_fields(client.get("/schedules/n/edit").text).items())
    )
    assert same.status == 303 and schedule(app, "n").overlap == "cancel_previous"
    back = client.api("/api/schedules/n", {"overlap": "allow"})
    assert back.status == 200 and back.json()["overlap"] == "allow" and "overlap" not in stored(app, "n")
    assert 'id="schedule-overlap">allow<' in client.get("/schedules/n").text

    # Bad values: the form again (400) with the message, nothing changed.
    fields = edit_fields(client.get("/schedules/n/edit").text)
    fields["overlap"] = "sometimes"
    refused_form = client.action("/schedules/n/edit", sorted(fields.items()))
    assert refused_form.status == 400
    assert f"overlap must be one of {POLICIES}, got 'sometimes'" in form_errors(refused_form.text)
    refused = client.api("/api/schedules/n", {"overlap": "later"})
    assert (
        refused.status == 400 and f"overlap must be one of {POLICIES}, got 'later'" in refused.json()["error"]
    )
    assert schedule(app, "n").overlap == "allow"
    piped = client.api("/api/schedules", {"name": "a|b", "task": "t.noop", "every": "1m", "overlap": "skip"})
    assert piped.status == 400 and "needs a name without '|'" in piped.json()["error"], piped.text
    assert Schedules(app).get("a|b") is None
    added = client.api("/api/schedules", {"name": "j", "task": "t.noop", "every": "1m", "overlap": "skip"})
    assert added.status == 200 and added.json()["overlap"] == "skip" and stored(app, "j")["overlap"] == "skip"
