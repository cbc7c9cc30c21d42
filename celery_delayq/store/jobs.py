"""The store's jobs by id: enqueue (one job or many, shapes shared), get, cancel, reschedule,
and what each of those answers (:class:`EnqueueOutcome`, :class:`CancelOutcome`,
:class:`RescheduleOutcome`, :class:`JobRecord`).
"""

from __future__ import annotations

import enum
import logging
import time
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import CorruptData, ReservedTaskId, StoreFull
from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER, GATE_TOKEN, PARK_MS, RUN_TOKEN
from .base import StoreBase, _decode, refused_when_full
from .bounded import load_json
from .connection import is_oom
from .keys import is_point_id, shard_of
from .scripts import SCRIPTS
from .stored_forms import shared_form, stored_form


class EnqueueOutcome(enum.StrEnum):
    """What storing one job did (``lua/enqueue.lua``)."""

    KEPT = "kept"  # a job with this id was stored already and is kept (not ``replace``)
    NEW = "new"  # stored, no job had this id
    REPLACED = "replaced"  # stored in place of the waiting job with this id (``replace``)
    AFTER_HELD = "after-held"  # stored in place of a job a beat held (its lease is dropped)
    TAKEN = "taken"  # ``unique_for``: the id's window is open and its job is gone (delivered or cancelled)
    DEBOUNCED = "debounced"  # ``debounce``: stored in place of the key's pending job (lua/keyed.lua)
    THROTTLED = "throttled"  # ``throttle``: the key's window is open; not stored (lua/keyed.lua)


class CancelOutcome(enum.StrEnum):
    """What cancelling a job did (``lua/cancel.lua``); true only when ``CANCELLED``."""

    CANCELLED = "cancelled"  # it was waiting: it will never run
    DELIVERING = "delivering"  # removed while a beat held it: it may already be in the broker
    MISSING = "missing"  # no such job

    def __bool__(self) -> bool:
        return self is CancelOutcome.CANCELLED


class RescheduleOutcome(enum.StrEnum):
    """What moving a job did (``lua/reschedule.lua``); true only when ``MOVED``."""

    MOVED = "moved"
    DELIVERING = "delivering"  # refused: a beat holds the job now
    MISSING = "missing"

    def __bool__(self) -> bool:
        return self is RescheduleOutcome.MOVED


# The scripts' integer replies, by code (see each script's header).
_ENQUEUE = tuple(EnqueueOutcome)[:5]  # 0 kept, 1 new, 2 replaced, 3 after-held, 4 taken

_KEYED = {1: EnqueueOutcome.NEW, 2: EnqueueOutcome.DEBOUNCED, 5: EnqueueOutcome.THROTTLED}

_CANCEL = (CancelOutcome.MISSING, CancelOutcome.CANCELLED, CancelOutcome.DELIVERING)

_RESCHEDULE = (RescheduleOutcome.MISSING, RescheduleOutcome.MOVED, RescheduleOutcome.DELIVERING)

logger = logging.getLogger(__name__)

#: Jobs sent to one enqueue call at most (ARGV stays small, the server stays responsive). The
#: script's ZADD of 2 values a job goes in slices of ``scripts.LUA_UNPACK_MAX`` values, as every
#: script's ``unpack`` does (Lua's limit is about 8000), so the size of a call is not bound by it.
ENQUEUE_CHUNK = 1000

#: Most shapes a shard's shapes hash holds (one per task, options and producer process seen since
#: the shard was last empty); past it, lua/enqueue.lua stores jobs whole.
MAX_STORED_SHAPES = 1000

#: Envelopes whose shape names one of these are stored whole (lua/push.lua leaves them to the beat
#: by their shape, which it must then see).
_KEEP_WHOLE = (GATE_HEADER, BATCH_DONE_HEADER)


@dataclass(frozen=True)
class JobRecord:
    """One stored job as ``get``/``pending`` see it."""

    id: str
    shard: int
    due_ms: int
    envelope: str
    state: str  # "waiting", "leased", "gated", "running" or "dead" (see _lease_state)
    tries: int = 0
    lease_until_ms: int | None = None


#: The state of a job by its lease token, for the tokens of flow control (:mod:`..flow.gate`).
_GATE_STATES = {GATE_TOKEN: "gated", RUN_TOKEN: "running"}


def _lease_state(lease: str) -> str:
    """A stored job's state by its (readable) lease entry: "gated" (held back by the gate:
    parked or deferred), "running" (a released gated job whose task runs) or "leased" (a beat
    holds it).

    >>> _lease_state("17|1|gate"), _lease_state("17|2|run"), _lease_state("17|2|beat:1:ab")
    ('gated', 'running', 'leased')
    """
    return _GATE_STATES.get(lease.rsplit("|", 1)[-1], "leased")


