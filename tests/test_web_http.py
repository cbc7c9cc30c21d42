"""The dashboard over HTTP: each page and its JSON twin answer, and the JSON API serves the
shapes ``celery delayq ... --json`` prints (one definition, :mod:`celery_delayq.views`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from celery import Celery

from tests.support.cli import as_json, invoke
from tests.support.web import Client

PAGES = ["/", "/jobs", "/schedules", "/dead", "/keys", "/batches"]


@pytest.fixture
def stored(app: Celery) -> list[str]:
    """Three jobs of the test app's ``t.add``, due in 1, 2 and 3 hours."""
    add = app.tasks["t.add"]
    return [add.apply_in(3600 * (i + 1), args=(i, i)).id for i in range(3)]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_answers_with_html_and_the_store_in_it(
    dashboard: Callable[..., Client], stored: list[str], path: str
) -> None:
    answer = dashboard().get(path)
    assert answer.status == 200, answer.text[:500]
    assert answer.headers["content-type"].startswith("text/html")
    assert "read-only" in answer.text
    assert "script-src 'self'" in answer.headers["content-security-policy"]


@pytest.mark.parametrize(
    ("path", "command"),
    [
        ("/api/jobs", ["ls", "--json"]),
        ("/api/schedules", ["schedules", "ls", "--json"]),
        ("/api/dead", ["dead", "ls", "--json"]),
        ("/api/keys", ["keys", "--json"]),
        ("/api/batches", ["batches", "--json"]),
    ],
)
def test_the_json_api_serves_what_the_cli_prints(
    app: Celery, dashboard: Callable[..., Client], stored: list[str], path: str, command: list[str]
) -> None:
    served = dashboard().get(path)
    assert served.status == 200 and served.headers["content-type"] == "application/json"
    assert served.json() == as_json(invoke(app, *command))


def test_api_status_is_the_cli_status_plus_the_next_24_hours(
    app: Celery, dashboard: Callable[..., Client], stored: list[str]
) -> None:
    served = dashboard().get("/api/status").json()
    printed = as_json(invoke(app, "status", "--json"))
    assert set(served) == set(printed) | {"due_24h", "lateness_last_hour"}
    assert served["totals"] | {"oldest_overdue_ms": None} == printed["totals"] | {"oldest_overdue_ms": None}
    assert sum(served["due_24h"]["counts"]) == 3
    assert served["due_24h"]["bucket_seconds"] == 3600 and len(served["due_24h"]["counts"]) == 24
    assert sum(served["due_24h"]["counts"][0:4]) == 3
    assert time.time() * 1000 - served["now_ms"] < 60_000
