"""``python -m celery_delayq demo`` (and the ``celery-delayq`` script): the demo without Celery's
own command line; ``python -m celery_delayq web --url ...``: the dashboard of a store. The
command and its options are defined once, in :mod:`celery_delayq.cli.demo`
(also ``celery delayq demo``); the demo itself is in :mod:`celery_delayq.devtools.demo`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from .cli import _needs_rich, demo

__all__ = ["main"]

#: The group's help.
HELP = """celery-delayq's own command line: the demo and the dashboard of a store (the rest is
`celery -A proj delayq ...`)."""

try:
    from .cli.base import DelayqGroup
    from .cli.web import module_web
except ImportError as exc:  # without the `cli` extra: --help works, each command says one line
    if (exc.name or "").partition(".")[0] != "rich":
        raise
    module_cli = click.Group("python -m celery_delayq", help=HELP)
    module_cli.add_command(demo)
    module_cli.add_command(_needs_rich("web", exc))
else:
    module_cli = DelayqGroup("python -m celery_delayq", help=HELP)
    module_cli.add_command(demo)
    module_cli.add_command(module_web)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``argv`` (default: the process's arguments); the exit code."""
    try:
        module_cli.main(args=list(argv) if argv is not None else None, prog_name="python -m celery_delayq")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
