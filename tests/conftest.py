"""Test session: fixture registration and hooks only.

Fixtures and helpers live in ``tests/support`` and test modules import helpers from there
explicitly (``from tests.support.apps import make_app``). The general modules listed in
``pytest_plugins`` register their fixtures for every test, so those fixtures (``redis_url``,
``r``, ``app``, ``app_factory``, ``dispatchers``, ``procs``, ``store``...) need no import; a
fixture of one area (``dashboard``, ``producers``, ``spark``, ``browser``, ``cluster_url``,
``wake``) is imported by the test modules that use it.

Markers (``pyproject.toml``): ``e2e`` for tests that start celery worker/beat processes or
the demo, ``slow`` for long ones, ``cluster``, ``spark``, ``rabbitmq`` for what a test needs.
``pytest -m "not e2e and not slow"`` is the fast half.

The ``slow`` rule is kept by the report: a test with neither marker whose call took
:data:`SLOW_SECONDS` or more is listed at the end of the run, under "not marked slow";
``DELAYQ_STRICT_SLOW=1`` makes such a test fail the run (wall-clock time on a loaded machine
varies, so by default it is a report, not a failure).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

#: A call this long or longer belongs to a test marked ``slow`` (pyproject's marker text).
SLOW_SECONDS = 0.5
#: The fast-half tests over :data:`SLOW_SECONDS` in this session: (node id, seconds).
UNMARKED_SLOW: list[tuple[str, float]] = []

#: The general fixture modules, for every test. A fixture of one area is imported by the test
#: modules that use it (``from tests.support.web import dashboard``, named in ``__all__``):
#: ``producers`` (tests.support.stack), ``dashboard`` (web), ``spark``, ``browser``,
#: ``redis_cluster`` and ``cluster_url`` (cluster), ``wake``.
pytest_plugins = [
    "tests.support.apps",
    "tests.support.servers",
    "tests.support.processes",
    "tests.support.store",
]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
    if (
        rep.when == "call"
        and rep.passed
        and rep.duration >= SLOW_SECONDS
        and item.get_closest_marker("slow") is None
        and item.get_closest_marker("e2e") is None
    ):
        UNMARKED_SLOW.append((item.nodeid, rep.duration))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """List the tests that took :data:`SLOW_SECONDS` or more without a ``slow`` or ``e2e`` marker."""
    if not UNMARKED_SLOW:
        return
    terminalreporter.section(f"not marked slow (a call of {SLOW_SECONDS:g} s or more)")
    for nodeid, seconds in sorted(UNMARKED_SLOW, key=lambda found: -found[1]):
        terminalreporter.line(f"{seconds:6.2f} s  {nodeid}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if UNMARKED_SLOW and os.environ.get("DELAYQ_STRICT_SLOW") == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
