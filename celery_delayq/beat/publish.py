"""Publishing claimed jobs to the broker: one interface, three strategies, one outcome.

A :class:`Publisher` takes one claimed job and answers an :class:`Outcome`. The strategies:

- :class:`CeleryPublisher`: Celery's ``send_task_message``, exactly as ``apply_async`` would
  (the signals run, task-sent events are sent). Used when something would notice it skipped.
- :class:`KombuPublisher`: kombu's ``Producer.publish`` with the arguments
  ``send_task_message`` would pass (:func:`direct_args`), the same message without the
  signal machinery.
- :class:`Pusher` (the push path): when the broker is the store's own Redis, the message is
  built here (:mod:`.wire`) and pushed into its queue by ``lua/push_claimed.lua``, in the
  same step that removes the job (:meth:`Pusher.push`); what it cannot build goes through
  kombu. (Jobs whose message has a stored template are pushed by ``lua/push.lua`` in the
  script that claims them, with ``delayq_push_on_claim``: see :mod:`.dispatch`.)

Flow control (:mod:`..flow.gate`) comes first: :meth:`Publishing.gate_pass` reads the gated jobs of
a pass and asks the gate about them all (``Store.gate``, one script call per shard, one
pipeline) before any strategy takes a job. A released gated job is published through kombu
(never ``push_claimed.lua``, which would remove it) and then *held* for its worker
(``Store.hold``) instead of acked; parked, deferred and not-held ones are not published. A
batch's completion job gets its batch's id and counts appended to its arguments.

What already ran is asked of Celery's result backend (:class:`Ran`), which a store restored
from an older snapshot does not take back in time with it: a gated job claimed again while
its slot is held (a check of a message waiting for its worker, or a redelivery) whose task
the backend says finished is released as its worker would have released it, and a batch's
completion job whose task the backend has seen is acked unpublished. See docs/guarantees.md,
"Redis restored from an older snapshot".

The kombu and Celery paths are fenced (:mod:`.fence`) before each publish or batch flush;
the push path is fenced by the script itself. :class:`Publishing` holds what the
strategies share over the passes of one dispatcher (caches, the dead letters, the broker's
errors) and picks the strategy of each pass.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from celery import states
from celery.backends.base import DisabledBackend
from kombu.common import Broadcast
from kombu.exceptions import EncodeError, OperationalError

from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER, Gate, batch_of
from ..store.envelope import CLAIM_HEADER, UTF8, Envelope, decode_envelope
from ..store.facade import (
    OOM_REPLY,
    REDIS_ERRORS,
    ClaimedJob,
    GateDecision,
    PushClaimedOutcome,
    Store,
    error_text,
    redis_error_kind,
)
from ..worker.starts import claim_header
from .fence import Fence, LeaseLost
from .routing import can_publish_direct, direct_args, send_task, transport_batches
from .stats import DispatchStats
from .wire import WireTemplates, template_space, wire_message

__all__ = [
    "PERMANENT_ERRORS",
    "PUBLISH_ATTEMPTS",
    "CeleryPublisher",
    "GatePass",
    "KombuPublisher",
    "Outcome",
    "Publisher",
    "Publishing",
    "Pusher",
]

logger = logging.getLogger(__name__)

#: A job whose publish raised something other than a broker connection error is
#: retried after its lease; the claim that makes this many attempts buries it.
PUBLISH_ATTEMPTS = 5

#: Error replies of a refused push (push_claimed.lua) that say the server cannot take writes
#: now, not that something is wrong with the message: the job is kept, never buried.
SERVER_BUSY_REPLIES = ("OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "NOREPLICAS", "MASTERDOWN")

#: Publish errors that say the message itself cannot be published (Celery's
#: QueueNotFound is a KeyError): buried at once.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (KeyError, TypeError, ValueError, EncodeError)

#: One built message of the push path: the job, its task, its queue's list key, the message.
ToPush = tuple[ClaimedJob, str, str, str]


class Outcome(Enum):
    """What publishing one claimed job came to."""

    #: handed to the broker (or to kombu's open batch): ack it
    SENT = "sent"
    #: the broker is unreachable: the job keeps its lease; the pass stops
    OUTAGE = "outage"
    #: failed for a reason that may pass: delivered again after its lease
    RETRY = "retry"
    #: moved to the dead letters
    BURIED = "buried"
    #: built for the push path: pushed and removed by :meth:`Pusher.push` at the end of the pass
    PUSHING = "pushing"
    #: not published: this beat's lease on it is lost (the fence)
    FENCED = "fenced"


@dataclass
class GatePass:
    """What :meth:`Publishing.gate_pass` decided for one pass's claimed jobs."""

    #: ids not to publish in this pass: parked, deferred, not held, or left to their lease
    skip: set[str] = field(default_factory=set)
    #: released gated jobs: id -> their key (published through kombu, then held)
    released: dict[str, str] = field(default_factory=dict)
    #: the decoded envelopes to publish for ids of ``released`` and for completion jobs (their
    #: arguments appended)
    envelopes: dict[str, Envelope] = field(default_factory=dict)
    #: ids of the completion jobs among ``envelopes``
    completions: set[str] = field(default_factory=set)


