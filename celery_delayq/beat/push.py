"""The push path: when the broker is the store's own Redis, the beat builds each message
itself (:mod:`.wire`) and pushes it into its queue with the removal of its job, in one script.

:class:`PushPath` finds out, per pass, whether the push path applies (the kombu channel's
server and database are the store's, and nothing needs Celery's ``send_task_message``) and
keeps the channel's message templates over the passes. :class:`Pusher` is then the pass's
strategy: it builds the messages and :meth:`Pusher.push` pushes and removes them with
``lua/push_claimed.lua`` at the end of the pass (fenced by the script itself); what it cannot
build goes through kombu (:class:`.publish.KombuPublisher`). Jobs whose message has a stored
template are pushed by ``lua/push.lua`` in the script that claims them, with
``delayq_push_on_claim``: :meth:`PushPath.probe` gives the template space it needs, and
:meth:`PushPath.add_lua_templates` stores the templates it asked for.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from kombu.common import Broadcast

from ..store.connection import OOM_REPLY, REDIS_ERRORS, error_text
from ..store.delivery import ClaimedJob, PushClaimedOutcome
from ..store.envelope import Envelope, decode_envelope
from .publish import KombuPublisher, Outcome, Publisher, Publishing
from .wire import WireTemplates, template_space, wire_message

__all__ = ["SERVER_BUSY_REPLIES", "PushPath", "Pusher"]

logger = logging.getLogger(__name__)

#: Error replies of a refused push (push_claimed.lua) that say the server cannot take writes
#: now, not that something is wrong with the message: the job is kept, never buried.
SERVER_BUSY_REPLIES = ("OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "NOREPLICAS", "MASTERDOWN")

#: One built message of the push path: the job, its task, its queue's list key, the message.
ToPush = tuple[ClaimedJob, str, str, str]


class PushPath:
    """Whether each pass of one dispatcher takes the push path, and what it keeps for it over
    the passes (which channels are the store's Redis, the message templates, the queues
    declared, the reasons already logged for leaving it)."""

    def __init__(self, publishing: Publishing) -> None:
        self.publishing = publishing
        self.app = publishing.app
        self.store = publishing.store
        self.config = publishing.config
        # kombu channel -> whether its Redis is the store's server and database (push_claimed.lua)
        self._same_server: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._templates: WireTemplates | None = None
        self._off_push: set[str] = set()  # reasons already logged (once per beat)
        self.pushing = False  # whether the last pass took the push path
        #: the template space of lua/push.lua (wire.template_space) while the broker is the store's
        #: Redis, the push path applies and delayq_push_on_claim is on; None: claim with claim.lua
        self.space: str | None = None
        self.probed = False  # whether a pass (or probe) has set pushing and space
        self._queues_declared: set[str] = set()  # queues lua/push.lua pushed to, declared once

    def begin(self, producer: Any) -> Publisher:
        """A pass publishes through ``producer``: its strategy (:meth:`.publish.Publishing.begin`),
        or a :class:`Pusher` when the push path applies."""
        p = self.publishing
        strategy = p.begin(producer)
        channel = self._push_channel(producer) if p.direct else None
        if not p.direct and "all" not in self._off_push and self._push_channel(producer) is not None:
            self._off_push.add("all")
            self.leaves_push(
                "all jobs (a before_task_publish, after_task_publish or task_sent receiver is "
                "connected, or task_send_sent_event is on: Celery's send_task_message must run)"
            )
        self.pushing = channel is not None
        self.probed = True
        if channel is None:
            self.space = None
            return strategy
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
                logger.debug("delayq: cannot look at the broker before the first pass: %s", error_text(exc))
                return None
        return self.space

    def declare_pushed(self, queues: Iterable[str]) -> None:
        """Declare, once per beat, the queues ``lua/push.lua`` pushed to (as
        :meth:`.publish.Publishing.declare_name` does for the messages the beat pushes itself;
        kombu keeps a declared queue per connection). Never raises: the messages are in their
        lists."""
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
            logger.warning("delayq: declaring queue(s) %s failed: %s", ", ".join(new), error_text(exc))

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
            logger.debug("delayq: cannot tell whether the broker is the store's Redis: %s", error_text(exc))
            return None
        return channel if same else None

    def _templates_for(self, channel: Any, producer: Any) -> WireTemplates:
        """The message templates of ``channel`` (kept across passes while it stays the same)."""
        templates = self._templates
        if templates is None or templates.channel is not channel:
            templates = self._templates = WireTemplates(channel, producer, self.publishing.direct_args)
            templates.space = template_space(channel, producer, self.app.conf)
        templates.producer = producer
        return templates


class Pusher:
    """The push path: build each message here and push it with the job's removal in one
    script (``lua/push_claimed.lua``, the broker being the store's Redis); what cannot be built
    goes through :class:`KombuPublisher`."""

    def __init__(self, path: PushPath, channel: Any, templates: WireTemplates) -> None:
        self.path = path
        self.publishing = publishing = path.publishing
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
            self.path.leaves_push(_why_not_pushed(self.channel, kwargs))
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
                "delayq: pushing %d message(s) to the broker (the store's Redis) failed: %s; "
                "those not pushed are delivered again after their lease (%.0f s)",
                sum(len(v) for v in items.values()),
                error_text(exc),
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
