"""``celery -A proj delayq ...``: look at and manage the stored jobs, schedules and dead letters.

A Celery sub-command, registered through the ``celery.commands`` entry point, so it
runs with the app ``-A`` names and that app's ``delayq_*`` settings. See docs/cli.md.
Its tables need ``rich`` (the ``cli`` extra); without it, ``celery delayq --help`` still
lists the commands, every command says in one line how to install it (exit 1), and
``celery`` itself still runs.

The modules: :mod:`.group` (the ``delayq`` group), :mod:`.jobs`, :mod:`.schedules`,
:mod:`.dead`, :mod:`.status`, :mod:`.flow` (gate keys and batches), :mod:`.web` (the
dashboard), :mod:`.demo` (the commands), :mod:`.base` (the session and the option helpers they
share), :mod:`.errors` (exit codes; exception class -> message), :mod:`.timeparse` (times and durations as
typed), :mod:`.render` (text, tables, the chart).

Exit codes: 0 done; 1 something was not found or not done (each one is named on
stderr); 2 a usage error (a bad option, time, duration, cron expression or JSON
value); 3 the store cannot be used (Redis unreachable, a bad ``delayq_url`` or
another bad ``delayq_*`` setting).
"""

from __future__ import annotations

import click

from .errors import EXIT_NOT_DONE, EXIT_OK, EXIT_STORE, EXIT_USAGE, CliError
from .timeparse import parse_duration, parse_when

__all__ = [
    "EXIT_NOT_DONE",
    "EXIT_OK",
    "EXIT_STORE",
    "EXIT_USAGE",
    "delayq",
    "demo",
    "parse_duration",
    "parse_when",
]

#: What every command says when ``rich`` is not installed.
NEEDS_RICH = "the delayq commands need rich: pip install 'celery-delayq[cli]'"

#: The ``delayq`` group's commands, listed by ``--help`` without rich (tests/test_cli.py
#: checks them against the group's).
COMMANDS = (
    "batch", "batches", "cancel", "dead", "demo", "key", "keys", "limit", "ls", "pause", "purge",
    "reschedule", "resume", "run-now", "schedules", "show", "status", "web",
)  # fmt: skip


def _needs_rich(name: str, missing: ImportError) -> click.Command:
    """A command named ``name`` that, whatever its arguments, says how to install the extra."""

    @click.command(
        name,
        help=NEEDS_RICH,
        short_help="needs rich (the cli extra)",
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    def command() -> None:
        raise CliError(NEEDS_RICH) from missing

    return command


class NeedsRichGroup(click.Group):
    """The ``delayq`` group without rich: ``--help`` (and no command) lists :data:`COMMANDS`
    and says how to install rich (exit 0); each command says it in one line (exit 1)."""

    def __init__(self, missing: ImportError) -> None:
        super().__init__(
            "delayq",
            help="Look at and manage delayq jobs, recurring schedules, dead letters, gate keys and "
            f"batches.\n\n\b\nNot installed: {NEEDS_RICH}",
        )
        self.missing = missing

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return _needs_rich(cmd_name, self.missing) if cmd_name in COMMANDS else None


delayq: click.Command
demo: click.Command
try:
    from .demo import demo
    from .group import delayq, iter_commands
    from .render import chart_lines
except ImportError as exc:  # without the `cli` extra: the entry point still loads
    if (exc.name or "").partition(".")[0] != "rich":
        raise
    delayq = NeedsRichGroup(exc)
    demo = _needs_rich("demo", exc)
else:
    __all__ += ["chart_lines", "iter_commands"]