class Publisher(Protocol):
    """One publishing strategy."""

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        """Publish ``job`` (claimed from ``shard``, its envelope decoded). Raises
        :class:`.fence.LeaseLost` only to discard the open kombu batch."""
        ...


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
                "delayq: the result backend cannot be used (%r); what already ran is not "
                "looked up (see docs/guarantees.md)",
                exc,
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
                    "delayq: cannot read the result of %s from the result backend (%r); "
                    "what already ran is not known until it answers",
                    task_id,
                    exc,
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


class Publishing:
    """What a dispatcher's publishers share: the app, the store, the fence, the dead letters,
    the per-pass producer state and the caches kept over passes."""

    def __init__(
        self,
        app: Any,
        store: Store,
        token: str,
        stats: DispatchStats,
        fence: Fence,
        server_now_ms: Callable[[], float],
    ) -> None:
        self.app = app
        self.store = store
        self.config = store.config
        self.token = token
        self.stats = stats
        self.fence = fence
        self.server_now_ms = server_now_ms
        self._connection_errors: tuple[type[BaseException], ...] | None = None
        # kombu channel -> whether its Redis is the store's server and database (push_claimed.lua)
        self._same_server: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._templates: WireTemplates | None = None
        self._off_push: set[str] = set()  # reasons already logged (once per beat)
        # The pass in progress (see begin()).
        self.producer: Any = None
        self.errors: tuple[type[BaseException], ...] = ()
        self.declared: set[str] = set()
        self.conf: dict[str, Any] = {}
        self.direct = False  # whether this pass skips send_task_message (see can_publish_direct)
        self.buffering = False  # whether kombu buffers this pass's publishes until the flush
        self.pushing = False  # whether the last pass took the push path
        #: the template space of lua/push.lua (wire.template_space) while the broker is the store's
        #: Redis, the push path applies and delayq_push_on_claim is on; None: claim with claim.lua
        self.space: str | None = None
        self.probed = False  # whether a pass (or probe) has set pushing and space
        self._queues_declared: set[str] = set()  # queues lua/push.lua pushed to, declared once
        self.ran = Ran(app)

    # -- one pass -----------------------------------------------------------------------------

    def begin(self, producer: Any) -> Publisher:
        """A pass publishes through ``producer``: its strategy."""
        self.producer = producer
        self.errors = self._broker_errors(producer)
        self.declared = set()
        self.direct = can_publish_direct(self.app, producer)
        channel = self._push_channel(producer) if self.direct else None
        if not self.direct and "all" not in self._off_push and self._push_channel(producer) is not None:
            self._off_push.add("all")
            self.leaves_push(
                "all jobs (a before_task_publish, after_task_publish or task_sent receiver is "
                "connected, or task_send_sent_event is on: Celery's send_task_message must run)"
            )
        self.pushing = channel is not None
        self.probed = True
        conf = self.app.conf
        names = ("task_compression", "task_default_delivery_mode", "task_default_routing_key")
        self.conf = {name: conf[name] for name in (*names, "task_serializer")}
        self.buffering = getattr(producer, "batch", None) is not None and transport_batches(producer)
        if channel is None:
            self.space = None
            return KombuPublisher(self) if self.direct else CeleryPublisher(self)
        templates = self._templates_for(channel, producer)
        if self.config.push_on_claim:
            self.space = templates.space
        return Pusher(self, channel, templates)

    def probe(self) -> str | None:
        """Before the first pass: find out whether the push path applies (one look at the
        broker), so that the first claim already pushes on claim (``lua/push.lua``). The template space,
        or None."""
        if not self.probed:
            try:
                with self.app.producer_or_acquire() as producer:
                    self.begin(producer)
            except Exception as exc:  # the broker is unreachable: the pass reports it
                logger.debug("delayq: cannot look at the broker before the first pass: %r", exc)
                return None
        return self.space

    def declare_pushed(self, queues: Iterable[str]) -> None:
        """Declare, once per beat, the queues ``lua/push.lua`` pushed to (as
        :meth:`declare_name` does for the messages the beat pushes itself; kombu keeps a
        declared queue per connection). Never raises: the messages are in their lists."""
        new = [q for q in queues if q not in self._queues_declared]
        if not new:
            return
        try:
            with self.app.producer_or_acquire() as producer:
                for qname in new:
                    queue = self.app.amqp.queues.get(qname)
                    if queue is not None and not isinstance(queue, Broadcast):
                        producer.maybe_declare(queue)
                    self._queues_declared.add(qname)
        except Exception as exc:  # the broker went away: declared at the next pass
            logger.warning("delayq: declaring queue(s) %s failed: %r", ", ".join(new), exc)

    def add_lua_templates(self, templates: WireTemplates, found: dict[tuple[int, str], ClaimedJob]) -> None:
        """Store the templates ``lua/push.lua`` asked for (``found``: (shard, templates-hash
        field) -> a job of that shape claimed from that shard) so that from the next pass on it
        pushes such jobs itself: in every shard's hash, as a field names no shard (the jobs of one
        shape are spread over all shards, and each shard would miss it once, a whole batch going
        this beat's way). Never raises: without them the jobs go this beat's way."""
        registered = self.app.tasks
        known = (lambda task: task in registered) if self.config.dead_letter_unknown else (lambda task: True)
        fields = {name: templates.lua_template(job.envelope, known) for (_, name), job in found.items()}
        by_shard = {shard: fields for shard in range(self.store.keys.shards)}
        try:
            self.store.add_templates(by_shard)
        except REDIS_ERRORS as exc:
            logger.warning("delayq: storing %d message template(s) failed: %s", len(found), error_text(exc))

    def claim(self, job: ClaimedJob, envelope: Envelope) -> str | None:
        """The claim header of ``job``'s message (:mod:`..worker.starts`), or None for a gated job: a
        released one is delivered again by design once its worker died (its slot expired),
        after it started, and the gate keeps it to its one slot."""
        if GATE_HEADER in message_headers(envelope):
            return None
        return claim_header(job, envelope.created_ms, self.token)

    def kombu(self) -> Publisher:
        """This pass's strategy for what must go through kombu (schedule points): kombu direct,
        or Celery's ``send_task_message`` when something would notice it skipped."""
        return KombuPublisher(self) if self.direct else CeleryPublisher(self)

    def guarded(self, job: ClaimedJob, envelope: Envelope, send: Callable[[], Outcome | None]) -> Outcome:
        """Run ``send`` (None: handed to kombu; or its own outcome: FENCED, PUSHING) and turn
        what it raised into the outcome."""
        try:
            outcome = send()
            if outcome is not None:
                return outcome
        except LeaseLost:
            raise  # the fence discards the open batch
        except self.errors as exc:
            # The broker is unreachable: keep the lease; the job is delivered again
            # when it expires. The caller stops this pass: the rest would fail too.
            self.stats.publish_errors += 1
            logger.error(
                "delayq: cannot publish %s (%s) to the broker: %r; it stays stored and is "
                "retried after its lease (%.0f s)",
                job.id,
                envelope.task,
                exc,
                self.config.reclaim_ttl,
            )
            return Outcome.OUTAGE
        except PERMANENT_ERRORS as exc:
            # Something about this message (an unknown queue, a bad property):
            # publishing it again cannot succeed.
            self.bury(job, f"publish failed: {exc!r}", envelope)
            return Outcome.BURIED
        except Exception as exc:
            # Not a lost connection: maybe this message, maybe a passing broker
            # fault. Retry through the lease; bury after PUBLISH_ATTEMPTS claims.
            return self.failed(job, envelope, exc)
        self.fence.sent(job.id, self.buffering)
        return Outcome.SENT

    # -- flow control ---------------------------------------------------------------------------

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
            self.bury(job, f"completion job of batch {batch_id}: {exc}", envelope)
            return
        out.completions.add(job.id)

    # -- dead letters and retries -------------------------------------------------------------

    def bury(self, job: ClaimedJob, reason: str, envelope: Envelope | None) -> None:
        """Move a claimed job to the dead letters with ``reason``."""
        record = {
            "reason": reason,
            "task": envelope.task if envelope else None,
            "due": job.due_ms,
            "tries": job.tries,
            "dead_at": int(self.server_now_ms()),
            "beat": self.token,
            "envelope": job.envelope,
        }
        self.fence.buried.add(job.id)
        if self.store.bury(self.token, job.id, record):
            self.stats.dead_lettered += 1
            logger.error("delayq: job %s moved to dead letters: %s", job.id, reason)

    def failed(self, job: ClaimedJob, envelope: Envelope | None, exc: object) -> Outcome:
        """A publish failed for a reason that may pass: RETRY after the lease, or
        BURIED once the job has had PUBLISH_ATTEMPTS claims."""
        self.stats.publish_errors += 1
        if job.tries >= PUBLISH_ATTEMPTS:
            self.bury(job, f"publish failed {job.tries} times, last: {exc!r}", envelope)
            return Outcome.BURIED
        logger.warning(
            "delayq: publishing %s (%s) failed (attempt %d of %d): %r; retried after its lease (%.0f s)",
            job.id,
            envelope.task if envelope else "?",
            job.tries,
            PUBLISH_ATTEMPTS,
            exc,
            self.config.reclaim_ttl,
        )
        return Outcome.RETRY

    def leaves_push(self, reason: str) -> None:
        """Log once per beat and reason that jobs leave the push path (lua/push_claimed.lua) for
        kombu's publish, fenced by the lease check instead of by the script."""
        if reason not in self._off_push:
            self._off_push.add(reason)
            logger.info(
                "delayq: %s leave the push path (push_claimed.lua) and are published through kombu, "
                "fenced by their lease (see docs/guarantees.md)",
                reason,
            )

    # -- queues -------------------------------------------------------------------------------

    def declare(self, queue: Any, producer: Any = None) -> None:
        """Declare a kombu queue once per pass, as ``send_task_message`` would before publishing
        (it would on every publish, and kombu binds (copies) the queue each time before finding
        it already declared: half the cost of a publish)."""
        if queue.name not in self.declared:
            if not isinstance(queue, Broadcast):
                (producer or self.producer).maybe_declare(queue)
            self.declared.add(queue.name)

    def declare_name(self, qname: str) -> None:
        """:meth:`declare` the app's queue ``qname`` (KeyError for a queue it does not know)."""
        if qname not in self.declared:
            self.declare(self.app.amqp.queues[qname])

    def direct_args(self, producer: Any, envelope: Envelope, due_ms: int) -> dict[str, Any]:
        """:func:`direct_args` with this pass's settings, declaring the queue once."""
        return direct_args(
            self.app,
            self.conf,
            envelope,
            due_ms,
            self.config.publish_eta,
            self.server_now_ms(),
            lambda queue: self.declare(queue, producer),
        )

    # -- the broker -----------------------------------------------------------------------------

    def _broker_errors(self, producer: Any) -> tuple[type[BaseException], ...]:
        if self._connection_errors is None:
            conn = producer.connection
            errors = tuple(conn.connection_errors) + tuple(getattr(conn, "recoverable_connection_errors", ()))
            # kombu's Redis transport counts KeyError as a connection error, but
            # Celery's QueueNotFound (a queue this app does not know) is a KeyError:
            # that job can never be published here, so it must be buried, not retried.
            self._connection_errors = (*(e for e in errors if e is not KeyError), OperationalError)
        return self._connection_errors

    def _push_channel(self, producer: Any) -> Any:
        """The kombu Redis channel when its server and database are the store's, else None.

        Then :class:`Pusher` pushes the messages itself (``lua/push_claimed.lua``), each
        with the removal of its job, in one step (the push path); otherwise they go through kombu.
        """
        if not self.config.push or not self.store.is_single_server():
            return None
        try:
            channel = producer.channel
            if not all(
                hasattr(channel, name)
                for name in ("_q_for_pri", "_get_message_priority", "encode_body", "conn_or_acquire")
            ):
                return None
            same = self._same_server.get(channel)
            if same is None:
                with channel.conn_or_acquire() as client:
                    same = self.store.is_server_of(client)
                if same:
                    logger.info(
                        "delayq: the broker is the store's Redis (db %d): each due job is pushed "
                        "into its queue and removed in one script",
                        self.store.database(),
                    )
                self._same_server[channel] = same
        except Exception as exc:  # broker unreachable: the kombu path reports it per job
            logger.debug("delayq: cannot tell whether the broker is the store's Redis: %r", exc)
            return None
        return channel if same else None

    def _templates_for(self, channel: Any, producer: Any) -> WireTemplates:
        """The message templates of ``channel`` (kept across passes while it stays the same)."""
        templates = self._templates
        if templates is None or templates.channel is not channel:
            templates = self._templates = WireTemplates(channel, producer, self.direct_args)
            templates.space = template_space(channel, producer, self.app.conf)
        templates.producer = producer
        return templates


