"""Batches as stored: open, read (:class:`BatchState`), cancel, delete and the sweep of
expired ones (``lua/batch_*.lua``), and the batch channel.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ..exceptions import CorruptData
from ..flow.gate import batch_key, member_id
from .base import StoreBase, _int_or, refused_when_full
from .delivery import ACK_CHUNK
from .scripts import SCRIPTS, ScriptCall, run_pipelined
from .stored_forms import stored_form

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchState:
    """One batch's counts (:meth:`Store.batch_state`)."""

    batch_id: str
    total: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    waiting: int  # total - running - succeeded - failed - cancelled
    done: bool
    created_ms: int
    expires_ms: int | None = None  # when the record expires (finished, or open); None: kept
    sealed: bool = True  # False: an open batch (DelayQ.open_batch) not sealed yet
    #: when it completed (ms, server clock): its completion job was let go then; None before
    finished_ms: int | None = None

    def progress(self) -> dict[str, int]:
        return {
            "total": self.total,
            "waiting": self.waiting,
            "running": self.running,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }


class BatchesPart(StoreBase):
    """Batches (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def open_batch(
        self,
        batch_id: str,
        total: int,
        completion: tuple[str, str] | None,
        meta: Mapping[str, Any],
        open_ms: int | None = None,
    ) -> bool:
        """Record batch ``batch_id`` of ``total`` members, with its completion job ``(id,
        envelope)`` stored parked until the batch ends (``lua/batch_open.lua``). False when
        a batch with this id exists (nothing written). ``open_ms``: the batch is open
        (members are added by :meth:`grow_batch` until :meth:`seal_batch`), and removed by the
        sweep when not sealed within ``open_ms`` of its last add; None: sealed at once."""
        shard = self.keys.shard_of(batch_key(batch_id))
        cid, envelope = completion if completion is not None else ("", "")
        args = [
            batch_id,
            int(total),
            cid,
            stored_form(cid, envelope) if cid else "",
            self.server_now_ms(),
            json.dumps(dict(meta), separators=(",", ":")),
            "" if open_ms is None else max(int(open_ms), 1),
        ]
        refused = f"batch {batch_id!r} not opened"
        return bool(self._write(SCRIPTS["batch_open"], self.keys.shard(shard).core, args, refused))

    def grow_batch(self, batch_id: str, count: int) -> tuple[str, int, dict[str, Any]]:
        """Reserve ``count`` more member numbers of open batch ``batch_id`` (``lua/batch_grow.lua``)
        and push its expiry back (its ``open_ms`` from now): ``("added", first, meta)`` (members
        ``first .. first + count - 1`` are the caller's to store), ``("missing", 0, {})`` or
        ``("sealed", 0, {})`` (nothing written)."""
        shard = self.keys.shard_of(batch_key(batch_id))
        args = [batch_id, int(count)]
        reply = self._write(
            SCRIPTS["batch_grow"], self.keys.shard(shard).core, args, f"batch {batch_id!r}: no member added"
        )
        status = {0: "missing", 1: "added", 2: "sealed"}[int(reply[0])]
        if status != "added":
            return status, 0, {}
        meta = json.loads(reply[2])
        return status, int(reply[1]), meta if isinstance(meta, dict) else {}

    def seal_batch(self, batch_id: str) -> tuple[str, bool]:
        """Seal open batch ``batch_id`` (``lua/batch_seal.lua``): ``("sealed", done)``,
        ``("already", False)`` or ``("missing", False)``; ``done`` when the seal completed it
        (every member had ended)."""
        shard = self.keys.shard_of(batch_key(batch_id))
        args = [batch_id, self.keys.batch_channel, self.keys.wake_channel, shard, self._batch_keep_ms()]
        names = self.keys.shard(shard)
        reply = self._write(SCRIPTS["batch_seal"], names.core, args, f"batch {batch_id!r} not sealed")
        status = {0: "missing", 1: "sealed", 2: "already"}[int(reply[0])]
        return status, bool(int(reply[1]))

    def batch_state(self, batch_id: str) -> BatchState | None:
        """A batch's counts, or None when there is no such batch."""
        return self._batch_states(self.keys.shard_of(batch_key(batch_id)), [batch_id])[0]

    def _batch_states(self, shard: int, batch_ids: Sequence[str]) -> list[BatchState | None]:
        names = self.keys.shard(shard)
        with self.client.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hgetall(names.batch(batch_id))
                pipe.zcard(names.running(batch_key(batch_id)))
            replies = iter(pipe.execute())
        out: list[BatchState | None] = []
        for batch_id in batch_ids:
            fields, running = next(replies), int(next(replies))
            if not fields:
                out.append(None)
                continue
            total, succeeded, failed, cancelled = (
                _int_or(fields.get(name)) for name in ("total", "succeeded", "failed", "cancelled")
            )
            waiting = max(total - running - succeeded - failed - cancelled, 0)
            out.append(
                BatchState(
                    batch_id,
                    total,
                    succeeded,
                    failed,
                    cancelled,
                    running,
                    waiting,
                    fields.get("done") == "1",
                    _int_or(fields.get("created")),
                    _int_or(fields["expires"]) if fields.get("expires") else None,
                    fields.get("open") != "1",
                    _int_or(fields["finished"]) if fields.get("finished") else None,
                )
            )
        return out

    def batch_states(self) -> list[BatchState]:
        """Every batch of every shard (``batches``), by id."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.smembers(shard.batches)
            found = pipe.execute()
        out: list[BatchState] = []
        for index, ids in enumerate(found):
            if ids:
                out.extend(state for state in self._batch_states(index, sorted(ids)) if state is not None)
        return sorted(out, key=lambda state: state.batch_id)

    def cancel_batch(self, batch_id: str, job_ids: Sequence[str] | None = None) -> int:
        """Remove the batch's members that were not released (waiting, parked or deferred) and
        count them cancelled (``lua/batch_cancel.lua``; the batch completes when that was the
        rest of it); how many were removed. ``job_ids`` None: every member, ``0..total-1``,
        in calls of ``ACK_CHUNK`` ids."""
        key = batch_key(batch_id)
        shard = self.keys.shard_of(key)
        if job_ids is None:
            total = _int_or(self.client.hget(self.keys.shard(shard).batch(batch_id), "total"))
            job_ids = [member_id(batch_id, i) for i in range(total)]
        head = [batch_id, key, self.keys.batch_channel, self.keys.wake_channel, shard, self._batch_keep_ms()]
        core = self.keys.shard(shard).core
        calls = [
            ScriptCall(SCRIPTS["batch_cancel"], core, [*head, *job_ids[start : start + ACK_CHUNK]])
            for start in range(0, max(len(job_ids), 1), ACK_CHUNK)
        ]
        with refused_when_full(f"batch {batch_id!r} not cancelled"):
            return sum(int(result[0]) for result in run_pipelined(self.client, calls))

    def delete_batch(self, batch_id: str, force: bool = False) -> str:
        """Delete batch ``batch_id``'s record (``lua/batch_delete.lua``): ``"deleted"``,
        ``"missing"`` (no such batch; what was left of one is removed all the same) or
        ``"pending"`` (not finished and not ``force``: nothing done).

        ``force``: a batch not finished is deleted too: its members not released yet are
        cancelled first (:meth:`cancel_batch`), its parked completion job removed (on_complete
        never runs); members running or held by a beat run to their end, counted nowhere.
        Deleting only removes, so it works on a full Redis. A ``batch:<id>`` written by hand
        as another type: :class:`CorruptData`."""
        key = batch_key(batch_id)
        shard = self.keys.shard_of(key)
        if force:
            try:
                if self.batch_state(batch_id) is not None:
                    self.cancel_batch(batch_id)
            except redis.ResponseError as exc:  # WRONGTYPE: the script below says it
                if "WRONGTYPE" not in str(exc):
                    raise
        args = [batch_id, key, "force" if force else "done"]
        names = self.keys.shard(shard)
        try:
            status = self._write(SCRIPTS["batch_delete"], names.core, args, f"batch {batch_id!r} not deleted")
        except redis.ResponseError as exc:
            if "is not a hash" in str(exc):
                raise CorruptData(
                    f"batch {batch_id!r}: {names.batch(batch_id)} is not a hash (written by hand); "
                    "nothing deleted: remove that key by hand (DEL)"
                ) from exc
            raise
        return {0: "missing", 1: "deleted", 2: "pending"}[int(status)]

    def sweep_batches(self, limit: int = 100) -> int:
        """Remove what is left of up to ``limit`` finished batches per shard whose time
        (``delayq_batch_expires``) passed: their hash expired by itself, their ids and key
        records go now (``lua/batch_delete.lua``, mode ``expired``). An open batch never sealed
        whose time passed is deleted as ``delete_batch(force=True)`` deletes: its members not
        released yet cancelled first, its parked completion job removed. How many were removed.
        The beats call it every ``BATCH_SWEEP_EVERY`` s; it also drops the shapes hash of each
        shard that holds no job (:meth:`sweep_shapes`). On one server with no finished batch and
        no shape stored, it costs one ``EXISTS``."""
        shards = self.keys.all_shards()
        if not self._any_exists([key for shard in shards for key in (shard.batch_expiry, shard.shapes)]):
            return 0
        self.sweep_shapes()
        now = self.server_now_ms()
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zrange(shard.batch_expiry, "-inf", int(now), byscore=True, offset=0, num=limit)
            found = pipe.execute()
        self._cancel_unsealed([bid for ids in found for bid in ids])
        calls = [
            ScriptCall(SCRIPTS["batch_delete"], self.keys.shard(index).core, [bid, batch_key(bid), "expired"])
            for index, ids in enumerate(found)
            for bid in ids
        ]
        if not calls:
            return 0
        results = run_pipelined(self.client, calls, raise_errors=False)
        failed = [result for result in results if isinstance(result, Exception)]
        if failed:  # a batch:<id> written by hand as another type: left, said once a sweep
            logger.warning("delayq: %d expired batch(es) not removed: %s", len(failed), failed[0])
        return sum(1 for result in results if not isinstance(result, Exception) and int(result) in (0, 1))

    def _cancel_unsealed(self, batch_ids: Sequence[str]) -> None:
        """Cancel the members not released yet of those of ``batch_ids`` that are open (never
        sealed: their expiry passed), as ``delete_batch(force=True)`` does before it deletes;
        members running are left to end."""
        with self.client.pipeline(transaction=False) as pipe:
            for bid in batch_ids:
                pipe.hget(self.keys.for_key(batch_key(bid)).batch(bid), "open")
            flags = pipe.execute(raise_on_error=False)
        for bid, flag in zip(batch_ids, flags, strict=True):
            if flag == "1":
                self.cancel_batch(bid)

    def batch_subscription(self) -> Any:
        """A pub/sub connection subscribed to the batch channel (``"<bid>|<counts JSON>"`` when a
        batch completes; ``get_message``, ``close``)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.batch_channel)
        return pubsub
