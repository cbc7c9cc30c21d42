"""The celery-delayq benchmark suite: ``python -m bench`` (see ``docs/benchmarks.md``).

It starts its own Redis servers (free loopback ports, never 6379) and real ``celery worker`` and
``celery beat -S celery_delayq.Scheduler`` processes, measures each row of the table against a
baseline measured in the same run, and prints ``what | ours | baseline | ratio | target | met?``.
"""
