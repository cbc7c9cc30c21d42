"""One-off jobs: ``DelayQ`` manages stored jobs by id and lists what is pending (the
sibling of :mod:`celery_delayq.schedules.api`, which manages recurring ones).

>>> from celery import Celery
>>> dq = DelayQ(Celery(broker="redis://127.0.0.1:6390/0"))
>>> dq.config.shards
16
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..due import due_ms_from_eta, ms_to_datetime
from ..exceptions import InvalidSchedule, UnknownKey
from ..flow.batch import OPEN_BATCH_EXPIRES, BatchResult, OpenBatch, open_batch, store_batch
from ..flow.gate import PARK_MS, batch_of, check_key, check_limit, completion_id
from ..store import lateness
from ..store.dead import RequeueOutcome
from ..store.envelope import decode_envelope
from ..store.facade import get_store
from ..store.jobs import CancelOutcome, JobRecord, RescheduleOutcome
from ..store.keys import is_point_id
from ..store.lateness import Snapshot

if TYPE_CHECKING:
    from ..store.batches import BatchState
    from ..store.facade import Store
    from ..store.flow import KeyState

__all__ = ["DelayQ", "PendingJob", "check_key_target"]

# The outcomes :meth:`DelayQ.cancel`, :meth:`DelayQ.reschedule` and
# :meth:`DelayQ.requeue_dead` report, by the words they share: each is the store's ``str`` enum
# member (``CANCELLED == "cancelled"``), typed ``str`` so that the outcomes of the three compare.
CANCELLED: str = CancelOutcome.CANCELLED
MOVED: str = RescheduleOutcome.MOVED
REQUEUED: str = RequeueOutcome.REQUEUED
DELIVERING: str = CancelOutcome.DELIVERING
MISSING: str = CancelOutcome.MISSING
STORED: str = RequeueOutcome.STORED
NO_ENVELOPE: str = RequeueOutcome.NO_ENVELOPE


#: What ``Schedules`` does instead of a key's action, for :class:`UnknownKey`'s message (a
#: schedule has no limit: pausing it is what comes closest).
SCHEDULE_ACTIONS = {"pause": "pause", "resume": "resume", "limit": "pause"}


def check_key_target(store: Store, key: str, action: str, new: bool = False) -> str:
    """``key`` when ``action`` (``pause``, ``resume`` or ``limit``) may change it: a key that
    has been seen (:meth:`Store.key_seen`), or any key with ``new``. Else :class:`UnknownKey`:
    the name is a schedule's (``Schedules`` pauses a schedule), or no key of that name was
    ever seen (a misspelling, most often)."""
    check_key(key)
    if new or store.key_seen(key):
        return key
    if store.schedule(key)[0] is not None:
        raise UnknownKey(
            f"{key!r} is a schedule, not a gate key: use Schedules(app).{SCHEDULE_ACTIONS[action]}"
            f"({key!r}) (or pass new=True to {action} a new gate key {key!r})",
            key, action, schedule=True,
        )  # fmt: skip
    raise UnknownKey(
        f"gate key {key!r} has never been seen (no job of it stored or gated, no limit or pause "
        f"set): check the name, or pass new=True to {action} it anyway",
        key, action,
    )  # fmt: skip


@dataclass(frozen=True)
class PendingJob:
    """A stored job as the API reports it."""

    id: str
    task: str
    due: datetime
    state: str  # "waiting", "leased", "gated", "running" or "dead"
    shard: int
    args: Any
    kwargs: Any
    queue: str | None
    tries: int
    #: leased: the beat's lease ends; running: the slot's lease ends; gated: due again (rate)
    #: or None (parked: waiting for a slot or a resume)
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
            queue = envelope.queue
            args, kwargs = envelope.arguments()
        except (ValueError, KeyError, TypeError, RecursionError):
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
                # a parked job's score is PARK_MS: no time (it waits for a slot or a resume)
                ms_to_datetime(record.lease_until_ms)
                if record.lease_until_ms is not None and record.lease_until_ms < PARK_MS
                else None
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

    def cancel(self, job_id: str) -> CancelOutcome:
        """Remove a job, and say what happened (a ``str`` enum, true only for ``"cancelled"``):
        ``"cancelled"`` (it was waiting: it will never run), ``"delivering"`` (removed while a
        beat held it: it is not delivered again, but it may already be in the broker) or
        ``"missing"`` (no such job). A schedule's next point raises ``InvalidSchedule``.

        A batch's member is cancelled through its batch (it counts as ``cancelled`` there):
        ``"cancelled"`` when it was not released yet; a member being published or running is
        not removed (``"delivering"``: it ends, and counts, as it runs).
        """
        self._refuse_schedule_point(job_id, "cancel")
        batch_id = batch_of(job_id)
        if batch_id is not None and job_id != completion_id(batch_id):
            if self.store.cancel_batch(batch_id, [job_id]):
                return CancelOutcome.CANCELLED
            return CancelOutcome.MISSING if self.store.get(job_id) is None else CancelOutcome.DELIVERING
        return self.store.cancel(job_id)

    def reschedule(self, job_id: str, eta: Any) -> RescheduleOutcome:
        """Move a waiting job to ``eta`` (as ``apply_at`` takes it), and say what happened (a
        ``str`` enum, true only for ``"moved"``): ``"moved"``, ``"delivering"`` (refused: a
        beat holds the job now) or ``"missing"``. A schedule's next point raises
        ``InvalidSchedule``."""
        due_ms = due_ms_from_eta(eta, self.app)
        self._refuse_schedule_point(job_id, "reschedule")
        return self.store.reschedule(job_id, due_ms)

    def is_schedule_point(self, job_id: str) -> str | None:
        """The name of the recurring schedule whose execution point ``job_id`` is, or None."""
        if not is_point_id(job_id):
            return None
        record = self.store.get(job_id)
        if record is None or record.state == "dead":
            return None
        try:
            sched = decode_envelope(record.envelope).schedule
        except ValueError:
            return None
        return sched[0] if sched else None

    def _refuse_schedule_point(self, job_id: str, what: str) -> None:
        """A recurring schedule's next point is managed through Schedules, not by id:
        cancelling it would silently stop the schedule."""
        name = self.is_schedule_point(job_id)
        if name is not None:
            raise InvalidSchedule(
                f"{job_id!r} is the next run of schedule {name!r}: {what} it with "
                f"Schedules(app).pause/update/delete({name!r}) instead"
            )

    # -- flow control: batches and gate keys -------------------------------------------------

    def batch(
        self,
        signatures: Any,
        eta: Any = None,
        *,
        concurrency_limit: int | None = None,
        priority: int | None = None,
        on_complete: Any = None,
        batch_id: str | None = None,
    ) -> BatchResult:
        """Store ``signatures`` (one task's signature each, of any tasks) as one batch due at
        ``eta`` (what ``apply_at`` takes; None: now), and return its :class:`BatchResult`.

        * ``concurrency_limit``: at most that many members run at once, over every worker
          (None: no cap; ``set_limit("batch:<id>", n)`` changes it at run time).
        * ``priority`` (0-255): each member's message priority, unless its signature sets
          its own; of the members waiting for a slot, higher priority is released first.
        * ``on_complete``: a signature applied once, after every member ended (succeeded,
          failed or cancelled: it fires also when members failed), with two more arguments:
          the batch id and the counts ``{"total", "succeeded", "failed", "cancelled"}``. It
          is sent as JSON.
        * ``batch_id``: the batch's id (default: a new uuid); ``BatchExists`` when taken.

        Every message is built and checked first: a bad member raises (naming it) and
        nothing is stored. Then the batch is opened (its counters, and ``on_complete`` stored
        parked) and the members are stored as ``{batch:<id>}:<n>``, in one pipeline: two
        round trips for any number of members (all on the batch's shard). A Redis already full
        refuses the open: ``StoreFull`` names every member in ``not_stored`` and nothing is
        stored. When Redis gets full after the open (``StoreFull``, with the members not
        stored), the batch is open with fewer members than its total and never completes:
        cancel it (removes the members stored) and make it again under another id.
        """
        return store_batch(
            self.app,
            signatures,
            eta,
            concurrency_limit=concurrency_limit,
            priority=priority,
            on_complete=on_complete,
            batch_id=batch_id,
        )

    def open_batch(
        self,
        *,
        concurrency_limit: int | None = None,
        priority: int | None = None,
        on_complete: Any = None,
        batch_id: str | None = None,
        expires: float = OPEN_BATCH_EXPIRES,
    ) -> OpenBatch:
        """Open a batch with no member yet, and return its :class:`OpenBatch`: members are
        added over time with ``add(signatures, eta=None)`` (from any process:
        ``batch_result(id)`` gets the handle back), and ``seal()`` ends the adding.

        ``on_complete`` runs once, after the seal, when every member added ended; an open
        batch whose members all ended is not complete (more may come). ``add`` after the
        seal raises ``BatchSealed``. ``concurrency_limit``, ``priority``, ``on_complete`` and
        ``batch_id`` are those of :meth:`batch`. ``expires`` (seconds, default one day): a
        batch not sealed within that of its open or its last add is removed by the beats'
        sweep as ``delete --force`` deletes (members not released yet are cancelled, running
        ones end), and its on_complete never runs.
        """
        return open_batch(
            self.app,
            concurrency_limit=concurrency_limit,
            priority=priority,
            on_complete=on_complete,
            batch_id=batch_id,
            expires=expires,
        )

    def batch_result(self, batch_id: str) -> BatchResult | None:
        """The handle of the stored batch ``batch_id`` (from any process), or None; an
        :class:`OpenBatch` when it is open (not sealed yet)."""
        return BatchResult.restore(batch_id, self.app)

    def batches(self) -> list[BatchState]:
        """Every stored batch's counters."""
        return self.store.batch_states()

    def set_limit(self, key: str, limit: int | None, *, new: bool = False) -> int:
        """Set ``key``'s concurrency limit at run time: it wins over the limit its jobs carry.
        ``None``: no cap. Jobs waiting for a slot that now fits are released at once; how many.
        A lower limit lets the running jobs end: no new one starts until fewer run.

        A key never seen (no job of it stored or gated, no limit or pause set), or a name that
        is a schedule's and no key's, raises :class:`UnknownKey`; ``new=True`` sets it anyway
        (a key whose jobs are still to come)."""
        check_key(key)
        checked = None if limit is None else check_limit(limit)
        return self.store.set_limit(check_key_target(self.store, key, "limit", new), checked)

    def clear_limit(self, key: str, *, new: bool = False) -> int:
        """Drop ``key``'s run-time limit: each job's own ``concurrency_limit`` counts again.
        How many waiting jobs were released. ``UnknownKey`` and ``new``: as :meth:`set_limit`."""
        return self.store.clear_limit(check_key_target(self.store, key, "limit", new))

    def pause(self, key: str, *, new: bool = False) -> int:
        """Release no more jobs of ``key`` (the running ones go on) until :meth:`resume`.
        ``UnknownKey`` and ``new``: as :meth:`set_limit` (a schedule: ``Schedules.pause``)."""
        return self.store.pause(check_key_target(self.store, key, "pause", new))

    def resume(self, key: str, *, new: bool = False) -> int:
        """Release ``key``'s jobs again; how many waiting ones were released at once.
        ``UnknownKey`` and ``new``: as :meth:`set_limit`."""
        return self.store.resume(check_key_target(self.store, key, "resume", new))

    def key_state(self, key: str) -> KeyState:
        """``key``'s limits, running and waiting jobs, and whether it is paused."""
        return self.store.key_state(check_key(key))

    def keys(self) -> list[KeyState]:
        """:meth:`key_state` of every key a gated job has used."""
        return self.store.key_states()

    def pending(
        self,
        start: Any = None,
        end: Any = None,
        task: str | None = None,
        limit: int | None = None,
    ) -> Iterator[PendingJob]:
        """Stored jobs in due order, optionally due within ``[start, end]`` and of one task.

        ``start``/``end`` take what ``apply_at`` takes (datetime or timestamp).
        Jobs being delivered right now are included with state ``"leased"``, ordered by their
        lease expiry; jobs their gate key released (``"running"``) by their slot's expiry.
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

    def lateness(self, kind: str) -> Snapshot:
        """The ``"publish"`` (due -> in the broker, recorded by the beats) or ``"start"`` (due ->
        a worker started it, with ``delayq_record_lateness``) histogram as it is in Redis now.
        See docs/operations.md, "Lateness histograms"."""
        return lateness.read(self.store, self.config.prefix, kind)

    def dead(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Dead-lettered jobs: ``(id, record)`` with the reason and the stored envelope."""
        return self.store.dead()

    def requeue_dead(self, job_id: str, eta: Any = None) -> RequeueOutcome:
        """Put a dead-lettered job back as a waiting job due at ``eta`` (default: now, on the Redis
        server's clock), removing its dead letter, in one script. ``"requeued"``; ``"missing"`` (no
        dead letter with this id); ``"stored"`` (refused: a job with this id is stored, waiting or
        being delivered); ``"no-envelope"`` (refused: the record holds no message)."""
        due_ms = self.store.server_now_ms() if eta is None else due_ms_from_eta(eta, self.app)
        return self.store.requeue(job_id, due_ms)

    def delete_dead(self, job_id: str) -> bool:
        """Forget a dead-lettered job; False when there was no dead letter with this id."""
        return self.store.delete_dead(job_id)

    def delete_all_dead(self, page: int = 1000) -> int:
        """Forget every dead letter of this prefix (``HSCAN`` and ``HDEL`` a page at a time);
        how many were removed."""
        return self.store.delete_all_dead(page)

    def purge(self, task: str | None = None, page: int = 1000) -> dict[str, int]:
        """Remove every stored one-off job of this app's prefix (only those of ``task`` when
        given), shard by shard, a page of ids (``ZRANGE`` by rank) per round trip or two.

        Recurring schedules' execution points are kept (removing one would silently stop its
        schedule: delete schedules with :meth:`Schedules.delete`). Dead letters are kept.
        Jobs stored while it runs may or may not be removed. Returns the counts
        ``{"cancelled": removed while waiting, "delivering": removed while a beat held them
        (they may already be in the broker), "kept_points": schedule points left}``.
        """
        out = {CancelOutcome.CANCELLED.value: 0, CancelOutcome.DELIVERING.value: 0}
        points: set[str] = set()
        store = self.store
        for shard in range(store.keys.shards):
            for _ in range(3):  # a job a beat acks meanwhile shifts the ranks: look again
                kept = 0  # members left in place so far: the next page starts after them
                while True:
                    ids = store.due_ids(shard, kept, kept + page - 1)
                    if not ids:
                        break
                    kept += len(ids) - self._purge_batch(shard, ids, task, out, points)
                    if len(ids) < page:
                        break
                if store.due_count(shard) <= kept:
                    break
        return {**out, "kept_points": len(points)}

    def _purge_batch(
        self, shard: int, ids: list[str], task: str | None, out: dict[str, int], points: set[str]
    ) -> int:
        """Cancel the ids of one page that ``purge`` removes; how many it removed."""
        maybe_point = [i for i in ids if is_point_id(i)]
        wanted = ids if task is not None else maybe_point
        envelopes = dict(zip(wanted, self.store.envelopes(shard, wanted), strict=True))
        chosen: list[str] = []
        for job_id in ids:
            if job_id in envelopes:
                stored = envelopes[job_id]
                if stored is None:
                    continue  # gone since the scan
                try:
                    envelope = decode_envelope(stored)
                except ValueError:
                    envelope = None
                if task is not None and (envelope is None or envelope.task != task):
                    continue
                if envelope is not None and envelope.schedule:
                    points.add(job_id)
                    continue
            chosen.append(job_id)
        if not chosen:
            return 0
        removed = 0
        for outcome in self.store.cancel_many(shard, chosen):
            if outcome is not CancelOutcome.MISSING:
                out[outcome.value] += 1
                removed += 1
        return removed
