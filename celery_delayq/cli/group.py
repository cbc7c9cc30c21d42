"""The ``delayq`` click group that ``celery`` runs (the ``celery.commands`` entry point points at
:data:`celery_delayq.cli.delayq`), with every command of the CLI added to it.
"""

from __future__ import annotations

from collections.abc import Iterator

import click
from celery import current_app

from .base import DelayqGroup, Session
from .dead import dead_group
from .demo import demo
from .flow import batch_show, batches_ls, key_show, keys_ls, limit_key, pause_key, resume_key
from .jobs import cancel_jobs, ls_jobs, purge_jobs, reschedule_job, run_now_job, show_job
from .schedules import schedules_group
from .status import status
from .web import web

__all__ = ["delayq", "iter_commands"]


@click.group(cls=DelayqGroup)
@click.pass_context
def delayq(ctx: click.Context) -> None:
    """Look at and manage delayq jobs, recurring schedules, dead letters, gate keys and batches.

    Exit codes: 0 done, 1 not found / not done, 2 usage error, 3 Redis unreachable or a
    bad delayq_* setting.
    """
    parent = ctx.obj
    app = getattr(parent, "app", None)
    if app is None:
        app = current_app._get_current_object()
    # Under `celery`, the root command's -A/--app (or CELERY_APP); in-process callers pass the app.
    root = ctx.find_root()
    given = root is ctx or root.params.get("app") is not None
    ctx.obj = Session(app, no_color=bool(getattr(parent, "no_color", False)), app_given=given)


for _command in (
    ls_jobs, show_job, cancel_jobs, reschedule_job, run_now_job, purge_jobs,
    status, schedules_group, dead_group, demo,
    keys_ls, key_show, limit_key, pause_key, resume_key, batches_ls, batch_show, web,
):  # fmt: skip
    delayq.add_command(_command)


def iter_commands(group: click.Group = delayq, prefix: str = "") -> Iterator[str]:
    """Every command path of the CLI (``ls``, ``schedules add``, ...), for the docs test.

    >>> "dead requeue" in list(iter_commands())
    True
    """
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from iter_commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name
