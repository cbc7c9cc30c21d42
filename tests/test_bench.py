"""Smoke test of the benchmark suite: ``python -m bench --smoke`` runs every row to the end
(the spark row's measure runs in tests/test_bench_spark.py).

It checks that the suite works (exit 0, every row in the table), never that a target is met:
the figures depend on the machine and on the work in progress.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import NAMES

ROOT = Path(__file__).resolve().parent.parent
#: Every row but spark's, whose measure tests/test_bench_spark.py runs on its own.
ROWS_HERE = [name for name in NAMES if name != "spark"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_smoke_benchmark_runs_every_row() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", ",".join(ROWS_HERE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for name in ROWS_HERE:
        assert any(line.startswith(f"| {name}: ") or line.startswith(f"| {name} ") for line in table), (
            f"row {name!r} missing from the table\n{proc.stdout}"
        )
    assert "| what " in proc.stdout and "| met? |" in proc.stdout
    # The flow row: no job of a key started before a slot of the key was free (it counts such
    # "negative gaps"), on its capped sides.
    flow = [line for line in table if line.startswith("| flow: ")]
    assert any("capped throughput" in line for line in flow), proc.stdout
    assert sum("release → next start" in line for line in flow) == 4, proc.stdout
    assert any("Redis commands per job" in line for line in flow), proc.stdout
    gaps = [line for line in proc.stdout.splitlines() if "negative gaps" in line]
    assert len(gaps) == 2 and all("the cap broken) 0;" in line for line in gaps), gaps


@pytest.mark.slow
def test_rows_are_listed() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == NAMES


@pytest.mark.slow
def test_unknown_row_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown row" in proc.stderr


@pytest.mark.parametrize(
    ("path", "flags", "called"),
    [
        ("push on claim (push.lua: ", [], "Store.push"),
        ("push (push_claimed.lua)", ["--no-push-on-claim"], "Store.claim"),
        ("kombu publish batch", ["--kombu"], "Store.claim"),
    ],
)
@pytest.mark.slow
def test_the_dispatch_profile_runs(path: str, flags: list[str], called: str) -> None:
    """``python -m bench.profile`` drains the jobs on the path it names and prints the call tree."""
    args = [sys.executable, "-m", "bench.profile", "3000", *flags]
    proc = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"dispatch path: {path}" in proc.stdout and "3,000 jobs due at once" in proc.stdout
    assert "Dispatcher.run_once" in proc.stdout and called in proc.stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_start_check_and_held_check_scripts_run() -> None:
    """``python -m bench.start_check`` (its consumer and real-worker lines, every worker's tasks
    run) and ``python -m bench.held_check`` (held again with a backend, redelivered without)
    print their figures."""
    start = subprocess.run(
        [sys.executable, "-m", "bench.start_check", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        stdin=subprocess.DEVNULL,
    )
    assert start.returncode == 0, (start.stdout + start.stderr)[-4000:]
    assert "claim, first start" in start.stdout and "bytes of Redis per record" in start.stdout
    workers = [line for line in start.stdout.splitlines() if line.startswith("in a worker")]
    assert len(workers) == 4 and all("us per task start" in line for line in workers), start.stdout
    held = subprocess.run(
        [sys.executable, "-m", "bench.held_check", "40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        stdin=subprocess.DEVNULL,
    )
    assert held.returncode == 0, (held.stdout + held.stderr)[-4000:]
    lines = held.stdout.splitlines()
    assert sum("'held': 40" in line for line in lines if line.startswith("with a result backend")) == 2, lines
    assert sum(line.startswith("without (redelivered)") for line in lines) == 2, lines


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="no valgrind (Debian's valgrind package)")
def test_the_server_instruction_count_runs() -> None:
    """``python -m bench.server_instructions`` drains its jobs under callgrind and prints the
    server's instructions a job, with each part's share of them."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.server_instructions", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = proc.stdout.splitlines()
    assert "300 real jobs pushed on claim" in lines[0] and "server instructions a job" in lines[0], lines
    shares = [float(line.rsplit("(", 1)[1].rstrip("%)")) for line in lines[1:]]
    assert len(shares) == 10 and shares[0] > 90 and all(0 < share <= 100 for share in shares), lines
