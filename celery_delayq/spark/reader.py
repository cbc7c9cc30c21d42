"""The pending schedule as rows: the plain-Python reader behind ``spark.read.format("delayq")``
(one Spark partition per shard), usable without Spark too (:func:`read_shard`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from ..due import MAX_DUE_MS, ms_to_datetime
from ..flow.gate import PARK_MS
from ..store.envelope import decode_envelope
from ..store.facade import Store
from ..store.stored_forms import loaded_form

__all__ = ["READ_COLUMNS", "READ_SCHEMA", "read_shard"]

#: The columns ``spark.read.format("delayq")`` returns, as a Spark DDL schema.
READ_SCHEMA = (
    "id STRING, task STRING, due TIMESTAMP, shard INT, state STRING, queue STRING, "
    "args STRING, kwargs STRING, tries INT, lease_until TIMESTAMP, created TIMESTAMP, reason STRING, "
    "keyed STRING"
)
READ_COLUMNS = tuple(part.split()[0] for part in READ_SCHEMA.split(", "))


def _json_text(value: Any) -> str | None:
    if value is None:
        return None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _row(
    job_id: str, shard: int, due_ms: int, raw: str, state: str, tries: int,
    lease_until: int | None, reason: str | None,
) -> tuple[Any, ...]:  # fmt: skip
    task: str | None = None
    queue = args = kwargs = None
    created: datetime | None = None
    keyed: str | None = None
    try:
        envelope = decode_envelope(loaded_form(job_id, raw))
        task = envelope.task
        keyed = envelope.keyed
        queue = envelope.queue
        created = ms_to_datetime(envelope.created_ms)
        args, kwargs = envelope.arguments()
        if envelope.json_body:
            args, kwargs = _json_text(args), _json_text(kwargs)
    except (ValueError, KeyError, TypeError, RecursionError):
        task = "<corrupt envelope>"
    return (
        job_id, task, ms_to_datetime(due_ms), shard, state, queue, args, kwargs, tries,
        ms_to_datetime(lease_until) if lease_until is not None else None, created, reason,
        keyed,
    )  # fmt: skip


def read_shard(
    store: Store, shard: int, due_from: int | None = None, due_until: int | None = None,
    include_dead: bool = True, page_size: int = 5000,
) -> Iterator[tuple[Any, ...]]:  # fmt: skip
    """The jobs of one shard due in ``[due_from, due_until]`` (ms, inclusive; None: open),
    as tuples in :data:`READ_COLUMNS` order.

    ``state`` is ``"waiting"`` (due later), ``"due"`` (due time passed, no beat has
    claimed it yet), ``"leased"`` (a beat is delivering it), ``"gated"`` (flow control holds
    it back: parked for a slot, with no ``lease_until``, or deferred by its rate until
    ``lease_until``), ``"running"`` (a released capped job whose task has not finished; its
    slot lasts until ``lease_until``) or ``"dead"``. Waiting
    and due jobs are read by score range only; leased ones (whose score is
    their lease expiry) from the shard's small leases hash, dead ones from its
    dead-letter hash. Not one snapshot: a job claimed while the shard is read
    can show up as leased, or be missed.
    """
    low = due_from if due_from is not None else 0
    high = due_until if due_until is not None else MAX_DUE_MS
    if low > high:
        return
    now_ms = int(time.time() * 1000)  # "due" or "waiting": this machine's clock will do
    seen: set[str] = set()
    for job_id, due, raw, lease in store.due_entries(shard, low, high, page_size):
        if raw is None:
            continue
        if lease:  # its score is the lease expiry: it is listed below if its due time fits
            continue
        seen.add(job_id)
        yield _row(job_id, shard, due, raw, "due" if due <= now_ms else "waiting", 0, None, None)
    leased = [  # (id, due ms, tries, state); a lease entry that does not read is left out
        (job_id, due, tries, state)
        for job_id, due, tries, state in store.leased(shard)
        if job_id not in seen and low <= due <= high
    ]
    if leased:  # their envelopes and lease expiries: one round trip
        found = store.envelopes_and_scores(shard, [job_id for job_id, _, _, _ in leased])
        for (job_id, due, tries, state), (raw, until) in zip(leased, found, strict=True):
            if raw is not None:
                # a parked job (flow control) has no lease expiry: it waits for a slot
                lease_until = None if until is None or until >= PARK_MS else until
                yield _row(job_id, shard, due, raw, state, tries, lease_until, None)
    if include_dead:
        for job_id, text in store.dead_in_shard(shard, page_size):
            try:
                record = json.loads(text)
                due = int(record["due"])
            except (ValueError, KeyError, TypeError):
                continue
            if low <= due <= high:
                yield _row(job_id, shard, due, record.get("envelope") or "", "dead",
                           int(record.get("tries") or 0), None, record.get("reason"))  # fmt: skip
