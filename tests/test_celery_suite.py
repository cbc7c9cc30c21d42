"""Celery's own integration tests, run with delayq's interception on, differ from plain Celery
only where the docs say (docs/one-off.md "Existing code: delayq_intercept_eta").

The tests come from the sdist of the installed Celery (``pip download celery==<version>
--no-binary :all: --no-deps``, kept in a cache directory between sessions), unmodified. Two
runs of the same selection go side by side, as subprocesses of pytest with the suite's own
conftest and worker; each run is split in two shards (:data:`SHARDS`), all four at once,
each against its own fresh Redis (broker, result backend and store):

* **plain**: plain Celery;
* **delayq**: every task a ``DelayedTask``, ``delayq_intercept_eta = True``, a
  ``@shared_task(base=DelayedTask)`` that binds to every app of the process (the suite's second
  apps too), and a real ``celery beat -S celery_delayq.Scheduler`` beside the suite's worker
  (:mod:`tests.celery_suite.plugin`, :mod:`tests.celery_suite.beat_app`).

The selection (:data:`SELECT`) is every test of ``t/integration/test_tasks.py`` and
``test_canvas.py`` whose name touches what delayq intercepts (eta, countdown, retries, the
chord countdown of Celery #7851, expiry, revocation, stamps), ``test_inspect.py``'s
``test_scheduled``, and ``test_backend_leak_in_fixture_teardown.py`` (a worker of a second app,
with a ``memory://`` broker and no delayq settings, started in the suite's process: it must
start and run as on plain Celery, though the suite's tasks with the mixin bind to it): a
plain run of the whole of both files had not finished after 10 minutes on a loaded 2-core
machine; this selection takes about 3 run whole, under 2 in shards. The
delayq run must fail exactly the tests the plain run fails (the suite's own setup, such as
a test that needs RabbitMQ) plus the documented differences (:data:`DOCUMENTED`), and must
have intercepted calls (a count the plugin keeps in the store).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import celery
import pytest
import redis

from celery_delayq.devtools.embedded import EmbeddedRedis
from tests.celery_suite.plugin import INTERCEPTED
from tests.support.polling import wait_for
from tests.support.processes import ROOT, Procs

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

#: Where sdists are kept between sessions.
CACHE = Path(tempfile.gettempdir()) / "celery-delayq-sdists"

#: test_inspect.py first: its test_scheduled expects the worker to hold no other delayed task
#: (on plain Celery, a retry left by an earlier test would be listed too).
FILES = [
    "t/integration/test_inspect.py",
    "t/integration/test_tasks.py",
    "t/integration/test_canvas.py",
    "t/integration/test_backend_leak_in_fixture_teardown.py",
]
#: ``-k``: the tests of test_tasks/test_canvas about what delayq intercepts, test_inspect's
#: ``test_scheduled`` (a documented difference), and the test that starts a worker of a second
#: app in the process (``TestApp``: a ``memory://`` broker, no delayq settings), which must
#: start as plain Celery's (``test_fixture_teardown_releases_backend_connections``).
SELECT = (
    "eta or retr or countdown or delay or stamp or expire or revoke or chord_on_error or test_scheduled"
    " or test_fixture_teardown"
)

#: The selection in two shards (``-k``), run at once in each mode, each on a Redis of its own;
#: test_scheduled is in the first. Mostly the suite's own waits: on 2026-12-07 (loaded machine)
#: the first took 211 s, 121 s of it test_fixture_teardown_releases_backend_connections (20
#: embedded workers started in turn), the second 90 s.
SHARDS = [f"({SELECT}) and not (revoke or expire)", f"({SELECT}) and (revoke or expire)"]

#: Where the docs list the differences from plain Celery.
DIFFERENCES_DOC, DIFFERENCES_ANCHOR = "docs/one-off.md", "what-differs-from-plain-celery"

#: The documented differences from plain Celery: test -> where the docs say it.
DOCUMENTED = {
    # No worker holds an intercepted job until it is due: `celery delayq ls` / DelayQ.pending().
    "t.integration.test_inspect.test_Inspect::test_scheduled": f"{DIFFERENCES_DOC}#{DIFFERENCES_ANCHOR}",
}

#: The test whose worker is of a second app without delayq settings (see the module docstring).
SECOND_APP = (
    "t.integration.test_backend_leak_in_fixture_teardown::test_fixture_teardown_releases_backend_connections"
)

#: Longest one run may take (s).
RUN_TIMEOUT = 600


def celery_sdist() -> Path:
    """The unpacked sdist of the installed Celery; skips the test when it cannot be fetched."""
    version = celery.__version__
    tree = CACHE / f"celery-{version}"
    if (tree / "t" / "integration" / "conftest.py").exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"celery-{version}.tar.gz"
    if not archive.exists():
        got = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"celery=={version}",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(CACHE),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if got.returncode != 0 or not archive.exists():
            pytest.skip(f"could not download the sdist of celery {version}: {got.stderr.strip()[-500:]}")
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return tree


def suite_env(sdist: Path, server: EmbeddedRedis, intercept: bool) -> dict[str, str]:
    url = server.url + "/0"
    env = dict(os.environ)
    env.update(
        TEST_BROKER=url,
        TEST_BACKEND=url,
        DELAYQ_SUITE_STORE=url,
        # the suite's own Redis client (t/integration/tasks.py): never the machine's 6379
        REDIS_HOST="127.0.0.1",
        REDIS_PORT=str(server.port),
        PYTHONPATH=os.pathsep.join([str(sdist), str(ROOT), env.get("PYTHONPATH", "")]),
        DELAYQ_SUITE_INTERCEPT="1" if intercept else "0",
    )
    return env


def start_suite(
    sdist: Path, env: dict[str, str], select: str, report: Path, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "celery.contrib.pytest",
        "-p",
        "tests.celery_suite.plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        "-k",
        select,
        f"--junitxml={report}",
        *FILES,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=str(sdist), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def outcomes(report: Path) -> tuple[set[str], set[str]]:
    """(passed, failed) test ids of a junit report: ``<module>.<class>::<name>``."""
    passed: set[str] = set()
    failed: set[str] = set()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is None:
            passed.add(name)
    return passed, failed


def test_celery_integration_suite_differs_from_plain_celery_only_where_documented(
    redis_server: EmbeddedRedis, redis_url: str, tmp_path: Path, procs: Procs
) -> None:
    pytest.importorskip("pydantic", reason="Celery's t/integration/tasks.py imports pydantic")
    sdist = celery_sdist()
    with contextlib.ExitStack() as servers:
        # Each run of a shard (SHARDS) on a Redis of its own; the first delayq shard's is the
        # fixture's (empty).
        plain = [servers.enter_context(EmbeddedRedis()) for _ in SHARDS]
        delayq = [redis_server, *(servers.enter_context(EmbeddedRedis()) for _ in SHARDS[1:])]
        stores = [redis.Redis.from_url(server.url + "/0") for server in delayq]
        servers.callback(lambda: [store.close() for store in stores])
        delayq_envs = [suite_env(sdist, server, intercept=True) for server in delayq]
        for env in delayq_envs:
            procs.start("beat", env, app="tests.celery_suite.beat_app")
        assert wait_for(lambda: procs.logs().count("delayq: beat") >= len(SHARDS), 60, 0.1), procs.logs()
        runs: dict[str, subprocess.Popen[bytes]] = {}
        for n, select in enumerate(SHARDS):
            plain_env = suite_env(sdist, plain[n], intercept=False)
            for mode, env in (("plain", plain_env), ("delayq", delayq_envs[n])):
                name = f"{mode}-{n}"
                runs[name] = start_suite(
                    sdist, env, select, tmp_path / f"{name}.xml", tmp_path / f"{name}.log"
                )
        try:
            for proc in runs.values():
                proc.wait(timeout=RUN_TIMEOUT)
        finally:
            for proc in runs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace")[-6000:] for name in runs}
        for name, proc in runs.items():
            assert proc.returncode in (0, 1), f"{name} run: exit {proc.returncode}\n{logs[name]}"
        for proc, _ in procs.procs:
            assert proc.poll() is None, procs.logs()
        intercepted = [int(store.get(INTERCEPTED) or 0) for store in stores]

    plain_passed: set[str] = set()
    plain_failed: set[str] = set()
    delayq_failed: set[str] = set()
    for n in range(len(SHARDS)):
        passed, failed = outcomes(tmp_path / f"plain-{n}.xml")
        plain_passed |= passed
        plain_failed |= failed
        delayq_failed |= outcomes(tmp_path / f"delayq-{n}.xml")[1]
    delayq_logs = "\n".join(logs[f"delayq-{n}"] for n in range(len(SHARDS)))
    plain_logs = "\n".join(logs[f"plain-{n}"] for n in range(len(SHARDS)))
    assert len(plain_passed) >= 30, plain_logs  # the selection ran
    assert SECOND_APP in plain_passed, plain_logs  # (it ran: a Redis result backend)
    # Each shard's delayq run went through delayq (at least one call each, ten in all).
    assert all(intercepted) and sum(intercepted) >= 10, f"calls through delayq {intercepted}\n{delayq_logs}"
    # Each documented difference passes on plain Celery and fails with delayq ...
    assert set(DOCUMENTED) <= plain_passed, plain_logs
    assert set(DOCUMENTED) <= delayq_failed, delayq_logs
    # ... and nothing else differs: delayq fails what plain Celery fails (the suite's own setup).
    assert delayq_failed - plain_failed == set(DOCUMENTED), delayq_logs
    # The section the differences point to names each of them.
    doc = (ROOT / DIFFERENCES_DOC).read_text()
    assert "### What differs from plain Celery" in doc
    assert "inspect().scheduled()" in doc and "DelayQ(app).pending()" in doc
