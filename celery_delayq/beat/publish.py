"""Publishing claimed jobs to the broker through kombu: one interface, strategies, one outcome.

A :class:`Publisher` takes one claimed job and answers an :class:`Outcome`. The strategies:

- :class:`CeleryPublisher`: Celery's ``send_task_message``, exactly as ``apply_async`` would
  (the signals run, task-sent events are sent). Used when something would notice it skipped.
- :class:`KombuPublisher`: kombu's ``Producer.publish`` with the arguments
  ``send_task_message`` would pass (:func:`.routing.direct_args`), the same message without
  the signal machinery.
- :class:`.push.Pusher` (the push path, :mod:`.push`): when the broker is the store's own
  Redis, the message is built by the beat and pushed into its queue with the removal of its
  job, in one script; what it cannot build goes through :class:`KombuPublisher`.

The kombu and Celery paths are fenced (:mod:`.fence`) before each publish or batch flush;
the push path is fenced by its script. :class:`Publishing` holds what the strategies share
over the passes of one dispatcher (the pass's producer and settings, the queues declared, the
dead letters, the broker's errors) and turns what a publish raised into its outcome. Flow
control comes before any strategy takes a job: see :mod:`.gating`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any, Protocol

from kombu.common import Broadcast
from kombu.exceptions import EncodeError, OperationalError

from ..flow.gate import GATE_HEADER
from ..store.connection import error_text
from ..store.delivery import ClaimedJob
from ..store.envelope import CLAIM_HEADER, Envelope
from ..store.facade import Store
from ..worker.starts import claim_header
from .fence import Fence, LeaseLost
from .routing import can_publish_direct, direct_args, message_headers, send_task, transport_batches
from .stats import DispatchStats

__all__ = [
    "PERMANENT_ERRORS",
    "PUBLISH_ATTEMPTS",
    "CeleryPublisher",
    "KombuPublisher",
    "Outcome",
    "Publisher",
    "Publishing",
]

logger = logging.getLogger(__name__)

#: A job whose publish raised something other than a broker connection error is
#: retried after its lease; the claim that makes this many attempts buries it.
PUBLISH_ATTEMPTS = 5

#: Publish errors that say the message itself cannot be published (Celery's
#: QueueNotFound is a KeyError): buried at once.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (KeyError, TypeError, ValueError, EncodeError)


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
    #: built for the push path: pushed and removed by :meth:`.push.Pusher.push` at the end of the pass
    PUSHING = "pushing"
    #: not published: this beat's lease on it is lost (the fence)
    FENCED = "fenced"


class Publisher(Protocol):
    """One publishing strategy."""

    def publish(self, shard: int, job: ClaimedJob, envelope: Envelope) -> Outcome:
        """Publish ``job`` (claimed from ``shard``, its envelope decoded). Raises
        :class:`.fence.LeaseLost` only to discard the open kombu batch."""
        ...


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
        # The pass in progress (see begin()).
        self.producer: Any = None
        self.errors: tuple[type[BaseException], ...] = ()
        self.declared: set[str] = set()
        self.conf: dict[str, Any] = {}
        self.direct = False  # whether this pass skips send_task_message (see can_publish_direct)
        self.buffering = False  # whether kombu buffers this pass's publishes until the flush

    # -- one pass -----------------------------------------------------------------------------

    def begin(self, producer: Any) -> Publisher:
        """A pass publishes through ``producer``: its kombu strategy (:meth:`kombu`; the push
        path's is :meth:`.push.PushPath.begin`)."""
        self.producer = producer
        self.errors = self._broker_errors(producer)
        self.declared = set()
        self.direct = can_publish_direct(self.app, producer)
        conf = self.app.conf
        names = ("task_compression", "task_default_delivery_mode", "task_default_routing_key")
        self.conf = {name: conf[name] for name in (*names, "task_serializer")}
        self.buffering = getattr(producer, "batch", None) is not None and transport_batches(producer)
        return self.kombu()

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
                "delayq: cannot publish %s (%s) to the broker: %s; it stays stored and is "
                "retried after its lease (%.0f s)",
                job.id,
                envelope.task,
                error_text(exc),
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
            "delayq: publishing %s (%s) failed (attempt %d of %d): %s; retried after its lease (%.0f s)",
            job.id,
            envelope.task if envelope else "?",
            job.tries,
            PUBLISH_ATTEMPTS,
            error_text(exc) if isinstance(exc, BaseException) else repr(exc),
            self.config.reclaim_ttl,
        )
        return Outcome.RETRY

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


def _declare_once(p: Publishing, envelope: Envelope) -> Envelope:
    """Declare the job's queue once per pass and publish with ``declare=[]``. Raises
    KeyError for a queue the app does not know."""
    qname = envelope.route.get("queue")
    if not isinstance(qname, str) or "declare" in envelope.route:
        return envelope
    p.declare_name(qname)
    return replace(envelope, route={**envelope.route, "declare": []})
