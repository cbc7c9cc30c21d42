"""The operator's side: ``jobs`` (:class:`~celery_delayq.admin.jobs.DelayQ`: stored jobs by id,
cancel, reschedule, what is pending); ``views``, ``listing`` and ``status`` (the JSON shapes the
CLI and the dashboard show); ``inputs`` and ``timeparse`` (what a person types, read the same way
by the CLI and the web). ``cli/`` and ``web/`` sit on top of it.

May import: anything below it (root modules, ``store``, ``flow``, ``schedules``).
"""