def refuse_point_id(job_id: str) -> None:
    """Raise :class:`ReservedTaskId` when ``job_id`` is a schedule's point id (``is_point_id``).

    >>> refuse_point_id("{nightly}@2026-01-01T00:00:00.000Z")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.ReservedTaskId: task id '{nightly}@2026-01-01T00:00:00.000Z' is reserved: ...
    >>> refuse_point_id("{nightly}@run-now-2026-01-01T00:00:00.000Z")  # not a point id
    """
    if is_point_id(job_id):
        name = job_id[1 : job_id.index("}")]
        raise ReservedTaskId(
            f"task id {job_id!r} is reserved: it is the form of an execution point of schedule "
            f"{name!r} ({{name}}@<time>), and a job stored under it would take the point's place and "
            f"stop the schedule; use another id (Schedules(app).run_now({name!r}) runs the "
            "schedule's task now)"
        )


def _raise_store_full(
    jobs: Sequence[tuple[str, int, str]], owners: Sequence[Sequence[int]], results: Sequence[Any]
) -> None:
    """Raise :class:`StoreFull` when Redis refused any enqueue call for memory, naming the jobs
    of the calls that ran and of those it refused; raise any other error of a call as is.
    A refused call wrote nothing: Redis refuses a script's first write (HSETNX/HSET) when it
    was over maxmemory at the script's start, and never stops a script once it has written."""
    refused = [isinstance(result, Exception) and is_oom(result) for result in results]
    if not any(refused):
        for result in results:
            if isinstance(result, Exception):
                raise result
        return
    for result, full in zip(results, refused, strict=True):
        if isinstance(result, Exception) and not full:
            raise result
    not_stored = sorted(p for chunk, full in zip(owners, refused, strict=True) if full for p in chunk)
    stored = sorted(p for chunk, full in zip(owners, refused, strict=True) if not full for p in chunk)
    first = next(result for result, full in zip(results, refused, strict=True) if full)
    raise StoreFull([jobs[p][0] for p in stored], [jobs[p][0] for p in not_stored], not_stored) from first


