"""Publishing one pass's claimed jobs: each as its disposition says, inside kombu's publish batch.

:meth:`PassPublisher.publish` takes the jobs a claim returned: it dead-letters those whose due
time is no time, asks the gate about the gated ones (:mod:`.gating`), picks the pass's
strategy (:mod:`.publish`, :mod:`.push`), then carries out each job's
:func:`.dispositions.disposition` and gathers what it did in a :class:`.dispositions.PassState`,
which the dispatcher's ack step reads (:mod:`.dispatch`).

On a Redis broker, kombu's publish batch builds and routes every message as usual and sends the
final commands in one pipeline when the batch closes; nothing is acked unless that flush
succeeded, and a job whose lease the fence (:mod:`.fence`) finds lost discards the batch unsent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from kombu.exceptions import BatchPublishError

from ..config import setting_name
from ..store.connection import error_text
from ..store.delivery import ClaimedJob
from ..store.envelope import Envelope, decode_envelope
from .dispositions import Disposition, PassState, disposition, due_in_range
from .fence import FENCE_FRACTION, Fence, LeaseLost
from .firing import ScheduleFiring
from .gating import Gating
from .publish import Outcome, Publishing
from .push import PushPath
from .results import fail_result
from .stats import DispatchStats

__all__ = ["PUBLISH_BATCH_MAX", "PassPublisher"]

logger = logging.getLogger(__name__)

#: Broker commands one kombu publish batch may buffer: more than a pass ever
#: publishes, so the batch is sent once, when it closes, and acks follow it.
PUBLISH_BATCH_MAX = 1_000_000


class PassPublisher:
    """Publishes the claimed jobs of each pass of one dispatcher."""

    def __init__(
        self,
        app: Any,
        stats: DispatchStats,
        fence: Fence,
        publishing: Publishing,
        push_path: PushPath,
        gating: Gating,
        firing: ScheduleFiring,
    ) -> None:
        self.app = app
        self.config = publishing.config
        self.stats = stats
        self.fence = fence
        self.publishing = publishing
        self.push_path = push_path
        self.gating = gating
        self.firing = firing

    def publish(
        self, claimed: list[tuple[int, ClaimedJob]], misses: dict[tuple[int, str], ClaimedJob]
    ) -> PassState:
        """Publish each claimed job of a pass (``(shard, job)``) as its disposition says; return
        what the pass did. ``misses``: the jobs ``lua/push.lua`` asked a template for, (shard,
        templates-hash field) -> job."""
        fence, publishing = self.fence, self.publishing
        claimed = self._bury_out_of_range(claimed)
        gated = self.gating.gate_pass(claimed)
        if gated.skip:
            # The fence renews only what this pass may publish: a parked or deferred job's
            # lease is the gate's now, not lost.
            fence.start({shard: [i for i in ids if i not in gated.skip] for shard, ids in fence.jobs.items()})
        with self.app.producer_or_acquire() as producer:
            state = PassState(gated, self.push_path.begin(producer), misses)
            batch = getattr(producer, "batch", None)
            fence.open_batch()
            try:
                with batch(max_size=PUBLISH_BATCH_MAX) if batch else contextlib.nullcontext() as opened:
                    for shard, job in claimed:
                        self._publish_one(state, shard, job)
                        if state.outage:
                            break  # the rest would fail too
                    if state.points and not state.outage:
                        state.fires = self.firing.publish(
                            publishing, self.push_path, publishing.kombu(), state.points, state.sent
                        )
                    if fence.buffered and opened is not None:
                        fence.check(None)  # raises LeaseLost: the batch is discarded unsent
                        opened.flush()
                        fence.flushed()
            except LeaseLost:
                # The jobs found lost are counted below; those still held stay leased.
                logger.warning(
                    "delayq: fence: a job in this pass's publish batch lost its lease (this beat was "
                    "paused or slowed past %.0f%% of the lease); the batch of %d message(s) was "
                    "discarded unsent; what this beat still holds is delivered after its lease (%.0f s)",
                    FENCE_FRACTION * 100,
                    len(fence.buffered),
                    self.config.reclaim_ttl,
                )
                state.discard()
            except BatchPublishError as exc:
                self.stats.publish_errors += 1
                state.outage = True
                logger.error(
                    "delayq: sending %d message(s) to the broker failed (%s; cause: %r); any that "
                    "reached it may run twice: they stay stored and are delivered again after their "
                    "lease (%.0f s)",
                    len(state.sent) + len(state.released),
                    error_text(exc),
                    exc.__cause__ or exc.__context__,
                    self.config.reclaim_ttl,
                )
                state.discard()
            if state.pusher is not None:
                state.sent.extend(state.pusher.push())
                if state.misses:
                    self.push_path.add_lua_templates(state.pusher.templates, state.misses)
        self.fence.report(state.pusher.to_push_ids() if state.pusher is not None else set())
        return state

    def _publish_one(self, state: PassState, shard: int, job: ClaimedJob) -> None:
        """Carry out the :func:`.dispositions.disposition` of one claimed job (from ``shard``)
        with the pass's strategy, noting in ``state`` what the ack step does with it, or
        ``state.outage`` when the broker is unreachable."""
        gated = state.gate
        if job.id in gated.skip:
            return  # KEPT by the gate: not decoded again
        envelope: Envelope | ValueError | None = gated.envelopes.get(job.id)
        if envelope is None:
            if state.pusher is not None and state.pusher.publish_raw(shard, job):
                return  # PUBLISH on the push path, its message built from the stored text undecoded
            try:
                envelope = decode_envelope(job.envelope, self.config.max_payload)
            except ValueError as exc:
                envelope = exc
        unknown = self.config.dead_letter_unknown
        action = disposition(job, envelope, gated, registered=self.app.tasks, dead_letter_unknown=unknown)
        publishing = self.publishing
        if action is Disposition.CORRUPT_ENVELOPE:
            self.stats.corrupt["envelope"] += 1
            publishing.bury(job, f"corrupt envelope: {envelope}", None)
            return
        assert isinstance(envelope, Envelope)  # (only a corrupt one is not)
        if action is Disposition.FIRE:
            state.points.append((shard, job, envelope))  # published together after the others
            return
        if action is Disposition.UNKNOWN_TASK:
            reason = (
                f"task {envelope.task!r} is not registered in the beat's app (import its module "
                f"in the beat, or set {setting_name(self.app, 'delayq_dead_letter_unknown')}=False)"
            )
            publishing.bury(job, reason, envelope)
            fail_result(self.app, envelope, reason)
            return
        if action is Disposition.RELEASE:  # through kombu: push_claimed.lua would remove it
            state.kombu = state.kombu or publishing.kombu()
            outcome = state.kombu.publish(shard, job, envelope)
        elif action is Disposition.PUBLISH:
            let_go = gated.let_go.get(job.id)
            if let_go is not None:  # a completion job: due when its batch finished
                held, job = let_go - job.due_ms, dataclasses.replace(job, due_ms=let_go)
            outcome = state.publisher.publish(shard, job, envelope)
            if let_go is not None and outcome in (Outcome.SENT, Outcome.PUSHING):
                state.gated_ms.append(held)
        else:  # KEPT and CORRUPT_DUE were settled before
            raise AssertionError(f"{job.id}: {action} in the publish loop")
        if outcome is Outcome.OUTAGE:
            state.outage = True
            return
        if job.id in gated.completions and outcome in (Outcome.SENT, Outcome.PUSHING):
            self.stats.completions += 1
        if outcome is not Outcome.SENT:
            return
        if action is Disposition.RELEASE:
            state.holds[shard].append((job.id, gated.released[job.id]))
            state.released.append(job.due_ms)
            released_at = gated.let_go.get(job.id)
            if released_at is not None and released_at > job.due_ms:  # held back before
                state.gated_ms.append(released_at - job.due_ms)
                state.let_go.append(released_at)
            else:  # never held back: its lateness counts from its due time
                state.let_go.append(job.due_ms)
        else:
            state.acks[shard].append(job.id)
            state.sent.append(job.due_ms)

    def _bury_out_of_range(self, claimed: list[tuple[int, ClaimedJob]]) -> list[tuple[int, ClaimedJob]]:
        """Dead-letter the claimed jobs whose due time is not a time from 1970 to year 9999 (a
        lease entry or a score written by something else, such as ``1e23|1|x``: the scripts
        read it, and Redis turns it into a number that is no time); return the others. Such a
        job is never published, nor counted in the lateness histogram. Its dead letter's
        ``due`` is 0 (unknown: no time can be read from it); its reason says what was read."""
        kept: list[tuple[int, ClaimedJob]] = []
        for shard, job in claimed:
            if due_in_range(job):  # else Disposition.CORRUPT_DUE
                kept.append((shard, job))
                continue
            self.stats.corrupt["due"] += 1
            self.publishing.bury(
                dataclasses.replace(job, due_ms=0),
                f"corrupt due time: {job.due_ms} ms is not a time from 1970 to year 9999 (its lease "
                "entry or score in Redis is out of range)",
                None,
            )
        return kept
