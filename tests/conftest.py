"""Test session: fixture registration and hooks only.

Fixtures and helpers live in ``tests/support`` and test modules import helpers from there
explicitly (``from tests.support.apps import make_app``). The modules listed in
``pytest_plugins`` register their fixtures for every test, so fixtures used by name
(``redis_url``, ``app``, ``procs``, ``spark``...) need no import.

Markers (``pyproject.toml``): ``e2e`` for tests that start celery worker/beat processes or
the demo, ``slow`` for long ones, ``cluster``, ``spark``, ``rabbitmq`` for what a test needs.
``pytest -m "not e2e and not slow"`` is the fast half.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest_plugins = [
    "tests.support.apps",
    "tests.support.servers",
    "tests.support.processes",
    "tests.support.cluster",
    "tests.support.spark",
    "tests.support.wire",
    "tests.support.store",
    "tests.support.stack",
    "tests.support.wake",
    "tests.support.web",
    "tests.support.browser",
]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
