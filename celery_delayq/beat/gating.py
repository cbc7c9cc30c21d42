"""Flow control in a pass: the gate asked about a pass's gated jobs, and batches' completion jobs.

Flow control (:mod:`..flow.gate`) comes before any publishing strategy takes a job:
:meth:`Gating.gate_pass` reads the gated jobs of a pass and asks the gate about them all
(``Store.gate``, one script call per shard, one pipeline). A released gated job is published
through kombu (never ``push_claimed.lua``, which would remove it) and then *held* for its worker
(``Store.hold``) instead of acked; parked, deferred and not-held ones are not published. A
batch's completion job gets its batch's id and counts appended to its arguments.

What already ran is asked of Celery's result backend (:class:`.results.Ran`): a gated job
claimed again while its slot is held (a check of a message waiting for its worker, or a
redelivery) whose task the backend says finished is released as its worker would have released
it, and a batch's completion job whose task the backend has seen is acked unpublished. See
docs/guarantees.md, "Redis restored from an older snapshot".
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER, Gate, batch_of
from ..store.connection import REDIS_ERRORS, error_text, redis_error_kind
from ..store.delivery import ClaimedJob
from ..store.envelope import UTF8, Envelope, decode_envelope
from ..store.flow import GateDecision
from .publish import Publishing
from .results import Ran
from .routing import message_headers

__all__ = ["GatePass", "Gating", "completion_envelope"]

logger = logging.getLogger(__name__)


@dataclass
class GatePass:
    """What :meth:`Gating.gate_pass` decided for one pass's claimed jobs."""

    #: ids not to publish in this pass: parked, deferred, not held, or left to their lease
    skip: set[str] = field(default_factory=set)
    #: released gated jobs: id -> their key (published through kombu, then held)
    released: dict[str, str] = field(default_factory=dict)
    #: the decoded envelopes to publish for ids of ``released`` and for completion jobs (their
    #: arguments appended)
    envelopes: dict[str, Envelope] = field(default_factory=dict)
    #: ids of the completion jobs among ``envelopes``
    completions: set[str] = field(default_factory=set)
    #: jobs flow control held back: id -> when it let them go (ms, the server's clock): their
    #: publish lateness counts from then. A completion job: when its batch finished (its
    #: message's due time is that too); a gated job parked or deferred before: its due score
    #: when claimed plus its priority (``ClaimedJob.let_go_ms``; includes/gate.lua promote
    #: scores a promoted job at that time less its priority)
    let_go: dict[str, int] = field(default_factory=dict)


