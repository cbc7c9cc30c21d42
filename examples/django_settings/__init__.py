"""A Django-style project ``mysite`` whose Celery and celery-delayq settings are ``CELERY_*`` names.

Django is not needed to run it: ``celery.py`` reads ``settings.py`` the way
``app.config_from_object("django.conf:settings", namespace="CELERY")`` reads a Django project's
settings. As in a Django project, importing the package loads the Celery app, so
``@shared_task``/``@delayed_task`` tasks bind to it.

    export DELAYQ_EXAMPLE_URL=redis://127.0.0.1:6379/0
    celery -A examples.django_settings worker -l info
    celery -A examples.django_settings beat -l info     # the scheduler comes from the settings
    python -m examples.django_settings
"""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
