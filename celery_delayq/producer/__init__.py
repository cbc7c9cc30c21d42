"""The producer side: what runs in the caller's process when a job is scheduled.

``task`` (``DelayedTask.apply_at``/``apply_in``/``apply_at_many``) and ``canvas`` (any signature)
take the call; ``options`` reads ``apply_async``'s options; ``message`` makes the route and
Celery message; ``build`` builds the envelope the way ``apply_async`` builds the message, by a
plan (``plans``: kept per app) for many jobs alike; ``result`` is the ``ScheduledResult``
handed back.

May import: the root modules (``config``, ``setting_values``, ``exceptions``, ``due``),
``store``, ``flow.gate`` (the names a gated job carries) and ``admin.jobs`` (a result moves
or cancels its job through it).
Imported by: ``flow``, ``schedules``, ``spark``, ``devtools`` and the package root.
"""