class Gating:
    """Asks the gate about the gated jobs of each pass of one dispatcher, and readies the
    batches' completion jobs; a job it cannot publish is dead-lettered through ``publishing``."""

    def __init__(self, publishing: Publishing) -> None:
        self.publishing = publishing
        self.store = publishing.store
        self.config = publishing.config
        self.token = publishing.token
        self.stats = publishing.stats
        self.ran = Ran(publishing.app)

    def gate_pass(self, claimed: list[tuple[int, ClaimedJob]]) -> GatePass:
        """Read the gated jobs and completion jobs among ``claimed`` (their envelope text
        names the header: the others are not decoded here) and ask the gate about the gated
        ones, all shards in one pipeline. A gate header that does not read is counted as
        corrupt and its job published ungated; an envelope that does not read is left to the
        publish loop (which buries it). On a Redis error the gated jobs of the pass keep their
        lease and are claimed again after it."""
        out = GatePass()
        asks: dict[int, list[tuple[str, Gate]]] = defaultdict(list)
        for shard, job in claimed:
            text = job.envelope
            if GATE_HEADER not in text and BATCH_DONE_HEADER not in text:
                continue
            try:
                envelope = decode_envelope(text, self.config.max_payload)
            except ValueError:
                continue
            if envelope.schedule is not None:
                continue
            headers = message_headers(envelope)
            if job.let_go_ms is not None and GATE_HEADER in headers:
                held = Gate.from_header(headers[GATE_HEADER])
                out.let_go[job.id] = job.let_go_ms + (held.priority if held is not None else 0)
            if job.gate_key is not None:  # the claim gave it a slot (lua/includes/gating.lua)
                self.stats.gated[GateDecision.RELEASED.value] += 1
                out.released[job.id] = job.gate_key
                out.envelopes[job.id] = envelope
                continue
            if GATE_HEADER in headers:
                gate = Gate.from_header(headers[GATE_HEADER])
                if gate is not None and job.tries > 1 and self._ran_already(job, gate):
                    out.skip.add(job.id)
                    continue
                if gate is None:
                    self.stats.corrupt["gate"] += 1
                    logger.error(
                        "delayq: job %s carries a %s header that does not read (%.200r); it is "
                        "published without flow control",
                        job.id,
                        GATE_HEADER,
                        headers[GATE_HEADER],
                    )
                else:
                    asks[shard].append((job.id, gate))
                    out.envelopes[job.id] = envelope
            if BATCH_DONE_HEADER in headers:
                self._completion(shard, job, envelope, headers[BATCH_DONE_HEADER], out)
        if asks:
            self._ask_gate(asks, out)
        return out

    def _ran_already(self, job: ClaimedJob, gate: Gate) -> bool:
        """A gated job claimed again (a check of a held job, a redelivery): when the result
        backend says its task finished since its due time, give its slot back as its worker
        would have (``Store.release``: the job removed, a batch member counted, parked jobs
        promoted) and say True: it is not gated or published again."""
        outcome = self.ran.finished(job.id, job.due_ms)
        if outcome is None:
            return False
        try:
            result = self.store.release(job.id, gate.key, outcome, gate.batch or batch_of(job.id))
        except REDIS_ERRORS as exc:
            self.stats.redis_errors[redis_error_kind(exc)] += 1
            return False
        if not result.released:  # no slot: nothing to give back, gated as usual
            return False
        self.stats.gated["finished"] += 1
        logger.warning(
            "delayq: job %s (key %r) was claimed again while its slot is held, and the result "
            "backend says its task ended (%s) since it was due: its slot is given back and it "
            "is not run again (the store may have been restored from an older snapshot)",
            job.id,
            gate.key,
            outcome,
        )
        return True

    def _ask_gate(self, asks: dict[int, list[tuple[str, Gate]]], out: GatePass) -> None:
        ttl_ms = int(self.config.slot_ttl * 1000)
        try:
            results = self.store.gate(self.token, asks, ttl_ms)
        except REDIS_ERRORS as exc:
            self.stats.redis_errors[redis_error_kind(exc)] += 1
            asked = [job_id for jobs in asks.values() for job_id, _ in jobs]
            out.skip.update(asked)
            logger.error(
                "delayq: the gate cannot be asked about %d gated job(s) (%s); they stay leased "
                "to this beat and are claimed again after their lease (%.0f s)",
                len(asked),
                error_text(exc),
                self.config.reclaim_ttl,
            )
            return
        suspects: dict[str, tuple[str, int]] = {}  # id -> (key, slot expiry ms)
        for jobs in asks.values():
            for job_id, gate in jobs:
                result = results[job_id]
                self.stats.gated[result.decision.value] += 1
                if result.decision is GateDecision.RELEASED:
                    out.released[job_id] = gate.key
                else:
                    out.skip.add(job_id)
                    out.envelopes.pop(job_id, None)
                for suspect, expiry in result.suspects:
                    suspects[suspect] = (gate.key, expiry)
        if suspects and self.ran.backend is not None:
            self._give_back(suspects)

    def _give_back(self, suspects: dict[str, tuple[str, int]]) -> None:
        """Slots of a full key whose job is gone (``Store.gate``'s suspects): give back those
        whose task the result backend says ended since the slot was taken (its expiry less
        ``delayq_start_ttl``), as its worker would have; the parked jobs of the key are then
        promoted by the release."""
        start_ms = self.config.start_ttl * 1000
        for job_id, (key, expiry) in suspects.items():
            outcome = self.ran.finished(job_id, expiry - start_ms)
            if outcome is None:
                continue
            try:
                result = self.store.release(job_id, key, outcome, batch_of(job_id))
            except REDIS_ERRORS as exc:
                self.stats.redis_errors[redis_error_kind(exc)] += 1
                continue
            if result.released:
                self.stats.gated["finished"] += 1
                logger.warning(
                    "delayq: the slot of job %s (key %r) was held by a job no longer stored whose "
                    "task the result backend says ended (%s): it is given back (the store may have "
                    "been restored from an older snapshot)",
                    job_id,
                    key,
                    outcome,
                )

    def _completion(
        self, shard: int, job: ClaimedJob, envelope: Envelope, batch_id: Any, out: GatePass
    ) -> None:
        """A batch's completion job: append ``(batch id, counts)`` to its arguments; acked
        unpublished when the result backend says a worker took it already (its batch completed
        before, in a store since restored from an older snapshot)."""
        if self.ran.seen(job.id, job.due_ms):
            out.skip.add(job.id)
            out.released.pop(job.id, None)
            try:
                self.store.ack(self.token, {shard: [job.id]})
            except REDIS_ERRORS as exc:
                self.stats.redis_errors[redis_error_kind(exc)] += 1
            self.stats.gated["finished"] += 1
            logger.warning(
                "delayq: the completion job %s of batch %s ran already (the result backend has "
                "it); it is not published again (the store may have been restored from an older "
                "snapshot)",
                job.id,
                batch_id,
            )
            return
        base = out.envelopes.get(job.id, envelope)
        try:
            state = self.store.batch_state(str(batch_id))
        except REDIS_ERRORS as exc:
            self.stats.redis_errors[redis_error_kind(exc)] += 1
            out.skip.add(job.id)
            out.released.pop(job.id, None)
            logger.error(
                "delayq: cannot read batch %s for its completion job %s (%s); it is "
                "claimed again after its lease",
                batch_id,
                job.id,
                error_text(exc),
            )
            return
        counts: dict[str, int] | None = None
        if state is None:
            logger.warning(
                "delayq: batch %s of completion job %s is not stored (any more); its "
                "counts are given as None",
                batch_id,
                job.id,
            )
        else:
            counts = {
                "total": state.total,
                "succeeded": state.succeeded,
                "failed": state.failed,
                "cancelled": state.cancelled,
            }
        try:
            out.envelopes[job.id] = completion_envelope(base, str(batch_id), counts)
        except ValueError as exc:
            out.skip.add(job.id)
            out.released.pop(job.id, None)
            self.publishing.bury(job, f"completion job of batch {batch_id}: {exc}", envelope)
            return
        out.completions.add(job.id)
        if state is not None and state.finished_ms is not None and state.finished_ms > job.due_ms:
            out.let_go[job.id] = state.finished_ms