class CeleryPublisher:
    """Celery's ``send_task_message``, as ``apply_async`` would (signals, sent events)."""

    def __init__(self, publishing: Publishing) -> None:
        self.publishing = publishing

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        p = self.publishing

        def send() -> Outcome | None:
            routed = _declare_once(p, envelope)
            if not p.fence.check(job.id):
                return Outcome.FENCED
            send_task(
                p.app,
                p.producer,
                routed,
                job.due_ms,
                now_ms=int(p.server_now_ms()),
                with_eta=p.config.publish_eta,
                claim=p.claim(job, envelope),
            )
            return None

        return p.guarded(job, envelope, send)


class KombuPublisher:
    """kombu's ``Producer.publish`` with ``send_task_message``'s arguments (:func:`direct_args`)."""

    def __init__(self, publishing: Publishing) -> None:
        self.publishing = publishing

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        p = self.publishing
        return p.guarded(
            job, envelope, lambda: self.send(job, envelope, p.direct_args(p.producer, envelope, job.due_ms))
        )

    def send(self, job: ClaimedJob, envelope: Envelope, kwargs: dict[str, Any]) -> Outcome | None:
        """Fence, then publish (None: handed to kombu) with the claim's header (:mod:`..worker.starts`:
        a copy published after the lease was lost is dropped by the worker)."""
        p = self.publishing
        if not p.fence.check(job.id):
            return Outcome.FENCED
        claim = p.claim(job, envelope)
        if claim is not None:
            kwargs["headers"] = {**kwargs["headers"], CLAIM_HEADER: claim}
        p.producer.publish(**kwargs)
        return None


