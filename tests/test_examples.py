"""Each example runs against a real Redis with a real worker and beat."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_quickstart_example(redis_url: str, procs: Procs) -> None:
    env = dict(os.environ, DELAYQ_EXAMPLE_URL=redis_url,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs.start("worker", env, app="examples.quickstart")
    procs.start("beat", env, app="examples.quickstart")
    proc = subprocess.run([sys.executable, "-m", "examples.quickstart"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + procs.logs()
    ran = [line for line in proc.stdout.splitlines() if line.startswith("ran:")]
    assert len(ran) == 3, out
    assert [line.split()[2] for line in ran] == ["ada:", "bob:", "dee:"], out
    assert "pending now: 3" in out
