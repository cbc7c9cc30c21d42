"""``ScheduledResult``: an ``AsyncResult`` that knows its due time and can move or cancel it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery.result import AsyncResult

__all__ = ["ScheduledResult"]


class ScheduledResult(AsyncResult):  # type: ignore[misc]
    """The handle ``apply_at``/``apply_in`` return.

    It is the task's ``AsyncResult`` (same id, so ``.get()``/``.state`` work as
    usual once the job has run) plus:

    * ``due``: when the job is due (aware UTC datetime). When a job with the
      same ``task_id`` was already waiting and was kept, it is that job's due.
    * ``created``: False when an existing waiting job with this id was kept.
    * ``cancel()`` and ``reschedule(eta)``.
    """

    def __init__(
        self,
        id: str,
        *args: Any,
        due: datetime | None = None,
        created: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(id, *args, **kwargs)
        self.due = due
        self.created = created

    def cancel(self) -> bool:
        """Remove the job; True when it was waiting and so will never run."""
        from .api import DelayQ

        return DelayQ(self.app).cancel(self.id)

    def reschedule(self, eta: Any) -> bool:
        """Move the waiting job to ``eta``; False when it no longer waits."""
        from .api import DelayQ
        from .message import due_ms_from_eta, ms_to_datetime

        moved = DelayQ(self.app).reschedule(self.id, eta)
        if moved:
            self.due = ms_to_datetime(due_ms_from_eta(eta, self.app))
        return moved

    def __repr__(self) -> str:
        due = self.due.isoformat() if self.due else None
        return f"<{type(self).__name__}: {self.id} due={due}>"
