"""The beat: ``celery beat -S celery_delayq.Scheduler`` and the claim loop it runs.

``scheduler`` (the Celery beat scheduler), ``dispatch`` (the claim loop: claim due jobs,
publish, ack, sleep), ``wake`` (when to claim each shard: the wake subscription and the safety
poll), ``chores`` (lateness flush, heartbeat and sweeps, on timers), ``publish_pass`` (one pass's
publish, each job as its disposition says), ``dispositions`` (what becomes of each claimed job,
as values), ``gating`` (flow control in a pass), ``results`` (what the result backend says ran),
``fence`` (publish only while the lease surely holds), ``publish`` (the publisher interface,
the kombu and Celery strategies), ``push`` (the push path, when the broker is the store's
Redis), ``wire`` and ``routing`` (the broker message and its publish call), ``firing`` (a
schedule's points), ``upkeep`` (the stored schedules kept in step with ``beat_schedule``),
``heartbeat``, ``backoff``, ``stats`` and ``metrics``.

May import: anything below it (root modules, ``store``, ``flow``, ``worker.starts``, ``schedules``).
Imported by: the package root (``Scheduler``) and ``cli`` (the beat's status).
"""
