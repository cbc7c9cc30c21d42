"""What a new user sees first, as real processes: each mistake is one line naming the setting
as the user spells it, help text is clean, and a cron string in ``beat_schedule`` works.

The demo's own first contact (an unreachable ``--url``, its logs, a slow worker) is in
tests/test_demo.py; the quickstart's run is in tests/test_docs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner

from celery_delayq import Schedules
from celery_delayq.cli import iter_commands
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import ROOT, stop_processes

#: A short error: a banner line at most, then ``Error: ...``.
MAX_LINES = 4

DJANGO_APP = """
from celery import Celery


class Settings:  # Django's settings.py, as config_from_object(..., namespace="CELERY") reads it
    CELERY_BROKER_URL = "amqp://guest:guest@127.0.0.1:1//"


app = Celery("mysite")
app.config_from_object(Settings, namespace="CELERY")
"""

PLAIN_APP = """
from celery import Celery

app = Celery("proj", broker="amqp://guest:guest@127.0.0.1:1//")
"""

CRON_APP = """
import os

from celery import Celery

app = Celery("cronproj", broker=os.environ["CRON_URL"])
app.conf.broker_connection_retry_on_startup = True
app.conf.beat_schedule = {
    "tick": {"task": "cronproj.tick", "schedule": os.environ["CRON_RULE"], "args": (1,)},
}


@app.task(name="cronproj.tick")
def tick(n):
    return n
"""


def _env() -> dict[str, str]:
    """The environment without Celery's own variables (CELERY_APP, CELERY_BROKER_URL, ...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env or _env(), capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _short(out: str) -> None:
    assert "Traceback" not in out, out
    assert len(out.strip().splitlines()) <= MAX_LINES, out


# -- c. the beat with no store URL --------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "spelled", "advice"),
    [
        (DJANGO_APP, "CELERY_DELAYQ_URL", "set CELERY_DELAYQ_URL = 'redis://"),
        (PLAIN_APP, "delayq_url", "set app.conf.delayq_url = 'redis://"),
    ],
    ids=["django-namespace", "plain"],
)
@pytest.mark.slow
def test_beat_without_a_store_url_is_one_line_naming_the_setting(
    tmp_path: Path, source: str, spelled: str, advice: str
) -> None:
    (tmp_path / "proj.py").write_text(source)
    code, out = _run(["celery", "-A", "proj", "beat", "-S", "celery_delayq.Scheduler"], tmp_path)
    assert code != 0, out
    _short(out)
    assert f"Error: delayq: {spelled} is not set and the broker is not Redis" in out, out
    assert advice in out
    if spelled != "delayq_url":
        assert "delayq_url" not in out and "app.conf" not in out


@pytest.mark.slow
def test_the_delayq_command_names_the_django_setting_too(tmp_path: Path) -> None:
    (tmp_path / "proj.py").write_text(DJANGO_APP)
    code, out = _run(["celery", "-A", "proj", "delayq", "status"], tmp_path)
    assert code == 3, out
    _short(out)
    assert "CELERY_DELAYQ_URL is not set" in out and "delayq_url" not in out


# -- d. celery delayq without -A ----------------------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["schedules", "ls"]])
@pytest.mark.slow
def test_delayq_without_an_app_says_to_pass_dash_a(tmp_path: Path, command: list[str]) -> None:
    code, out = _run(["celery", "delayq", *command], tmp_path)
    assert code == 3, out
    _short(out)
    assert "no Celery app: pass -A/--app proj" in out, out
    assert f"celery -A proj delayq {' '.join(command)}" in out


# -- e. help text without RST literals ---------------------------------------------------------


def _help_commands() -> list[list[str]]:
    """Every ``celery delayq`` group and command, as ``celery`` arguments."""
    groups = sorted({path.split()[0] for path in iter_commands() if " " in path})
    commands = [["delayq", group, "--help"] for group in groups]
    return commands + [["delayq", *path.split(), "--help"] for path in iter_commands()]


@pytest.mark.slow
def test_no_help_output_shows_double_backticks(tmp_path: Path) -> None:
    """The entry points as a user runs them, in processes of their own; then every group and
    command through ``celery``'s own click group in this process (the same help, a second a
    process less each)."""
    for command in [
        ["celery_delayq", "--help"],
        ["celery_delayq", "demo", "--help"],
        ["celery", "delayq", "--help"],
    ]:
        code, out = _run(command, tmp_path)
        assert code == 0, (command, out)
        assert "Usage" in out or "usage" in out, (command, out)
        assert "``" not in out, (command, out)
    commands = _help_commands()
    assert len(commands) > 20
    for command in commands:
        result = CliRunner().invoke(celery_main, command, prog_name="celery")
        out = result.output
        assert result.exit_code == 0, (command, out)
        assert out.startswith(f"Usage: celery {' '.join(command[:-1])} "), (command, out)
        assert "``" not in out, (command, out)


# -- h. a cron string in beat_schedule ----------------------------------------------------------


@pytest.mark.e2e
def test_a_cron_string_in_beat_schedule_runs_from_the_store(tmp_path: Path, redis_url: str) -> None:
    """Celery's own ScheduleEntry cannot hold a string; delayq's beat stores it in Redis."""
    (tmp_path / "cronproj.py").write_text(CRON_APP)
    env = dict(_env(), CRON_URL=redis_url, CRON_RULE="* * * * * */2")  # every 2 s (seconds last)
    log = tmp_path / "beat.log"
    with open(log, "wb") as out:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "cronproj", "beat", "-S", "celery_delayq.Scheduler",
             "-l", "info", "--schedule", str(tmp_path / "beat-schedule")],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    app = make_app(redis_url)
    try:
        # The beat published the entry's runs into the task's queue (Redis broker: list "celery").
        assert wait_for(lambda: client.llen("celery") >= 2, 60, 0.2), log.read_text(errors="replace")
        stored = Schedules(app).get("tick")
        assert stored is not None and stored.origin == "config" and stored.task == "cronproj.tick"
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "beat_schedule in Redis: 1 added" in text, text
    finally:
        stop_processes([beat])
        client.close()
        app.close()


@pytest.mark.slow
def test_a_bad_cron_string_in_beat_schedule_is_one_line_naming_the_entry(tmp_path: Path) -> None:
    (tmp_path / "cronproj.py").write_text(CRON_APP)
    env = dict(_env(), CRON_URL="redis://127.0.0.1:1/0", CRON_RULE="61 * * * *")
    code, out = _run(["celery", "-A", "cronproj", "beat", "-S", "celery_delayq.Scheduler"], tmp_path, env)
    assert code != 0, out
    _short(out)
    assert "Error: delayq: beat_schedule entry 'tick': malformed cron expression '61 * * * *'" in out, out
