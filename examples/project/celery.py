"""The project's Celery app, configured from ``celeryconfig.py``.

``celery -A examples.project worker`` (or ``beat``) finds this module by its name.
The tasks module is listed in the config's ``imports``, so workers and beats load it.
"""

from __future__ import annotations

from celery import Celery

app = Celery("project")
app.config_from_object("examples.project.celeryconfig")
