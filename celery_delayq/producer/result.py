"""``ScheduledResult``: an ``AsyncResult`` that knows its due time and can move or cancel it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from celery.result import AsyncResult
from vine import promise

from ..admin.jobs import DelayQ
from ..config import extension
from ..due import due_ms_from_eta, ms_to_datetime
from ..store.jobs import CancelOutcome, RescheduleOutcome

__all__ = ["ScheduledResult"]

_SHAREABLE = frozenset((bool, int, float, str, bytes, tuple, frozenset))


class ScheduledResult(AsyncResult):  # type: ignore[misc]
    """The handle ``apply_at``/``apply_in`` return.

    It is the task's ``AsyncResult`` (same id, so ``.get()``/``.state`` work as
    usual once the job has run) plus:

    * ``due``: when the job is due (aware UTC datetime). When a job with the
      same ``task_id`` was already waiting and was kept, it is that job's due.
    * ``created``: False when an existing waiting job with this id was kept.
    * ``outcome``, with ``unique_for`` only (else None): ``"new"`` (stored), ``"kept"`` (a job
      with this id is stored: ``due`` is its due time) or ``"taken"`` (the id was stored less than
      ``unique_for`` ago and its job is gone: delivered, or cancelled; ``due`` is None).
    * ``outcome``, with ``debounce`` or ``throttle``: ``"new"`` (stored), ``"debounced"`` (stored
      in place of the key's pending job, whose id is ``replaced``: that earlier call's result
      never resolves) or ``"throttled"`` (the key's window is open: nothing stored, ``due`` None).
    * ``cancel()`` and ``reschedule(eta)``.
    """

    outcome: str | None = None
    replaced: str | None = None

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

    # AsyncResult makes a promise (with a weak method) for every result; a scheduled job's
    # result rarely needs it, so it is made on first use. AsyncResult's own assignment in
    # __init__ goes through the setter.
    @property
    def on_ready(self) -> Any:
        ready = self.__dict__.get("_on_ready")
        if ready is None:
            ready = self.__dict__["_on_ready"] = promise(self._on_fulfilled, weak=True)
        return ready

    @on_ready.setter
    def on_ready(self, value: Any) -> None:
        self.__dict__["_on_ready"] = value

    @classmethod
    def many(
        cls, jobs: Sequence[tuple[str, datetime | None, bool]], backend: Any, task_name: str, app: Any
    ) -> list[ScheduledResult]:
        """One result per ``(id, due, created)``, as ``cls(id, backend=..., app=..., due=..., created=...)``.

        ``AsyncResult.__init__`` sets the same attributes on every result but the
        id (the app, the backend, ``parent=None``, ...): they are taken once per
        app and backend from a result made by ``__init__``, and copied. When
        ``__init__`` leaves anything that should not be shared (say, a list),
        every result is made by ``__init__``.
        """
        if not jobs:
            return []
        shared = cls._shared_attributes(backend, task_name, app)
        if shared is None:
            return [
                cls(job_id, backend=backend, task_name=task_name, app=app, due=due, created=created)
                for job_id, due, created in jobs
            ]
        new = object.__new__
        out: list[ScheduledResult] = []
        for job_id, due, created in jobs:
            result = new(cls)
            attrs = result.__dict__
            attrs.update(shared)
            attrs["id"] = job_id
            attrs["due"] = due
            attrs["created"] = created
            out.append(result)
        return out

    @classmethod
    def _shared_attributes(cls, backend: Any, task_name: str, app: Any) -> dict[str, Any] | None:
        kept: dict[Any, tuple[Any, dict[str, Any] | None]] = extension(app).part("results", dict)
        key = (cls, id(backend))
        entry = kept.get(key)
        if entry is not None and entry[0] is backend:
            return entry[1]
        probe = cls("probe", backend=backend, task_name=task_name, app=app)
        shared: dict[str, Any] | None = {
            k: v for k, v in vars(probe).items() if k not in ("id", "due", "created", "_on_ready")
        }
        assert shared is not None
        if not all(
            v is None or type(v) in _SHAREABLE or v is backend or v is probe.app for v in shared.values()
        ):
            shared = None
        if len(kept) >= 64:
            kept.clear()
        kept[key] = (backend, shared)  # the entry keeps the backend alive: its id stays its own
        return shared

    def cancel(self) -> CancelOutcome:
        """Remove the job: :meth:`DelayQ.cancel` (true only when it was waiting and so will
        never run)."""
        return DelayQ(self.app).cancel(self.id)

    def reschedule(self, eta: Any) -> RescheduleOutcome:
        """Move the waiting job to ``eta``: :meth:`DelayQ.reschedule` (true only when moved)."""
        moved = DelayQ(self.app).reschedule(self.id, eta)
        if moved:
            self.due = ms_to_datetime(due_ms_from_eta(eta, self.app))
        return moved

    def __repr__(self) -> str:
        due = self.due.isoformat() if self.due else None
        return f"<{type(self).__name__}: {self.id} due={due}>"