class Pusher:
    """The push path: build each message here and push it with the job's removal in one
    script (``lua/push_claimed.lua``, the broker being the store's Redis); what cannot be built
    goes through :class:`KombuPublisher`."""

    def __init__(self, publishing: Publishing, channel: Any, templates: WireTemplates) -> None:
        self.publishing = publishing
        self.channel = channel
        self.templates = templates
        self.kombu = KombuPublisher(publishing)
        self.to_push: dict[int, list[ToPush]] = defaultdict(list)

    def publish_raw(self, shard: int, job: ClaimedJob) -> bool:
        """The fast path: build the message from the stored envelope with the channel's
        templates, without decoding it. False: decode it and :meth:`publish`."""
        p = self.publishing
        if len(job.envelope) > p.config.max_payload:
            return False
        built = self.templates.build(job.envelope, job.due_ms)
        if built is None or (built[3] not in p.app.tasks and p.config.dead_letter_unknown):
            return False
        key, text, qname, task = built
        p.declare_name(qname)
        self.to_push[shard].append((job, task, key, text))
        return True

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        p = self.publishing

        def send() -> Outcome | None:
            kwargs = p.direct_args(p.producer, envelope, job.due_ms)
            built = wire_message(self.channel, p.producer, kwargs)
            if built is not None:
                self.to_push[shard].append((job, envelope.task, *built))
                return Outcome.PUSHING
            p.leaves_push(_why_not_pushed(self.channel, kwargs))
            return self.kombu.send(job, envelope, kwargs)

        return p.guarded(job, envelope, send)

    def push(self) -> list[int]:
        """Push and ack the built messages (one script call per shard chunk); return the due
        times of those pushed."""
        p, to_push = self.publishing, self.to_push
        items = {
            shard: [(job.id, key, body) for job, _, key, body in jobs] for shard, jobs in to_push.items()
        }
        if not any(items.values()):
            return []
        try:
            results = p.store.push_claimed(p.token, items)
        except REDIS_ERRORS as exc:
            # Push and removal are one step: each job is either in its queue and gone from the
            # store, or still stored under its lease and delivered again when that expires.
            p.stats.publish_errors += 1
            logger.error(
                "delayq: pushing %d message(s) to the broker (the store's Redis) failed: %r; "
                "those not pushed are delivered again after their lease (%.0f s)",
                sum(len(v) for v in items.values()),
                exc,
                p.config.reclaim_ttl,
            )
            return []
        pushed: list[int] = []
        stale = full = 0
        for jobs in to_push.values():
            for job, task, key, _ in jobs:
                reply = results[job.id]
                error = reply.error  # set when REFUSED
                if reply.outcome is PushClaimedOutcome.PUSHED:
                    pushed.append(job.due_ms)
                elif reply.outcome is PushClaimedOutcome.STALE:
                    stale += 1
                elif OOM_REPLY in error:
                    full += 1  # (6.2: "@user_script: 1: -OOM command not allowed ...")
                elif error.startswith(SERVER_BUSY_REPLIES):
                    p.stats.publish_errors += 1
                    logger.error(
                        "delayq: the broker refused %s (%s): %s; it stays stored and is retried after "
                        "its lease (%.0f s)",
                        job.id,
                        task,
                        error,
                        p.config.reclaim_ttl,
                    )
                elif error.startswith("WRONGTYPE"):
                    reason = f"publish failed: queue key {key!r} is not a list: {error}"
                    p.bury(job, reason, _decoded(job))
                else:
                    p.failed(job, _decoded(job), f"LPUSH {key!r}: {error}")
        p.stats.acked += len(pushed)
        if full:
            p.stats.publish_errors += full
            logger.error(
                "delayq: the broker (the store's Redis) is over its maxmemory: %d message(s) not "
                "pushed; they stay stored and are retried after their lease (%.0f s). A Celery "
                "worker cannot run on a full Redis broker: raise maxmemory or free memory",
                full,
                p.config.reclaim_ttl,
            )
        if stale:
            p.stats.stale_acks += stale
            logger.warning(
                "delayq: %d claimed job(s) were no longer leased to this beat when pushed (lease "
                "expired and re-claimed, or cancelled/replaced meanwhile); not published by this beat",
                stale,
            )
        return pushed

    def to_push_ids(self) -> set[str]:
        """Ids of the jobs built for the push path in this pass (push_claimed.lua drops and counts
        those whose lease was lost, not the fence)."""
        return {job.id for jobs in self.to_push.values() for job, *_ in jobs}


