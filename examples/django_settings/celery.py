"""The Celery app, as a Django project's ``mysite/celery.py`` makes it.

A Django project writes ``app.config_from_object("django.conf:settings", namespace="CELERY")``
and ``app.autodiscover_tasks()``; ``django.conf:settings`` is ``settings.py`` once Django has
loaded it. Here the module is named directly, so the example runs without Django.
"""

from __future__ import annotations

from celery import Celery

app = Celery("mysite")
app.config_from_object("examples.django_settings.settings", namespace="CELERY")
# Django: app.autodiscover_tasks() (the tasks.py of every INSTALLED_APPS package).
app.autodiscover_tasks(["examples.django_settings"])
