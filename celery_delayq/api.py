"""``DelayQ``: manage stored jobs by id, and list what is pending.

>>> from celery import Celery
>>> dq = DelayQ(Celery(broker="redis://127.0.0.1:6390/0"))
>>> dq.config.shards
16
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .config import DelayQConfig
from .exceptions import InvalidSchedule
from .message import decode_envelope, due_ms_from_eta, ms_to_datetime
from .store import (
    CANCEL_WAITING,
    RESCHEDULE_MOVED,
    JobRecord,
    Store,
)

__all__ = ["DelayQ", "PendingJob", "get_store"]


def get_store(app: Any) -> Store:
    """The app's :class:`Store` (one per app and process; redis-py pools are fork-safe)."""
    store = app.__dict__.get("_delayq_store")
    if not isinstance(store, Store):
        store = Store(DelayQConfig.from_app(app))
        app.__dict__["_delayq_store"] = store
    return store


@dataclass(frozen=True)
class PendingJob:
    """A stored job as the API reports it."""

    id: str
    task: str
    due: datetime
    state: str  # "waiting", "leased" or "dead"
    shard: int
    args: Any
    kwargs: Any
    queue: str | None
    tries: int
    lease_until: datetime | None

    @classmethod
    def from_record(cls, record: JobRecord) -> PendingJob:
        task: str = "?"
        args: Any = None
        kwargs: Any = None
        queue = None
        try:
            envelope = decode_envelope(record.envelope)
            task = envelope.task
            queue = envelope.route.get("queue")
            if envelope.content_type == "application/json":
                args, kwargs, _ = json.loads(envelope.body)
            else:
                args = envelope.headers.get("argsrepr")
                kwargs = envelope.headers.get("kwargsrepr")
        except (ValueError, KeyError, TypeError):
            task = "<corrupt envelope>"
        return cls(
            id=record.id,
            task=task,
            due=ms_to_datetime(record.due_ms),
            state=record.state,
            shard=record.shard,
            args=args,
            kwargs=kwargs,
            queue=queue,
            tries=record.tries,
            lease_until=(
                ms_to_datetime(record.lease_until_ms) if record.lease_until_ms is not None else None
            ),
        )


class DelayQ:
    """Jobs of one Celery app, by id and by due window."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store = get_store(app)
        self.config = self.store.config

    def get(self, job_id: str) -> PendingJob | None:
        """The stored (or dead-lettered) job with this id, or None."""
        record = self.store.get(job_id)
        return PendingJob.from_record(record) if record else None

    def cancel(self, job_id: str) -> bool:
        """Remove a job. True when it was waiting, so it will never run.

        False when there is no such job, or when a beat was delivering it at
        that moment (it is removed, so it is not delivered again, but it may
        already be in the broker).
        """
        self._refuse_schedule_point(job_id, "cancel")
        return self.store.cancel(job_id) == CANCEL_WAITING

    def reschedule(self, job_id: str, eta: Any) -> bool:
        """Move a waiting job to ``eta`` (as ``apply_at`` takes it).

        False when there is no such job or a beat is delivering it now.
        """
        due_ms = due_ms_from_eta(eta, self.app)
        self._refuse_schedule_point(job_id, "reschedule")
        return self.store.reschedule(job_id, due_ms) == RESCHEDULE_MOVED

    def _refuse_schedule_point(self, job_id: str, what: str) -> None:
        """A recurring schedule's next point is managed through Schedules, not by id:
        cancelling it would silently stop the schedule."""
        if not (job_id.startswith("{") and "}@" in job_id):
            return
        record = self.store.get(job_id)
        if record is None or record.state == "dead":
            return
        try:
            sched = decode_envelope(record.envelope).schedule
        except ValueError:
            return
        if sched:
            raise InvalidSchedule(
                f"{job_id!r} is the next run of schedule {sched[0]!r}: {what} it with "
                f"Schedules(app).pause/update/delete({sched[0]!r}) instead"
            )

    def pending(
        self,
        start: Any = None,
        end: Any = None,
        task: str | None = None,
        limit: int | None = None,
    ) -> Iterator[PendingJob]:
        """Stored jobs in due order, optionally due within ``[start, end]`` and of one task.

        ``start``/``end`` take what ``apply_at`` takes (datetime or timestamp).
        Jobs being delivered right now are included with state ``"leased"``.
        """
        start_ms = due_ms_from_eta(start, self.app) if start is not None else None
        end_ms = due_ms_from_eta(end, self.app) if end is not None else None
        seen = 0
        for record in self.store.scan(start_ms, end_ms):
            job = PendingJob.from_record(record)
            if task is not None and job.task != task:
                continue
            yield job
            seen += 1
            if limit is not None and seen >= limit:
                return

    def count(self) -> int:
        """Jobs stored (waiting or being delivered), over all shards."""
        return self.store.count()

    def dead(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Dead-lettered jobs: ``(id, record)`` with the reason and the stored envelope."""
        return self.store.dead()
