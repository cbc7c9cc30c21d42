"""Dead letters: read, count, requeue (``lua/requeue.lua``, :class:`RequeueOutcome`) and
delete.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

from ..exceptions import CorruptData
from .base import StoreBase
from .bounded import load_json
from .stored_forms import id_opening


class RequeueOutcome(enum.StrEnum):
    """What putting a dead letter back did (``lua/requeue.lua``)."""

    MISSING = "missing"  # no dead letter with this id
    REQUEUED = "requeued"
    STORED = "stored"  # refused: a job with this id is stored, waiting or being delivered
    NO_ENVELOPE = "no-envelope"  # refused: the record holds no message


_REQUEUE = tuple(RequeueOutcome)  # 0 missing, 1 requeued, 2 stored, 3 no-envelope


class DeadPart(StoreBase):
    """Dead letters (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def count_dead(self) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.hlen(shard.dead)
            return sum(int(n) for n in pipe.execute())

    def dead_record(self, job_id: str) -> dict[str, Any] | None:
        """The dead-letter record of ``job_id`` (reason, task, due, tries, dead_at, beat,
        envelope), or None."""
        raw = self.client.hget(self.keys.for_job(job_id).dead, job_id)
        if raw is None:
            return None
        record: dict[str, Any] = load_json(raw, f"dead-letter record of {job_id!r}")
        return record

    def requeue(self, job_id: str, due_ms: int) -> RequeueOutcome:
        """Put a dead-lettered job back as a waiting job due at ``due_ms``, removing its dead
        letter, atomically (``lua/requeue.lua``)."""
        shard = self.keys.shard_of(job_id)
        args = [job_id, int(due_ms), id_opening(job_id), self.keys.wake_channel, shard]
        return self._write_outcome(
            "requeue", _REQUEUE, self.keys.shard(shard).core, args, f"dead letter {job_id!r} not requeued"
        )

    def dead(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every dead-lettered job: ``(id, record)``."""
        for shard in range(self.keys.shards):
            for job_id, raw in self.dead_in_shard(shard):
                try:
                    yield job_id, load_json(raw, f"dead-letter record of {job_id!r}")
                except CorruptData as exc:  # listed with the reason, never ends the listing
                    yield job_id, {"reason": str(exc), "envelope": ""}

    def dead_in_shard(self, shard: int, page: int | None = None) -> Iterator[tuple[str, str]]:
        """The dead letters of one shard as stored: ``(id, record JSON)`` (``HSCAN``, about
        ``page`` a call)."""
        yield from self.client.hscan_iter(self.keys.shard(shard).dead, count=page)

    def delete_dead(self, job_id: str) -> bool:
        """Forget a dead-lettered job; False when there was no dead letter with this id."""
        return bool(self.client.hdel(self.keys.for_job(job_id).dead, job_id))

    def delete_all_dead(self, page: int = 1000) -> int:
        """Forget every dead letter (``HSCAN`` and ``HDEL`` a page at a time); how many were
        removed."""
        client = self.client
        removed = 0
        for shard in self.keys.all_shards():
            batch: list[str] = []
            for job_id, _ in client.hscan_iter(shard.dead, count=page):
                batch.append(job_id)
                if len(batch) >= page:
                    removed += int(client.hdel(shard.dead, *batch))
                    batch = []
            if batch:
                removed += int(client.hdel(shard.dead, *batch))
        return removed
