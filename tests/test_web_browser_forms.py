"""The dashboard's landings, its forms shown again after a refusal, and its list pages at a
phone's width, in headless Chromium (tests/support/browser.py) against the test Redis (no
worker or beat: nothing here needs one to run a job). docs/dashboard.md, "Where an action
lands"; issue 52."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayQ, Schedules
from celery_delayq.store.facade import get_store
from tests.support.browser import WINDOW, Browser, browser
from tests.support.store import bury, gate_due
from tests.support.web import serve_dashboard

__all__ = ["browser"]  # a fixture, used by name

pytestmark = pytest.mark.slow

#: A phone's width, as the issue tried it.
PHONE = 390
#: What must be on screen in every row of a list: its state, its buttons and fields.
ON_SCREEN = (
    "main table tbody tr button, main table tbody tr .state, main table tbody tr input, main table tbody td"
)


@pytest.fixture
def board(browser: Browser, app: Celery) -> Iterator[Browser]:
    """The browser on the test app's dashboard (actions allowed, no live refresh)."""
    with serve_dashboard(app, allow_actions=True, refresh_seconds=0) as base:
        browser.base = base
        browser.console_errors()
        try:
            yield browser
        finally:
            browser.driver.set_window_size(*WINDOW)


def _load(page: Browser, css: str) -> None:
    page.accept_confirms()
    page.click_and_load(css)


def test_a_schedules_pause_resume_and_run_now_land_on_its_page(board: Browser, app: Celery) -> None:
    Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    board.open("/schedules/tick")
    _load(board, "button[name=action][value=pause]")
    assert board.path() == "/schedules/tick" and board.text("#schedule-state") == "paused"
    assert "tick: paused" in board.text("#flashes")
    _load(board, "button[name=action][value=resume]")
    assert board.path() == "/schedules/tick" and board.text("#schedule-state") == "active"
    _load(board, "button[name=action][value=run-now]")
    assert board.path() == "/schedules/tick" and ": stored {tick}@run-now-" in board.text("#flashes")
    _load(board, "button[name=action][value=delete]")
    assert board.path() == "/schedules" and "tick: deleted" in board.text("#flashes")
    assert board.console_errors() == []


def test_a_bad_reschedule_time_shows_the_jobs_page_again_with_what_was_typed(
    board: Browser, app: Celery
) -> None:
    job = app.tasks["t.add"].apply_in(3600, (1, 2), task_id="report-7").id
    due = get_store(app).get(job).due_ms
    board.open(f"/jobs/{job}")
    field = board.find("form#reschedule input[name=when]")
    field.send_keys("next tuesday")
    _load(board, "form#reschedule button[type=submit]")
    assert board.text("#job-id") == "report-7"  # the job's page, not an error page
    assert board.text("#form-error").startswith("when: "), board.text("#form-error")
    assert board.find("form#reschedule input[name=when]").get_attribute("value") == "next tuesday"
    assert get_store(app).get(job).due_ms == due
    # corrected in place, it goes through and lands on the job's page
    field = board.find("form#reschedule input[name=when]")
    field.clear()
    field.send_keys("+2h")
    _load(board, "form#reschedule button[type=submit]")
    assert board.path() == f"/jobs/{job}" and board.text("#flashes").startswith("report-7: due ")


def _wide_lists(app: Celery, r: redis.Redis) -> None:
    """Every list page with rows whose names, ids and arguments are long."""
    tag = "enterprise-customer-with-a-very-long-name"
    gate_due(app, r, f"tenant:{tag}", 3, limit=1)
    DelayQ(app).pause(f"tenant:{tag}")
    DelayQ(app).set_limit("tenant:7", 4, new=True)
    Schedules(app).add(f"nightly-customer-invoice-export-to-the-accounting-system-{tag}", "t.noop",
                       "0 3 * * *", tz="America/Argentina/Buenos_Aires")  # fmt: skip
    add = app.tasks["t.add"]
    DelayQ(app).batch([add.s(i, i) for i in range(3)], eta=time.time() + 7200, batch_id="batch-" + "b" * 60)
    add.apply_in(7200, ("x" * 300, list(range(60))), task_id=f"invoice-2026-11-{tag}-0123456789abcdef")
    add.apply_at(time.time() - 1, (1, 2), task_id="dead-" + "d" * 80)
    bury(app, "dead-" + "d" * 80, reason="publish failed: connection to the broker lost " * 3)


def _off_screen(page: Browser, width: int) -> list[str]:
    """Every element of :data:`ON_SCREEN` whose box is not within ``width``."""
    found: list[Any] = page.driver.execute_script(
        """const w = arguments[1], out = [];
        for (const el of document.querySelectorAll(arguments[0])) {
          const r = el.getBoundingClientRect();
          const off = r.width && (r.left < 0 || r.right > w + 0.5);
          if (off) out.push(el.outerHTML.slice(0, 120) + ' ' + r.right);
        }
        return out;""",
        ON_SCREEN,
        width,
    )
    return [str(f) for f in found]


def test_nothing_of_a_list_is_off_screen_at_390px(board: Browser, app: Celery, r: redis.Redis) -> None:
    """At 390 px, every row's cells, state, fields and buttons of the keys, schedules, batches,
    jobs and dead letters lists are within the window (no table scrolls sideways), and so is
    the page. A screenshot of each at that width (keys-390.png...)."""
    _wide_lists(app, r)
    board.driver.set_window_size(PHONE, 900)
    inner = int(board.driver.execute_script("return window.innerWidth;"))
    assert inner == PHONE
    for path in ("/keys", "/schedules", "/batches", "/jobs", "/dead"):
        board.open(path)
        board.wait(lambda: board.find("main#main").is_displayed(), 30, f"main on {path}")
        rows = board.find_all("main table tbody tr")
        assert len(rows) >= 1, path
        assert _off_screen(board, inner) == [], path
        wide = int(board.driver.execute_script("return document.documentElement.scrollWidth;"))
        assert wide <= inner, f"{path}: {wide} px wide"
        if path == "/keys":
            paused = board.find("table#keys tr[data-key^='tenant:enterprise'] .state")
            assert paused.text == "paused" and paused.is_displayed()
        board.screenshot(f"{path.strip('/')}-{PHONE}")
    board.driver.set_window_size(1366, 900)  # a wide window keeps the table
    board.open("/keys")
    assert board.find("table#keys thead").is_displayed()
    assert board.console_errors() == []
