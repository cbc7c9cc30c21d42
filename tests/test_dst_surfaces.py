"""The chosen DST rule (``dst_gap``, ``dst_fold``) wherever a schedule is defined and shown:
``Schedules`` (stored in a real Redis), the CLI, ``beat_schedule`` (the beat's sync and its
start check) and the dashboard's form and page."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_delayq.beat.scheduler import BeatConfigurationError, Scheduler
from celery_delayq.beat.upkeep import sync_config
from celery_delayq.exceptions import InvalidSchedule
from celery_delayq.schedules.api import Schedules
from celery_delayq.schedules.rules import CronRule
from celery_delayq.store.facade import get_store
from tests.support.cli import as_json, invoke
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

Dashboard = Callable[..., Client]
PARIS = "Europe/Paris"


def stored_rule(app: Celery, name: str) -> dict[str, object]:
    definition, _ = get_store(app).schedule(name)
    assert definition is not None
    rule: dict[str, object] = json.loads(definition)["rule"]
    return rule


def test_api_stores_updates_and_shows_the_choice(app: Celery) -> None:
    schedules = Schedules(app)
    made = schedules.add("nightly", "t.noop", "30 2 * * *", tz=PARIS, dst_gap="skip", dst_fold="last")
    assert (made.dst_gap, made.dst_fold, made.dst) == ("skip", "last", "gap skip, fold last")
    assert stored_rule(app, "nightly") == {
        "type": "cron", "expr": "30 2 * * *", "tz": PARIS, "dst_gap": "skip", "dst_fold": "last",
    }  # fmt: skip
    # Another change keeps the choice; a new cron too; "cron" puts today's rule back.
    assert schedules.update("nightly", grace=5.0).dst == "gap skip, fold last"
    assert schedules.update("nightly", rule="0 3 * * *").dst == "gap skip, fold last"
    assert schedules.update("nightly", tz="America/New_York").rule == CronRule(
        "0 3 * * *", "America/New_York", "skip", "last"
    )
    back = schedules.update("nightly", dst_gap="cron")
    assert (back.dst_gap, back.dst_fold) == (None, "last")
    assert "dst_gap" not in stored_rule(app, "nightly")
    # Becoming an interval drops the choice (it has no meaning there).
    interval = schedules.update("nightly", rule=60)
    assert (interval.dst_gap, interval.dst_fold, interval.dst) == (None, None, "")
    with pytest.raises(InvalidSchedule, match="apply to cron rules only"):
        schedules.update("nightly", dst_fold="both")
    with pytest.raises(InvalidSchedule, match="dst_fold must be one of cron, first, both, last"):
        schedules.add("bad", "t.noop", "30 2 * * *", dst_fold="second")
    assert schedules.get("bad") is None
    # A default schedule stores no DST field: its definition reads as before the choice existed.
    plain = schedules.add("plain", "t.noop", "30 2 * * *", tz=PARIS)
    assert stored_rule(app, "plain") == {"type": "cron", "expr": "30 2 * * *", "tz": PARIS}
    assert plain.dst == "cron"


def test_a_definition_stored_by_a_release_without_the_choice_reads_and_fires(
    app: Celery, r: redis.Redis
) -> None:
    schedules = Schedules(app)
    schedules.add("old", "t.noop", "30 2 * * *", tz=PARIS)
    definition, _ = get_store(app).schedule("old")
    assert definition is not None and "dst" not in definition  # exactly the released form
    got = schedules.get("old")
    assert got is not None and got.rule == CronRule("30 2 * * *", PARIS) and got.next_run is not None


def test_cli_add_update_show_ls_and_bad_values(app: Celery) -> None:
    added = as_json(
        invoke(
            app,
            "schedules",
            "add",
            "n",
            "t.noop",
            "--cron",
            "30 2 * * *",
            "--tz",
            PARIS,
            "--dst-gap",
            "skip",
            "--dst-fold",
            "both",
            "--json",
        )
    )
    assert (added["dst_gap"], added["dst_fold"], added["dst"]) == ("skip", "both", "gap skip, fold both")
    assert added["rule"]["dst_gap"] == "skip"
    shown = invoke(app, "schedules", "show", "n").stdout
    assert re.search(r"^DST rule\s+gap skip, fold both$", shown, flags=re.M), shown
    listed = invoke(app, "schedules", "ls").stdout
    assert "cron '30 2 * * *' Europe/Paris (DST gap skip, fold both)" in listed, listed
    updated = as_json(invoke(app, "schedules", "update", "n", "--dst-fold", "last", "--json"))
    assert (updated["dst_gap"], updated["dst_fold"]) == ("skip", "last")
    bad = invoke(app, "schedules", "add", "m", "t.noop", "--cron", "0 * * * *", "--dst-gap", "later")
    assert bad.exit_code == 2 and "'later' is not one of 'cron', 'jump', 'skip'" in bad.stderr, bad.stderr
    interval = invoke(app, "schedules", "add", "m", "t.noop", "--every", "1m", "--dst-gap", "skip")
    assert interval.exit_code == 2 and "dst_gap and dst_fold apply to cron rules only" in interval.stderr
    assert Schedules(app).get("m") is None
    default = as_json(invoke(app, "schedules", "add", "d", "t.noop", "--cron", "0 * * * *", "--json"))
    assert (default["dst_gap"], default["dst_fold"], default["dst"]) == (None, None, "cron")


def test_beat_schedule_entries_choose_and_bad_ones_stop_the_beat(app: Celery) -> None:
    schedules = Schedules(app)
    entries = {
        "text": {"task": "t.noop", "schedule": "30 2 * * *", "dst_gap": "skip", "dst_fold": "both"},
        "rule": {"task": "t.noop", "schedule": CronRule("0 1 * * *", PARIS, dst_fold="last")},
    }
    report = sync_config(schedules, entries)
    assert sorted(report["added"]) == ["rule", "text"]
    text, rule = schedules.get("text"), schedules.get("rule")
    assert text is not None and (text.dst_gap, text.dst_fold, text.origin) == ("skip", "both", "config")
    assert rule is not None and rule.dst == "gap cron, fold last"
    # Unchanged entries are left alone; a changed choice is an update.
    assert sync_config(schedules, entries)["updated"] == []
    entries["text"]["dst_fold"] = "first"
    assert sync_config(schedules, entries)["updated"] == ["text"]
    assert schedules.get("text").dst_fold == "first"  # type: ignore[union-attr]

    for entry, message in (
        ({"task": "t.noop", "schedule": "30 2 * * *", "dst_fold": "second"}, "dst_fold must be one of"),
        ({"task": "t.noop", "schedule": 60.0, "dst_gap": "skip"}, "dst_gap and dst_fold apply to cron"),
    ):
        app.conf.beat_schedule = {"tick": entry}
        with pytest.raises(BeatConfigurationError, match=f"delayq: beat_schedule entry 'tick': {message}"):
            Scheduler(app)
    app.conf.beat_schedule = {}


@pytest.mark.slow
def test_dashboard_form_and_page(app: Celery, dashboard: Dashboard) -> None:
    client = dashboard(allow_actions=True)
    new_form = client.get("/schedules/new").text
    assert 'name="dst_gap"' in new_form and 'name="dst_fold"' in new_form
    made = client.action(
        "/schedules/new",
        [
            ("name", "n"),
            ("task", "t.noop"),
            ("cron", "30 2 * * *"),
            ("tz", PARIS),
            ("dst_gap", "jump"),
            ("dst_fold", "last"),
            ("every", ""),
            ("at", ""),
        ],
    )
    assert made.status == 303, made.text[:2000]
    assert Schedules(app).get("n").dst == "gap jump, fold last"  # type: ignore[union-attr]
    page = client.get("/schedules/n").text
    assert 'id="schedule-dst">gap jump, fold last<' in page
    assert "(DST gap jump, fold last)" in client.get("/schedules").text
    edit = client.get("/schedules/n/edit").text
    assert '<option value="jump" selected>' in edit and '<option value="last" selected>' in edit
    # The form as the browser sends it (inputs, text areas, selected options), one choice changed.
    fields = dict(re.findall(r'<input name="(\w+)" value="([^"]*)"', edit))
    fields.update(re.findall(r'<textarea name="(\w+)"[^>]*>([^<]*)</textarea>', edit))
    for select, body in re.findall(r'<select name="(\w+)">(.*?)</select>', edit, flags=re.S):
        fields[select] = re.findall(r'<option value="([^"]*)" selected>', body)[0]
    fields = {k: html.unescape(v) for k, v in fields.items()}
    assert (fields["dst_gap"], fields["dst_fold"]) == ("jump", "last")
    fields["dst_fold"] = "both"
    saved = client.action("/schedules/n/edit", sorted(fields.items()))
    assert saved.status == 303, re.search(r'<ul class="errors"[^>]*>(.*?)</ul>', saved.text, flags=re.S)
    assert Schedules(app).get("n").dst == "gap jump, fold both"  # type: ignore[union-attr]
    refused = client.api("/api/schedules/n", {"dst_gap": "later"})
    assert refused.status == 400 and "dst_gap must be one of cron, jump, skip" in refused.json()["error"]
    # An interval made with the form's defaults ("cron") is fine.
    interval = client.action(
        "/schedules/new",
        [("name", "i"), ("task", "t.noop"), ("every", "1m"), ("dst_gap", "cron"), ("dst_fold", "cron")],
    )
    assert interval.status == 303, interval.text[:2000]
    assert 'id="schedule-dst"' not in client.get("/schedules/i").text


def test_a_crontab_entry_with_a_choice_goes_to_redis_only(app: Celery) -> None:
    """Celery's ``ScheduleEntry`` cannot take ``dst_gap``: such an entry never reaches it."""
    from celery.schedules import crontab

    app.conf.beat_schedule = {
        "c": {"task": "t.noop", "schedule": crontab(minute="30", hour="2"), "dst_gap": "skip"},
        "plain": {"task": "t.noop", "schedule": crontab(minute="0", hour="4")},
    }
    beat = Scheduler(app)
    try:
        stored = Schedules(app).get("c")
        assert stored is not None and stored.rule.to_json()["expr"] == "30 2 * * *"
        assert (stored.dst_gap, stored.dst_fold, stored.origin) == ("skip", None, "config")
        assert Schedules(app).get("plain").dst == "cron"  # type: ignore[union-attr]
        assert "c" not in beat.data and "c" not in beat.schedule  # not in Celery's memory
    finally:
        if beat.dispatcher is not None:
            beat.dispatcher.stop()
        app.conf.beat_schedule = {}
