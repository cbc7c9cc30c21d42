"""A small celery-delayq project laid out the usual way (see README.md in this folder).

Importing the package loads the Celery app, as a Django project's ``__init__.py`` does,
so ``celery -A examples.project`` finds it and shared tasks bind to it.
"""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
