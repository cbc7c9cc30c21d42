"""The beat and Celery's result backend: what already ran (:class:`Ran`), and the FAILURE of
a job dead-lettered for its unknown task (:func:`fail_result`).

What already ran is asked of the result backend, which a store restored from an older
snapshot does not take back in time with it: :mod:`.gating` asks it about gated jobs claimed
again and about batches' completion jobs. See docs/guarantees.md, "Redis restored from an
older snapshot".
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import NotRegistered

from ..store.connection import error_text
from ..store.envelope import Envelope

__all__ = ["Ran", "fail_result"]

logger = logging.getLogger(__name__)


def _done_ms(value: Any) -> float | None:
    """A result's ``date_done`` (a datetime, or its ISO text; naive = UTC) in ms, or None."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return float(value.timestamp() * 1000)


class Ran:
    """What Celery's result backend says already ran, by task id: the one record of a run that
    lives outside the store (when the backend is on another server), so a store restored from
    an older snapshot cannot take it back. ``backend`` is None when the app's backend cannot
    answer by id (none configured, or ``rpc://``): then nothing is known to have run.

    A task counts as having run since ``since_ms`` (a job's original due time) when the backend
    holds a ready state for its id (SUCCESS, FAILURE, REVOKED) done at or after that time: a
    result of an earlier job that had the same id is older than the new job's due time. A
    lookup that fails knows nothing (logged once): the job goes on as without a backend."""

    def __init__(self, app: Any) -> None:
        self._failing = False
        try:
            backend = app.backend
        except Exception as exc:  # a backend that cannot be made here: nothing known
            logger.warning(
                "delayq: the result backend cannot be used (%s); what already ran is not "
                "looked up (see docs/guarantees.md)",
                error_text(exc),
            )
            backend = None
        persistent = getattr(backend, "persistent", True)
        if backend is None or isinstance(backend, DisabledBackend) or not persistent:
            backend = None
        self.backend: Any = backend

    def _meta(self, task_id: str) -> dict[str, Any] | None:
        if self.backend is None:
            return None
        try:
            meta = self.backend.get_task_meta(task_id)
        except Exception as exc:
            if not self._failing:
                logger.warning(
                    "delayq: cannot read the result of %s from the result backend (%s); "
                    "what already ran is not known until it answers",
                    task_id,
                    error_text(exc),
                )
            self._failing = True
            return None
        self._failing = False
        return meta if isinstance(meta, dict) else None

    def finished(self, task_id: str, since_ms: float) -> str | None:
        """``"succeeded"`` or ``"failed"`` when the task ``task_id`` ended at or after
        ``since_ms``; None when the backend does not say so."""
        meta = self._meta(task_id)
        if meta is None or meta.get("status") not in states.READY_STATES:
            return None
        done = _done_ms(meta.get("date_done"))
        if done is None or done < since_ms:
            return None
        return "succeeded" if meta.get("status") == states.SUCCESS else "failed"

    def seen(self, task_id: str, since_ms: float) -> bool:
        """Whether a worker took the task ``task_id`` at or after ``since_ms``: a ready state
        done then, or STARTED (``task_track_started``). Not RETRY: a retry stored through delayq
        is the same job waiting again, and must be published."""
        meta = self._meta(task_id)
        if meta is None:
            return False
        status = meta.get("status")
        if status == states.STARTED:
            return True
        if status not in states.READY_STATES:
            return False
        done = _done_ms(meta.get("date_done"))
        return done is not None and done >= since_ms


def fail_result(app: Any, envelope: Envelope, reason: str) -> None:
    """Store FAILURE (``NotRegistered(reason)``) as the result of a job the beat dead-lettered
    for its unknown task, so that a caller waiting on it gets the error instead of waiting for
    good. Never raises: without a result backend, or when it fails, only the log says it."""
    task_id = envelope.headers.get("id")
    if not isinstance(task_id, str):
        return
    try:
        app.backend.store_result(task_id, NotRegistered(reason), states.FAILURE)
    except Exception as exc:  # the job is in the dead letters either way
        logger.warning(
            "delayq: storing the FAILURE of dead-lettered task %s failed: %s", task_id, error_text(exc)
        )
