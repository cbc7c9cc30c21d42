"""What runs inside a Celery worker: ``starts`` (a worker drops a stale copy of a job before it
runs) and ``lateness`` (how late delayq messages start, ``delayq_record_lateness``).

May import: the root modules and ``store``. Imported by: ``beat`` (the start check it arms) and the
package root.
"""