def completion_envelope(envelope: Envelope, batch_id: str, counts: dict[str, int] | None) -> Envelope:
    """``envelope`` with ``batch_id`` and ``counts`` appended to its positional arguments
    (and to its ``argsrepr``). ValueError when its body is not a JSON task body.

    >>> from celery_delayq.store.envelope import JSON_CT
    >>> e = Envelope("t", {"argsrepr": "(1,)"}, {}, b'[[1], {}, {}]', JSON_CT, UTF8, {}, None, 0)
    >>> done = completion_envelope(e, "b1", {"total": 2})
    >>> done.body, done.headers["argsrepr"]
    (b'[[1, "b1", {"total": 2}], {}, {}]', "(1, 'b1', {'total': 2})")
    """
    if not envelope.json_body:
        raise ValueError(f"its body is {envelope.content_type}, not JSON: the counts cannot be appended")
    encoding = envelope.content_encoding or UTF8
    try:
        args, kwargs, embed = json.loads(envelope.body.decode(encoding))
        args = [*args, batch_id, counts]
        body = json.dumps([args, kwargs, embed]).encode(encoding)
    except (ValueError, TypeError, LookupError, RecursionError) as exc:
        raise ValueError(f"its JSON body does not read as a task's: {exc!r}") from exc
    headers = {**envelope.headers, "argsrepr": repr(tuple(args))}
    return replace(envelope, body=body, headers=headers)