def message_headers(envelope: Envelope) -> dict[str, Any]:
    """The headers the message of ``envelope`` carries: its own, and those of its route's
    ``headers`` option (:func:`.routing.direct_args` merges them)."""
    extra = envelope.route.get("headers")
    if isinstance(extra, dict) and extra:
        return {**envelope.headers, **extra}
    return envelope.headers


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


def _declare_once(p: Publishing, envelope: Envelope) -> Envelope:
    """Declare the job's queue once per pass and publish with ``declare=[]``. Raises
    KeyError for a queue the app does not know."""
    qname = envelope.route.get("queue")
    if not isinstance(qname, str) or "declare" in envelope.route:
        return envelope
    p.declare_name(qname)
    return replace(envelope, route={**envelope.route, "declare": []})


def _why_not_pushed(channel: Any, kwargs: dict[str, Any]) -> str:
    """Why :func:`.wire.wire_message` left a message to kombu (for the once-per-beat log)."""
    if kwargs.get("compression"):
        return "compressed messages"
    if kwargs.get("exchange"):
        return "exchange-routed messages"
    if kwargs.get("declare"):
        return "messages that declare entities"
    if kwargs.get("routing_key") in (getattr(channel, "_expires", None) or ()):
        return "messages to a queue with x-expires"
    return "messages wire.py cannot build"


def _decoded(job: ClaimedJob) -> Envelope | None:
    try:
        return decode_envelope(job.envelope)
    except ValueError:
        return None
