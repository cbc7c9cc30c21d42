"""What the Spark streaming sink committed: the last micro-batch of each query
(:meth:`StreamsPart.commit_stream`), so that a batch Spark replays after it was committed here
is skipped whole (see docs/spark.md, "Streaming").
"""

from __future__ import annotations

import logging

import redis

from .base import StoreBase, refused_when_full

logger = logging.getLogger(__name__)


class StreamsPart(StoreBase):
    """Streaming queries' commits (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def stream_committed(self, query_id: str) -> int | None:
        """The last micro-batch that query ``query_id`` committed, or None: none yet, or the
        record expired, or it is corrupt (logged; the batch is then written again, and its jobs'
        ids keep it from being stored twice)."""
        key = self.keys.stream(query_id)
        try:
            value = self.client.get(key)
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            value = b"?"
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            logger.warning("delayq: %s is not a micro-batch number (a corrupt record): ignored", key)
            return None

    def commit_stream(self, query_id: str, batch_id: int, keep_ms: int) -> None:
        """Record that query ``query_id`` committed micro-batch ``batch_id`` (Spark commits them in
        order), kept ``keep_ms``; a corrupt record is replaced (``SET`` takes a key of any type).
        A full Redis raises :class:`~celery_delayq.exceptions.StoreFull`: the query fails, and
        Spark writes the batch again when it restarts (its jobs are kept, not stored twice)."""
        with refused_when_full(f"the commit of micro-batch {batch_id} of streaming query {query_id}"):
            self.client.set(self.keys.stream(query_id), int(batch_id), px=int(keep_ms))