class JobsPart(StoreBase):
    """The store's jobs by id (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def enqueue(
        self,
        jobs: Sequence[tuple[str, int, str]],
        replace: bool = False,
        relative: bool = False,
        unique_ms: int | None = None,
    ) -> list[tuple[EnqueueOutcome, int]]:
        """Store ``(id, due ms, envelope)`` jobs; return ``(outcome, due ms)`` for each, in order.

        Jobs are grouped by shard, ``ENQUEUE_CHUNK`` a call, and all calls go
        in one pipeline (:meth:`~.base.StoreBase._per_shard`). With ``relative``,
        each due is a delay in ms that the script adds to its server's ``TIME`` (``apply_in``,
        ``countdown``): the returned due is that stored time. Otherwise each due is a time,
        and one far in the past of the server's clock is logged once (``delayq_past_warning``).
        An id of the form of a schedule's execution point raises :class:`ReservedTaskId`
        and nothing is stored.

        With ``unique_ms`` (``unique_for``; not with ``replace``), each id stays taken that
        long after its job was stored, on the server's clock (the shard's :attr:`.ShardKeys.unique`
        record): a stored job with the id is ``KEPT``, one stored in the window and gone since
        (delivered or cancelled) answers ``TAKEN`` with the window's end as its due ms.
        """
        unique = unique_ms is not None
        mode = f"unique:{int(unique_ms)}" if unique_ms is not None else "replace" if replace else "keep"
        clock = "in" if relative else "at"
        if len(jobs) == 1:  # one script call: no pipeline around it
            job_id, due_ms, envelope = jobs[0]
            due_ms = int(due_ms)
            shard, keys, one = self.enqueue_call(job_id, due_ms, envelope, mode, clock)
            now, status, due, *corrupt = self._write(SCRIPTS["enqueue"], keys, one, "", (job_id,))
            if corrupt and int(corrupt[0]):
                self._warn_unique_replaced(shard)
            now = int(now)
            self._saw_server_time(now)
            if not relative:
                self._check_past(now, [(job_id, due_ms)])
            return [(_decode("enqueue", _ENQUEUE, status), int(due))]
        by_shard: dict[int, list[int]] = defaultdict(list)
        shards, crc32 = self.keys.shards, zlib.crc32
        for position, (job_id, _, _) in enumerate(jobs):
            # keys.shard_of, inline for the ids without a hash tag
            if "{" in job_id:
                refuse_point_id(job_id)
                shard = shard_of(job_id, shards)
            else:
                shard = crc32(job_id.encode()) % shards
            by_shard[shard].append(position)

        def enqueue_args(shard: int, chunk: Sequence[int]) -> list[Any]:
            triples: list[tuple[str, int, str]] = []
            for p in chunk:
                job_id, due_ms, envelope = jobs[p]
                triples.append((job_id, int(due_ms), stored_form(job_id, envelope)))
            return self._enqueue_args(shard, mode, clock, triples)

        def enqueue_keys(shard: int) -> Sequence[str]:
            return self._enqueue_keys(shard, mode)

        replies = self._per_shard(
            "enqueue",
            by_shard,
            ENQUEUE_CHUNK,
            enqueue_args,
            enqueue_keys,
            raise_errors=False,
            replicated=True,
        )
        _raise_store_full(jobs, [chunk for chunk, _ in replies], [result for _, result in replies])
        out: list[tuple[EnqueueOutcome, int]] = [(EnqueueOutcome.KEPT, 0)] * len(jobs)
        now = 0
        for chunk, result in replies:
            if unique:  # the script's last value: 1 if it replaced a corrupt uniqueness record
                *result, corrupt_flag = result
                if int(corrupt_flag):
                    self._warn_unique_replaced(self.keys.shard_of(jobs[chunk[0]][0]))
            now = int(result[0])
            pairs = iter(result[1:])
            for p, status, due in zip(chunk, pairs, pairs, strict=True):
                out[p] = (_decode("enqueue", _ENQUEUE, status), int(due))
        if replies:
            self._saw_server_time(now)
            if not relative:
                self._check_past(now, [(job_id, int(due_ms)) for job_id, due_ms, _ in jobs])
        return out

    def enqueue_call(
        self, job_id: str, due_ms: int, envelope: str, mode: str = "keep", clock: str = "at"
    ) -> tuple[int, Sequence[str], list[Any]]:
        """The shard, keys and arguments of ``lua/enqueue.lua`` storing one job, as
        :meth:`enqueue` sends them (``mode``: ``keep``, ``replace`` or ``unique:<ms>``; ``clock``:
        ``at`` or ``in``). Raises :class:`ReservedTaskId` for an execution point's id."""
        refuse_point_id(job_id)
        shard = self.keys.shard_of(job_id)
        args = self._enqueue_args(shard, mode, clock, [(job_id, due_ms, stored_form(job_id, envelope))])
        return shard, self._enqueue_keys(shard, mode), args

    def _enqueue_args(
        self, shard: int, mode: str, clock: str, triples: list[tuple[str, int, str]]
    ) -> list[Any]:
        """``lua/enqueue.lua``'s arguments for ``(id, due ms, stored envelope)`` jobs of ``shard``:
        mode, wake channel, shard and clock, then the count of shapes, each shape's id and text
        once, then the triples, each envelope with its shape's id in place of its shape where it
        has one (:func:`~.stored_forms.shared_form`)."""
        shapes: dict[str, str] = {}
        out: list[Any] = []
        for job_id, due_ms, stored in triples:
            shared = shared_form(stored, _KEEP_WHOLE)
            if shared is not None:
                shape_id, shape, stored = shared
                shapes[shape_id] = shape
            out.extend((job_id, due_ms, stored))
        args: list[Any] = [mode, self.keys.wake_channel, shard, clock, len(shapes)]
        for item in shapes.items():
            args.extend(item)
        args.extend(out)
        return args

    def _enqueue_keys(self, shard: int, mode: str) -> Sequence[str]:
        """``lua/enqueue.lua``'s keys for ``shard``: with the uniqueness record in ``unique`` mode."""
        keys = self.keys.shard(shard)
        return keys.with_unique if mode.startswith("unique:") else keys.with_shapes

    def enqueue_keyed(
        self,
        mode: str,
        key: str,
        job_id: str,
        envelope: str,
        first_ms: int,
        second_ms: int,
        relative: bool = True,
    ) -> tuple[EnqueueOutcome, int, str | None]:
        """Store one job of ``key`` (``lua/keyed.lua``; ``job_id`` begins with the key's hash
        tag, so the job and the key's records share a shard). Mode ``"debounce"``: due
        ``first_ms`` (the wait) from the server's now, no later than ``second_ms`` (the max wait,
        0: none) after the call that opened the key's window; it replaces the key's pending job
        when no beat holds it (``DEBOUNCED``, with that job's id). Mode ``"throttle"``: due at
        ``first_ms`` (a delay with ``relative``), stored only when the key's window (``second_ms``
        long) is not open, else ``THROTTLED`` with the window's end as due. Returns
        ``(outcome, due ms, replaced id or None)``."""
        shard = self.keys.shard_of(job_id)
        keys = self.keys.shard(shard)
        args = [mode, self.keys.wake_channel, shard, key, job_id, stored_form(job_id, envelope)]
        args += [int(first_ms), int(second_ms), "in" if relative else "at"]
        now, status, due, replaced, corrupt = self._write(
            SCRIPTS["keyed"], keys.with_keyed, args, "", (job_id,)
        )
        if int(corrupt):
            logger.warning(
                "delayq: a %s record of shard %d was not of its type (a corrupt record): it was "
                "replaced, so a key of that shard may have had a second job stored",
                mode,
                shard,
            )
        self._saw_server_time(int(now))
        if isinstance(replaced, bytes):
            replaced = replaced.decode()
        outcome = _KEYED.get(int(status))
        if outcome is None:
            raise CorruptData(f"delayq keyed: unknown status {status!r}")
        return outcome, int(due), replaced or None

    def _warn_unique_replaced(self, shard: int) -> None:
        """Log that ``lua/enqueue.lua`` found the shard's uniqueness record corrupt (not a sorted
        set) and replaced it."""
        logger.warning(
            "delayq: the uniqueness record of shard %d (%s) was not a sorted set (a corrupt "
            "record): it was replaced, so an id of that shard stored with unique_for before "
            "may be stored again",
            shard,
            self.keys.shard(shard).unique,
        )

    def _check_past(self, server_ms: int, jobs: Sequence[tuple[str, int]]) -> None:
        """Log once (per store, so per app and process) a job due more than
        ``delayq_past_warning`` seconds before the server's now: likely a producer whose clock
        is wrong (an ``apply_at`` computed from ``time.time()``)."""
        limit = self.config.past_warning
        if limit is None or self._warned_past or not jobs:
            return
        job_id, due_ms = jobs[0] if len(jobs) == 1 else min(jobs, key=lambda job: job[1])
        behind = (server_ms - due_ms) / 1000.0
        if behind <= limit:
            return
        self._warned_past = True
        skew = time.time() - server_ms / 1000.0
        logger.warning(
            "delayq: job %s was given a due time %.0f s before the Redis server's now (more than "
            "delayq_past_warning = %g s); it runs at once. This process's clock differs from the "
            "server's by %+.1f s: if that is large, this producer's clock is wrong. (Logged once "
            "per process.)",
            job_id,
            behind,
            limit,
            skew,
        )

    def cancel(self, job_id: str) -> CancelOutcome:
        """Remove a job (``lua/cancel.lua``)."""
        shard = self.keys.shard_of(job_id)
        args = [job_id, self.keys.wake_channel, shard]
        return self._write_outcome(
            "cancel", _CANCEL, self.keys.shard(shard).core, args, f"job {job_id!r} not cancelled"
        )

    def cancel_many(self, shard: int, job_ids: Sequence[str]) -> list[CancelOutcome]:
        """Remove jobs of one shard, one ``lua/cancel.lua`` call each, in one pipeline (with
        ``delayq_wait_replicas``, once that many replicas have them); their outcomes in order."""
        with refused_when_full(f"{len(job_ids)} job(s) not cancelled"):
            channel = self.keys.wake_channel
            replies = self._per_shard(
                "cancel", {shard: job_ids}, 1, lambda _, ids: [*ids, channel, shard], replicated=True
            )
        return [_decode("cancel", _CANCEL, code) for _, code in replies]

    def reschedule(self, job_id: str, due_ms: int) -> RescheduleOutcome:
        """Move a waiting job (``lua/reschedule.lua``)."""
        shard = self.keys.shard_of(job_id)
        args = [job_id, int(due_ms), self.keys.wake_channel, shard]
        return self._write_outcome(
            "reschedule", _RESCHEDULE, self.keys.shard(shard).core, args, f"job {job_id!r} not moved"
        )

    def get(self, job_id: str) -> JobRecord | None:
        """The job (or dead letter) with this id, or None."""
        shard = self.keys.shard_of(job_id)
        raw = SCRIPTS["get"](self.client, self.keys.shard(shard).core, [job_id])
        if raw is None:
            return None
        if raw[0] == "dead":
            try:
                record = load_json(raw[1], f"dead-letter record of {job_id!r}")
            except CorruptData as exc:
                record = {"envelope": "", "reason": str(exc)}
            return JobRecord(
                job_id,
                shard,
                int(record.get("due", 0)),
                record.get("envelope", ""),
                "dead",
                int(record.get("tries", 0)),
            )
        lease_until = int(raw[4])
        if lease_until < 0:
            state = "waiting"
        else:
            state = _GATE_STATES.get(raw[5], "leased") if len(raw) > 5 else "leased"
        return JobRecord(
            job_id,
            shard,
            int(raw[2]),
            self._loaded(job_id, raw[1]),
            state,
            int(raw[3]),
            lease_until if 0 <= lease_until < PARK_MS else None,  # a parked job has no expiry
        )
