"""Recurring schedules: ``spec`` (what a schedule is: :class:`~celery_delayq.schedules.spec.ScheduleSpec`),
``rules`` (when it runs: cron, intervals, one-shots, and each rule's next point) and ``api``
(:class:`~celery_delayq.schedules.api.Schedules`: stored in Redis, managed at run time).
Firing the points is the beat's (``beat.firing``).

May import: the root modules, ``store``, ``producer`` (a schedule builds its job's envelope) and
``flow.gate`` (the gate header a point of a schedule with an overlap policy carries).
"""
