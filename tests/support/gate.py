"""Gated jobs read and moved as the beat would, through the store's own calls: the headers a
stored job is published with (:func:`published_headers`, :func:`message`) and members taken
through the gate and held as running (:func:`run_members`)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_delayq.flow.gate import GATE_HEADER, Gate
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import get_store
from celery_delayq.store.flow import GateDecision

#: The lease token the helpers claim with.
TOKEN = "beat-test"


def published_headers(stored: str) -> dict[str, Any]:
    """The headers a message of this envelope is published with: Celery's, and the
    ``headers`` option's (kombu merges them at publish)."""
    envelope = decode_envelope(stored)
    return {**envelope.headers, **envelope.route.get("headers", {})}


def message(app: Celery, job_id: str) -> tuple[dict[str, Any], Any, int, str]:
    """The stored job's message headers, its priority, its due ms and its state."""
    record = get_store(app).get(job_id)
    assert record is not None, job_id
    priority = decode_envelope(record.envelope).priority
    return published_headers(record.envelope), priority, record.due_ms, record.state


def run_members(app: Celery, ids: list[str]) -> None:
    """Take ``ids`` (the first due jobs of their shard, in the order of the due set: same
    due time, by id) as a beat would: claim them, pass the gate, hold them as running (what
    the beat does after publishing)."""
    store = get_store(app)
    shard = store.keys.shard_of(ids[0])
    [claimed] = store.claim([shard], TOKEN, batch=len(ids))
    by_id = {job.id: job for job in claimed.jobs}
    assert set(ids) == set(by_id)
    jobs = [(i, Gate.from_header(published_headers(by_id[i].envelope)[GATE_HEADER])) for i in ids]
    assert all(gate is not None for _, gate in jobs)
    decided = store.gate(TOKEN, {shard: jobs}, 60_000)  # type: ignore[dict-item]
    assert {decided[i].decision for i in ids} == {GateDecision.RELEASED}
    held = store.hold(TOKEN, {shard: [(job_id, gate.key) for job_id, gate in jobs]}, 60_000)  # type: ignore[union-attr]
    assert all(held[i] for i in ids)
