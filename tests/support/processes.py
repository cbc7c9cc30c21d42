"""Real ``celery worker`` / ``celery beat`` processes of ``tests.apps.e2e_app``: the project
root, their environment, :class:`Procs` and its ``procs`` fixture, and :func:`stop_processes`.

A failed test prints the processes' logs; the hook that records each phase's report
(``rep_call``) is in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: The repository (the working directory of every subprocess and first on its PYTHONPATH).
ROOT = Path(__file__).resolve().parent.parent.parent

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
        self,
        kind: str,
        env: dict[str, str],
        *args: str,
        app: str = E2E_APP,
        pool: str = "threads -c 8",
        level: str = "info",
    ) -> subprocess.Popen[bytes]:
        """``kind`` (worker/beat) with ``args``; a worker's pool is ``pool`` (``-P`` and what follows,
        e.g. ``"prefork -c 2"``); ``level``: the log level (``warning`` spares a worker that runs
        100,000 tasks two lines of log each)."""
        n = len(self.procs)
        log = self.tmp_path / f"{kind}-{n}.log"
        cmd = [sys.executable, "-m", "celery", "-A", app, kind, "-l", level, *args]
        if kind == "worker":
            cmd += [
                "-P",
                *pool.split(),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                f"w{n}@%h",
            ]
        elif kind == "beat":
            cmd += ["-S", "celery_delayq.Scheduler", "--schedule", str(self.tmp_path / f"beat-{n}")]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(ROOT)
            )
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
            for _, log in self.procs
            if log.exists()
        )

    def stop_all(self) -> None:
        stop_processes(proc for proc, _ in self.procs)


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(p.logs())


def stop_processes(procs: Iterable[subprocess.Popen[Any]], timeout: float = 15) -> None:
    """Terminate every process still running, then wait for each; kill one that outlives
    ``timeout`` seconds."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
