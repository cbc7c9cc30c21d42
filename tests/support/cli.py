"""Running the ``delayq`` command group in-process, as ``celery -A app delayq ...`` runs it."""

from __future__ import annotations

import json
from typing import Any

from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_delayq.cli import delayq


def invoke(app: Celery, *args: str, input: str | None = None, runner: CliRunner | None = None) -> Result:
    """Run ``delayq <args>`` for ``app``; an exception other than click's exit is raised, and no
    traceback may be printed."""
    obj = CLIContext(app=app, no_color=True, workdir=None)
    result = (runner or CliRunner()).invoke(delayq, list(args), obj=obj, input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert "Traceback" not in result.output
    return result


def as_json(result: Result) -> Any:
    """The JSON a successful command printed."""
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
