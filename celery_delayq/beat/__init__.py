"""The beat: ``celery beat -S celery_delayq.Scheduler`` and the claim loop it runs.

``scheduler`` (the Celery beat scheduler), ``dispatch`` (claim due jobs, publish, ack),
``dispositions`` (what becomes of each claimed job, as values), ``fence`` (publish only while the
lease surely holds), ``publish``, ``wire`` and ``routing`` (the broker message and its publish
call), ``firing`` (a schedule's points), ``upkeep`` (the stored schedules kept in step with
``beat_schedule``), ``heartbeat``, ``backoff``, ``stats`` and ``metrics``.

May import: anything below it (root modules, ``store``, ``flow``, ``worker.starts``, ``schedules``).
Imported by: the package root (``Scheduler``) and ``cli`` (the beat's status).
"""
