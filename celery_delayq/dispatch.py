"""The claim loop: claim due jobs, publish them into their Celery queues, ack them.

One :class:`Dispatcher` runs inside each beat (see :mod:`.scheduler`); any
number of them may share one store with no leader. Each pass claims a bounded
batch from the shards that may have due jobs, publishes every claimed job with
Celery's own message machinery, and only then acks it. A beat that dies
between claim and ack loses nothing: its leases expire after
``delayq_reclaim_ttl`` and another beat delivers the batch again (so a crash
can duplicate at most the batch it held).

Between passes the dispatcher sleeps until the earliest due time it knows of,
on a pub/sub subscription: the enqueue script publishes on the wake channel
when it stores a job earlier than the shard's wake marker, which wakes every
beat at once. Every ``delayq_max_sleep`` seconds all shards are claimed anyway
(the safety poll), and after any lost subscription.

Besides delivering, a dispatcher keeps three things that cost no Redis call per job
(:meth:`Dispatcher.chores`, run after a pass and from the sleep): the due -> publish
lateness of what it published (``<prefix>:lateness:publish``, see :mod:`.lateness`), flushed
at most every ``LATENESS_FLUSH_EVERY`` s; its heartbeat in ``<prefix>:beats``, every
``HEARTBEAT_EVERY`` s; and, when ``delayq_metrics_port`` is set, the counters a
Prometheus endpoint (:mod:`.metrics`) reads. Every ``STALL_SWEEP_EVERY`` s it also takes one
bounded step of the sweep that finds and re-arms stalled schedules (:class:`.schedules.StallSweep`).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import os
import random
import socket
import time
import uuid
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import redis
from celery.signals import after_task_publish, before_task_publish, task_sent
from kombu.common import Broadcast
from kombu.exceptions import BatchPublishError, EncodeError

from .bounded import MAX_SMALL, load_json
from .config import setting_name
from .exceptions import CorruptData
from .lateness import Histogram, tally
from .lateness import key_for as lateness_key
from .message import DUE_HEADER, Envelope, decode_envelope, due_iso, publish
from .scripts import SCRIPTS, ScriptCall, run_pipelined
from .store import OOM_REPLY, REDIS_ERRORS, ClaimedJob, Store, error_text, get_store, redis_error_kind
from .wire import WireTemplates, wire_message

if TYPE_CHECKING:
    from .metrics import MetricsServer

__all__ = ["DispatchStats", "Dispatcher"]

logger = logging.getLogger("celery_delayq.dispatch")

#: A job whose publish raised something other than a broker connection error is
#: retried after its lease; the claim that makes this many attempts buries it.
PUBLISH_ATTEMPTS = 5

#: Longest back-off (s) between claims while the broker is unreachable.
BROKER_BACKOFF_MAX = 5.0

#: Broker commands one kombu publish batch may buffer: more than a pass ever
#: publishes, so the batch is sent once, when it closes, and acks follow it.
PUBLISH_BATCH_MAX = 1_000_000

#: The fence: a beat publishes a job it leased only while its local monotonic clock is short of
#: ``base + FENCE_FRACTION x delayq_reclaim_ttl``, where ``base`` is the monotonic time taken just
#: before the claim (or the renew, lua/renew.lua) was sent. The server set the lease's expiry to
#: its own now + TTL after that moment, so the lease cannot have expired before base + TTL (the
#: server's clock runs at the local rate: NTP slews by at most 0.05 %). Past the fraction the
#: beat renews in Redis what it still holds, and drops the rest unpublished. The other half of
#: the TTL is the margin for what the fence cannot see: the publish or batch flush after the last
#: check (the residual window, measured in docs/guarantees.md) and a pause within it.
FENCE_FRACTION = 0.5

#: Most residual windows (s, last fence check -> the broker has the bytes) a dispatcher keeps
#: for :meth:`Dispatcher.fence_window` (the most recent ones).
FENCE_WINDOWS_KEPT = 10_000

#: Seconds between two flushes of the due -> publish lateness histogram (at most; only when
#: something was published).
LATENESS_FLUSH_EVERY = 2.0

#: Seconds between two heartbeats (this beat's entry in ``<prefix>:beats``).
HEARTBEAT_EVERY = 5.0

#: An entry of ``<prefix>:beats`` not refreshed for this long (ms) is removed by any beat.
BEAT_FORGET_MS = 600_000

#: Seconds between two looks for such entries (one HGETALL with a heartbeat).
PRUNE_EVERY = 60.0

#: Seconds between two steps of the sweep for stalled schedules (see schedules.StallSweep).
STALL_SWEEP_EVERY = 10.0

#: Upper bounds of the claim batch size histogram: jobs taken by one claim of one shard.
CLAIM_SIZE_BOUNDS: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)

_SENT, _OUTAGE, _RETRY, _BURIED, _WIRED, _FENCED = (object() for _ in range(6))


class _LeaseLost(Exception):
    """Raised inside kombu's publish batch to discard it unsent: a job in it lost its lease."""


#: fire.lua's answer when the schedule's run state did not read and was reset (see the script).
FIRE_HISTORY_RESET = 3

#: How soon (ms) a beat claims again the shards of a cluster node that failed while others
#: answered (a primary failing over).
CLUSTER_RETRY_MS = 1000.0

#: Error replies of a refused push (deliver.lua) that say the server cannot take writes
#: now, not that something is wrong with the message: the job is kept, never buried.
SERVER_BUSY_REPLIES = ("OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "NOREPLICAS", "MASTERDOWN")

#: Publish errors that say the message itself cannot be published (Celery's
#: QueueNotFound is a KeyError): buried at once.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (KeyError, TypeError, ValueError, EncodeError)


@dataclass
class DispatchStats:
    """Counters of one dispatcher since it started."""

    passes: int = 0
    claimed: int = 0
    published: int = 0
    acked: int = 0
    stale_acks: int = 0
    #: claimed jobs not published because the fence found their lease lost (also in stale_acks)
    fenced: int = 0
    #: renews of a pass's leases (lua/renew.lua) because the fence's local deadline had passed
    renewals: int = 0
    dead_lettered: int = 0
    publish_errors: int = 0
    wakeups: int = 0
    #: stalled schedules this beat found and re-armed (see schedules.StallSweep)
    stalls_repaired: int = 0
    #: ticks that failed as a whole (Redis or the broker unreachable; counted by the Scheduler)
    errors: int = 0
    #: failed ticks and shard claims by kind of Redis error (store.redis_error_kind): unreachable,
    #: oom, script, noscript, other; a failed tick is counted by the Scheduler
    redis_errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: stored entries found unreadable, by what they were: envelope (the job was dead-lettered),
    #: lease (claim.lua replaced it), definition (the schedule's point was dead-lettered),
    #: history (fire.lua reset the run state)
    corrupt: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: claims that took jobs, by size: one count per bound of CLAIM_SIZE_BOUNDS, then larger
    claim_sizes: list[int] = field(default_factory=lambda: [0] * (len(CLAIM_SIZE_BOUNDS) + 1))
    lateness_ms: list[float] = field(default_factory=list)


class Dispatcher:
    """Claims, publishes and acks due jobs of one app; sleeps until the next one."""

    def __init__(self, app: Any, store: Store | None = None, keep_lateness: int = 0) -> None:
        self.app = app
        self.store = store or get_store(app)
        self.config = self.store.config
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}".replace("|", "_")
        self.stats = DispatchStats()
        self._keep_lateness = keep_lateness
        shards = self.config.shards
        # Earliest time (server ms) each shard may have something due; None: look now.
        self._next: list[float | None] = [None] * shards
        self._offset_ms = 0.0  # server clock - local clock, measured at each claim
        self._last_full = 0.0
        self._pubsub: Any = None
        self._connection_errors: tuple[type[BaseException], ...] | None = None
        self._schedules: Any = None
        self._declared: set[str] = set()
        self._direct = False
        self._conf: dict[str, Any] = {}
        # kombu channel -> whether its Redis is the store's server and database (deliver.lua)
        self._same_server: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.wire = False  # whether the last pass pushed messages with deliver.lua
        # The fence (see FENCE_FRACTION): monotonic time before which this pass's leases are
        # surely held; the pass's claimed jobs by shard; ids found lost; jobs in the open kombu
        # batch (buffered, not yet sent); when the last check passed.
        self._fence_at = 0.0
        self._pass_jobs: dict[int, list[str]] = {}
        self._lost: set[str] = set()
        self._buried: set[str] = set()  # dead-lettered in this pass: no lease left to renew
        self._buffered: list[str] = []
        self._checked_at = 0.0
        self._overran = 0  # messages of this pass sent after the lease may have expired
        #: residual windows (s): last fence check -> publish returned / batch flushed
        self.fence_windows: deque[float] = deque(maxlen=FENCE_WINDOWS_KEPT)
        self._off_atomic: set[str] = set()  # reasons already logged (once per beat)
        self._templates: WireTemplates | None = None
        self._broker_backoff = 0.0  # seconds; 0 while the broker answers
        self._broker_retry_at = 0.0  # monotonic time before which no claim is made
        # due -> publish lateness: not yet flushed to Redis / everything since the start
        self.lateness = Histogram()
        self.lateness_seen = Histogram()
        self._lateness_key = lateness_key(self.config.prefix, "publish")
        self._flushed_at = time.monotonic()
        self._flush_failing = False
        self.host = socket.gethostname()
        self.started_ms = int(time.time() * 1000)
        # The last heartbeat's seen_ms: a heartbeat never goes back in time, although the estimate
        # of the server's clock (re-measured at each claim) may step back by a millisecond or so.
        self._seen_ms = 0
        self._heartbeat_at = 0.0  # monotonic: the first pass writes one
        self._heartbeat_failing = False
        self._prune_at = 0.0
        self._stalls: Any = None  # the StallSweep, built at its first step
        self._stall_sweep_at = 0.0  # monotonic: the first chores run one
        self.metrics: MetricsServer | None = None  # the endpoint, once serve_metrics() started it

    # -- clock -------------------------------------------------------------------------------

    def server_now_ms(self) -> float:
        return time.time() * 1000.0 + self._offset_ms

    # -- one pass ----------------------------------------------------------------------------

    def _shards_to_claim(self) -> list[int]:
        now = self.server_now_ms()
        if time.monotonic() - self._last_full >= self.config.max_sleep:
            self._last_full = time.monotonic()
            shards = list(range(self.config.shards))
        else:
            shards = [i for i, nxt in enumerate(self._next) if nxt is None or nxt <= now]
        random.shuffle(shards)  # beats start on different shards
        return shards

    def run_once(self) -> float:
        """Claim, publish and ack one batch from every shard that may have due jobs.

        Returns the seconds until the next known due time (0 when a batch came
        back full, so the caller should pass again at once).
        """
        if self._pubsub is None:
            self._subscribe()
        if time.monotonic() < self._broker_retry_at:
            if time.monotonic() >= self._next_chore():
                self.chores()
            return self.seconds_until_due()  # the broker was unreachable: wait out the back-off
        shards = self._shards_to_claim()
        if shards:
            self._pass(shards)
        if time.monotonic() >= self._next_chore():
            self.chores()
        return self.seconds_until_due()

    def _broker_state(self, outage: bool, published: bool) -> None:
        """After a pass: back off from claiming while the broker is unreachable (0.5 s, doubling
        up to BROKER_BACKOFF_MAX or delayq_max_sleep), so a beat does not claim, fail and log
        at every due job; reset once something was published."""
        if outage:
            limit = min(BROKER_BACKOFF_MAX, self.config.max_sleep)
            self._broker_backoff = min(limit, self._broker_backoff * 2) if self._broker_backoff else 0.5
            self._broker_retry_at = time.monotonic() + self._broker_backoff
            logger.warning("delayq: broker unreachable; next claim in %.1f s", self._broker_backoff)
        elif published and self._broker_backoff:
            logger.warning("delayq: broker reachable again; publishing")
            self._broker_backoff = 0.0
            self._broker_retry_at = 0.0

    def seconds_until_due(self) -> float:
        backoff = self._broker_retry_at - time.monotonic()
        if backoff > 0:
            return min(backoff, self.config.max_sleep)
        now = self.server_now_ms()
        known = [n for n in self._next if n is not None]
        if len(known) < len(self._next):
            return 0.0
        earliest = min(known) if known else now + self.config.max_sleep * 1000
        wait = (earliest - now) / 1000.0
        until_full = self._last_full + self.config.max_sleep - time.monotonic()
        return max(0.0, min(wait, until_full, self.config.max_sleep))

    def _pass(self, shards: list[int]) -> None:
        sent = time.time()
        # On a cluster, a node that is down (failing over) must not hold up the other nodes'
        # shards: their claims stand and are delivered now (see below). The same for a shard
        # whose claim script fails (a key of the wrong type, a full server): it must not wedge
        # the others.
        failed: list[Exception] = []
        claim_sent = time.monotonic()  # the leases expire at the earliest at claim_sent + TTL
        results = self.store.claim(shards, self.token, failed=failed)
        self._fence_at = claim_sent + FENCE_FRACTION * self.config.reclaim_ttl
        received = time.time()
        self.stats.passes += 1
        full = False
        claimed: list[tuple[int, ClaimedJob]] = []
        sizes = self.stats.claim_sizes
        for result in results:
            if result.jobs:
                sizes[bisect.bisect_left(CLAIM_SIZE_BOUNDS, len(result.jobs))] += 1
            self._offset_ms = result.now_ms - (sent + received) * 500.0
            self._next[result.shard] = result.next_ms
            if result.next_ms is None:
                self._next[result.shard] = float("inf")
            if len(result.jobs) >= self.config.batch_size:
                full = True
                self._next[result.shard] = None
            claimed.extend((result.shard, job) for job in result.jobs)
            if result.repaired:
                self.stats.corrupt["lease"] += result.repaired
                logger.error(
                    "delayq: shard %d held %d lease entr(ies) that do not read; the claim replaced "
                    "them (each job is delivered as if its lease had expired)",
                    result.shard,
                    result.repaired,
                )
        if claimed:
            self.stats.claimed += len(claimed)
            self._pass_jobs = defaultdict(list)
            for shard, job in claimed:
                self._pass_jobs[shard].append(job.id)
            self._lost, self._buried = set(), set()
            to_ack, fires = self._publish(claimed)
            self._settle(to_ack, fires)
            if full:
                logger.debug("delayq: a claimed batch was full; passing again at once")
        if failed:
            if not results:
                raise failed[0]  # no node answered: the tick backs off as for any outage
            # Some shards answered (a cluster primary is failing over, or one shard's claim
            # failed): no back-off, the others' shards stay on time; the failed shards are tried
            # again each second.
            answered = {result.shard for result in results}
            retry_at = self.server_now_ms() + CLUSTER_RETRY_MS
            missed = [shard for shard in shards if shard not in answered]
            for shard in missed:
                self._next[shard] = retry_at
            for exc in failed:
                self.stats.redis_errors[redis_error_kind(exc)] += 1
            logger.error(
                "delayq: %d of %d shard(s) could not be claimed (%s); the others were delivered; "
                "trying those again in %.0f s",
                len(missed),
                len(shards),
                error_text(failed[0]),
                CLUSTER_RETRY_MS / 1000,
            )

    def _settle(self, to_ack: dict[int, list[str]], fires: list[ScriptCall]) -> None:
        """Ack the published jobs and fire the published schedule points (after the publish)."""
        if fires:
            for call, result in zip(fires, run_pipelined(self.store.client, fires), strict=True):
                if int(result) == 0:
                    self.stats.stale_acks += 1
                elif int(result) == FIRE_HISTORY_RESET:
                    self.stats.corrupt["history"] += 1
                    logger.error(
                        "delayq: schedule %r had a run state (history) that does not read; it was "
                        "reset (run count and last run lost) and the schedule goes on",
                        call.args[2],
                    )
        if to_ack:
            acked = self.store.ack(self.token, to_ack)
            removed = sum(acked.values())
            self.stats.acked += removed
            stale = len(acked) - removed
            if stale:
                self.stats.stale_acks += stale
                logger.warning(
                    "delayq: %d published job(s) were no longer leased to this beat when acked "
                    "(lease expired and re-claimed, or cancelled/replaced meanwhile)",
                    stale,
                )

    def _publish(
        self, claimed: list[tuple[int, ClaimedJob]]
    ) -> tuple[dict[int, list[str]], list[ScriptCall]]:
        """Publish each claimed job; return the ids to ack, by shard, and the fire calls
        that ack the published schedule points and advance their schedules.

        On a Redis broker, kombu's publish batch builds and routes every message as
        usual and sends the final commands in one pipeline when the batch closes;
        nothing is acked unless that flush succeeded.
        """
        to_ack: dict[int, list[str]] = defaultdict(list)
        fires: list[ScriptCall] = []
        points: list[tuple[int, ClaimedJob, Envelope]] = []
        sent: list[int] = []
        wired: dict[int, list[tuple[ClaimedJob, str, str, str]]] = defaultdict(list)
        registered = self.app.tasks
        dead_letter_unknown = self.config.dead_letter_unknown
        self._declared = set()
        outage = False
        with self.app.producer_or_acquire() as producer:
            errors = self._broker_errors(producer)
            self._direct = self._can_publish_direct(producer)
            channel = self._wire_channel(producer) if self._direct else None
            if (
                not self._direct
                and "all" not in self._off_atomic
                and self._wire_channel(producer) is not None
            ):
                self._off_atomic.add("all")
                self._leaves_atomic(
                    "all jobs (a before_task_publish, after_task_publish or task_sent receiver is "
                    "connected, or task_send_sent_event is on: Celery's send_task_message must run)"
                )
            self.wire = channel is not None
            templates = self._templates_for(channel, producer)
            self._conf = self._publish_conf()
            batch = getattr(producer, "batch", None)
            # Whether kombu buffers the publishes until the batch is flushed (Redis), or sends
            # each at once (RabbitMQ): the fence checks before the flush, or before each.
            buffering = batch is not None and self._transport_batches(producer)
            self._buffered = []
            self._overran = 0
            try:
                with batch(max_size=PUBLISH_BATCH_MAX) if batch else contextlib.nullcontext() as opened:
                    for shard, job in claimed:
                        if templates is not None and len(job.envelope) <= self.config.max_payload:
                            built = templates.build(job.envelope, job.due_ms)
                            if built is not None and (built[3] in registered or not dead_letter_unknown):
                                key, text, qname, task = built
                                if qname not in self._declared:
                                    self._declare(producer, self.app.amqp.queues[qname])
                                wired[shard].append((job, task, key, text))
                                continue
                        try:
                            envelope = decode_envelope(job.envelope, self.config.max_payload)
                        except ValueError as exc:
                            self.stats.corrupt["envelope"] += 1
                            self._bury(job, f"corrupt envelope: {exc}", None)
                            continue
                        if envelope.schedule is not None:
                            points.append((shard, job, envelope))
                            continue
                        if self.config.dead_letter_unknown and envelope.task not in registered:
                            self._bury(
                                job,
                                f"task {envelope.task!r} is not registered in the beat's app "
                                "(import its module in the beat, or set "
                                f"{setting_name(self.app, 'delayq_dead_letter_unknown')}=False)",
                                envelope,
                            )
                            continue
                        wire = wired[shard] if channel is not None else None
                        outcome = self._try_publish(producer, errors, job, envelope, channel, wire, buffering)
                        if outcome is _OUTAGE:
                            outage = True
                            break
                        if outcome is _SENT:
                            to_ack[shard].append(job.id)
                            sent.append(job.due_ms)
                    if points and not outage:
                        fires = self._fire_points(producer, errors, points, sent, buffering)
                    if self._buffered and opened is not None:
                        self._fence_check(None)  # raises _LeaseLost: the batch is discarded unsent
                        opened.flush()
                        self._published_at(len(self._buffered))
            except _LeaseLost:
                # The jobs found lost are counted below; those still held stay leased.
                dropped = len(self._buffered)
                logger.warning(
                    "delayq: fence: a job in this pass's publish batch lost its lease (this beat was "
                    "paused or slowed past %.0f%% of the lease); the batch of %d message(s) was "
                    "discarded unsent; what this beat still holds is delivered after its lease (%.0f s)",
                    FENCE_FRACTION * 100,
                    dropped,
                    self.config.reclaim_ttl,
                )
                to_ack, fires, sent = defaultdict(list), [], []
            except BatchPublishError as exc:
                self.stats.publish_errors += 1
                outage = True
                logger.error(
                    "delayq: sending %d message(s) to the broker failed (%r; cause: %r); any that "
                    "reached it may run twice: they stay stored and are delivered again after their "
                    "lease (%.0f s)",
                    len(sent),
                    exc,
                    exc.__cause__ or exc.__context__,
                    self.config.reclaim_ttl,
                )
                to_ack, fires, sent = defaultdict(list), [], []
            if channel is not None:
                sent.extend(self._deliver(wired))
        # Lost jobs of the atomic path are deliver.lua's to drop (and count), not the fence's.
        fenced = len(self._lost.difference(job.id for jobs in wired.values() for job, *_ in jobs))
        if fenced:
            self.stats.fenced += fenced
            self.stats.stale_acks += fenced
            logger.warning(
                "delayq: fence: %d claimed job(s) were not published: their lease was no longer "
                "this beat's when it was renewed before publishing (this beat was paused or slowed "
                "past %.0f%% of the lease, %.1f s)",
                fenced,
                FENCE_FRACTION * 100,
                self.config.reclaim_ttl,
            )
        if self._overran:
            logger.warning(
                "delayq: fence: %d message(s) reached the broker after their lease may have expired "
                "(the publish or the batch flush took longer than the last %.0f%% of the lease, "
                "%.1f s); if another beat re-claimed them meanwhile they run twice",
                self._overran,
                (1 - FENCE_FRACTION) * 100,
                self.config.reclaim_ttl,
            )
        self._broker_state(outage, bool(sent or to_ack))
        now = self.server_now_ms()
        self.stats.published += len(sent)
        if sent:
            # bucketed once per job here; one pipeline per LATENESS_FLUSH_EVERY s (chores)
            observed = tally([now - due for due in sent])
            self.lateness.add(observed)
            self.lateness_seen.add(observed)
        if self._keep_lateness:
            room = self._keep_lateness - len(self.stats.lateness_ms)
            self.stats.lateness_ms.extend(now - due for due in sent[: max(0, room)])
        return to_ack, fires

    def _try_publish(
        self,
        producer: Any,
        errors: tuple[type[BaseException], ...],
        job: ClaimedJob,
        envelope: Envelope,
        channel: Any = None,
        wire: list[tuple[ClaimedJob, str, str, str]] | None = None,
        buffering: bool = False,
    ) -> object:
        """Publish one job: ``_SENT``, ``_OUTAGE`` (broker unreachable), ``_RETRY`` (after its
        lease) or ``_BURIED`` (moved to the dead letters); or ``_WIRED`` when its kombu message
        was built and added to ``wire``, for :meth:`_deliver` to push and ack in one script;
        or ``_FENCED`` when this beat's lease on it is lost (:meth:`_fence_check`).
        ``buffering``: kombu's batch holds the message until it is flushed."""
        try:
            if self._direct:
                kwargs = self._direct_args(producer, envelope, job.due_ms)
                built = None if wire is None else wire_message(channel, producer, kwargs)
                if built is not None:
                    assert wire is not None
                    wire.append((job, envelope.task, *built))
                    return _WIRED
                if wire is not None:
                    self._leaves_atomic(_why_not_wired(channel, kwargs))
                if not self._fence_check(job.id):
                    return _FENCED
                producer.publish(**kwargs)
            else:
                envelope = self._declare_once(producer, envelope)
                if not self._fence_check(job.id):
                    return _FENCED
                publish(
                    self.app,
                    producer,
                    envelope,
                    job.due_ms,
                    now_ms=int(self.server_now_ms()),
                    with_eta=self.config.publish_eta,
                )
        except _LeaseLost:
            raise  # the fence discards the open batch: see _publish
        except errors as exc:
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
            return _OUTAGE
        except PERMANENT_ERRORS as exc:
            # Something about this message (an unknown queue, a bad property):
            # publishing it again cannot succeed.
            self._bury(job, f"publish failed: {exc!r}", envelope)
            return _BURIED
        except Exception as exc:
            # Not a lost connection: maybe this message, maybe a passing broker
            # fault. Retry through the lease; bury after PUBLISH_ATTEMPTS claims.
            return self._failed(job, envelope, exc)
        if buffering:
            self._buffered.append(job.id)
        else:
            self._published_at(1)
        return _SENT

    def _published_at(self, messages: int) -> None:
        """A publish returned, or a batch flush: keep its residual window (since the last fence
        check), and count the messages that reached the broker only after the lease may have
        expired (a publish that Celery retried, a stall in the window): they may run twice."""
        now = time.monotonic()
        self.fence_windows.append(now - self._checked_at)
        if now >= self._fence_at + (1 - FENCE_FRACTION) * self.config.reclaim_ttl:
            self._overran += messages

    # -- the fence (see FENCE_FRACTION) ---------------------------------------------------------

    def _fence_check(self, job_id: str | None) -> bool:
        """Whether ``job_id`` may be published now (None: the open batch may be flushed).

        Within FENCE_FRACTION of the lease since the claim (or the last renew) was sent: yes,
        without asking Redis. Past it: :meth:`_renew` every lease of the pass first; a job whose
        lease was lost is not published, and when one of them is already in the open kombu
        batch, raises :class:`_LeaseLost` (the batch is discarded unsent)."""
        if time.monotonic() >= self._fence_at:
            self._renew()
            if self._lost.intersection(self._buffered):
                raise _LeaseLost
        self._checked_at = time.monotonic()
        return job_id is None or job_id not in self._lost

    def _renew(self) -> None:
        """Renew, in one round trip (lua/renew.lua), the leases of this pass's jobs not yet
        found lost; those not held any more are added to the lost ones. A renew that fails or
        takes longer than the fence allows counts every job of the pass as lost."""
        gone = self._lost | self._buried
        ids = {shard: [i for i in jobs if i not in gone] for shard, jobs in self._pass_jobs.items()}
        sent = time.monotonic()
        self.stats.renewals += 1
        try:
            held, _ = self.store.renew(self.token, {shard: jobs for shard, jobs in ids.items() if jobs})
        except REDIS_ERRORS as exc:
            logger.warning(
                "delayq: fence: cannot renew this beat's leases before publishing (%r); the rest of "
                "this pass is left unpublished and delivered after its lease (%.0f s)",
                exc,
                self.config.reclaim_ttl,
            )
            held = {}
        self._fence_at = sent + FENCE_FRACTION * self.config.reclaim_ttl
        if time.monotonic() >= self._fence_at:
            held = {}  # the renew itself took too long: nothing is sure any more
        self._lost.update(i for jobs in ids.values() for i in jobs if not held.get(i))

    def fence_window(self) -> tuple[int, float, float]:
        """``(count, p99 ms, max ms)`` of the residual windows kept (the last FENCE_WINDOWS_KEPT):
        the time from the last fence check to the end of a publish or batch flush."""
        windows = sorted(self.fence_windows)
        if not windows:
            return 0, 0.0, 0.0
        p99 = windows[min(len(windows) - 1, math.ceil(0.99 * len(windows)) - 1)]
        return len(windows), p99 * 1000.0, windows[-1] * 1000.0

    def _leaves_atomic(self, reason: str) -> None:
        """Log once per beat and reason that jobs leave the atomic path (lua/deliver.lua) for
        kombu's publish, fenced by :meth:`_fence_check` instead of by the script."""
        if reason not in self._off_atomic:
            self._off_atomic.add(reason)
            logger.info(
                "delayq: %s leave the atomic path (deliver.lua) and are published through kombu, "
                "fenced by their lease (see docs/guarantees.md)",
                reason,
            )

    def _failed(self, job: ClaimedJob, envelope: Envelope | None, exc: object) -> object:
        """A publish failed for a reason that may pass: ``_RETRY`` after the lease, or
        ``_BURIED`` once the job has had PUBLISH_ATTEMPTS claims."""
        self.stats.publish_errors += 1
        if job.tries >= PUBLISH_ATTEMPTS:
            self._bury(job, f"publish failed {job.tries} times, last: {exc!r}", envelope)
            return _BURIED
        logger.warning(
            "delayq: publishing %s (%s) failed (attempt %d of %d): %r; retried after its lease (%.0f s)",
            job.id,
            envelope.task if envelope else "?",
            job.tries,
            PUBLISH_ATTEMPTS,
            exc,
            self.config.reclaim_ttl,
        )
        return _RETRY

    # -- one script that publishes and acks (the broker is the store's Redis) ------------------

    def _wire_channel(self, producer: Any) -> Any:
        """The kombu Redis channel when its server and database are the store's, else None.

        Then :meth:`_deliver` pushes the messages itself (``lua/deliver.lua``), each with the
        removal of its job, in one atomic step; otherwise they go through kombu's batch.
        """
        if not self.config.atomic_publish or not isinstance(self.store.client, redis.Redis):
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
                same = self._is_store_server(channel)
                self._same_server[channel] = same
        except Exception as exc:  # broker unreachable: the kombu path reports it per job
            logger.debug("delayq: cannot tell whether the broker is the store's Redis: %r", exc)
            return None
        return channel if same else None

    def _is_store_server(self, channel: Any) -> bool:
        """Same server (``run_id``), same database and same user: then the store's connection
        may push into the broker's queues. A user that may not run ``INFO`` answers False."""
        store = self.store.client
        with channel.conn_or_acquire() as client:
            broker_kw = client.connection_pool.connection_kwargs
            store_kw = store.connection_pool.connection_kwargs
            broker_db, store_db = int(broker_kw.get("db") or 0), int(store_kw.get("db") or 0)
            if broker_db != store_db or broker_kw.get("username") != store_kw.get("username"):
                return False
            try:
                same = bool(client.info("server").get("run_id") == store.info("server").get("run_id"))
            except redis.ResponseError:  # INFO refused (ACL): assume not, and do not ask again
                return False
        if same:
            logger.info(
                "delayq: the broker is the store's Redis (db %d): each due job is pushed into its "
                "queue and removed in one script",
                store_db,
            )
        return same

    def _templates_for(self, channel: Any, producer: Any) -> WireTemplates | None:
        """The message templates of ``channel`` (kept across passes while it stays the same)."""
        if channel is None:
            return None
        templates = self._templates
        if templates is None or templates.channel is not channel:
            templates = self._templates = WireTemplates(channel, producer, self._direct_args)
        templates.producer = producer
        return templates

    def _declare(self, producer: Any, queue: Any) -> None:
        """Declare a kombu queue once per pass, as ``send_task_message`` would before publishing
        (it would on every publish, and kombu binds (copies) the queue each time before finding
        it already declared: half the cost of a publish)."""
        if queue.name not in self._declared:
            if not isinstance(queue, Broadcast):
                producer.maybe_declare(queue)
            self._declared.add(queue.name)

    def _deliver(self, wired: dict[int, list[tuple[ClaimedJob, str, str, str]]]) -> list[int]:
        """Push and ack the built messages (one script call per shard chunk); return the due
        times of those pushed."""
        items = {shard: [(job.id, key, body) for job, _, key, body in jobs] for shard, jobs in wired.items()}
        if not any(items.values()):
            return []
        try:
            results = self.store.deliver(self.token, items)
        except redis.RedisError as exc:
            # Push and removal are one step: each job is either in its queue and gone from the
            # store, or still stored under its lease and delivered again when that expires.
            self.stats.publish_errors += 1
            logger.error(
                "delayq: pushing %d message(s) to the broker (the store's Redis) failed: %r; "
                "those not pushed are delivered again after their lease (%.0f s)",
                sum(len(v) for v in items.values()),
                exc,
                self.config.reclaim_ttl,
            )
            return []
        delivered: list[int] = []
        stale = full = 0
        for jobs in wired.values():
            for job, task, key, _ in jobs:
                result = results[job.id]
                if result == 1:
                    delivered.append(job.due_ms)
                elif result == 0:
                    stale += 1
                elif isinstance(result, str) and OOM_REPLY in result:
                    full += 1  # (6.2: "@user_script: 1: -OOM command not allowed ...")
                elif str(result).startswith(SERVER_BUSY_REPLIES):
                    self.stats.publish_errors += 1
                    logger.error(
                        "delayq: the broker refused %s (%s): %s; it stays stored and is retried after "
                        "its lease (%.0f s)",
                        job.id,
                        task,
                        result,
                        self.config.reclaim_ttl,
                    )
                elif str(result).startswith("WRONGTYPE"):
                    reason = f"publish failed: queue key {key!r} is not a list: {result}"
                    self._bury(job, reason, _decoded(job))
                else:
                    self._failed(job, _decoded(job), f"LPUSH {key!r}: {result}")
        self.stats.acked += len(delivered)
        if full:
            self.stats.publish_errors += full
            logger.error(
                "delayq: the broker (the store's Redis) is over its maxmemory: %d message(s) not "
                "pushed; they stay stored and are retried after their lease (%.0f s). A Celery "
                "worker cannot run on a full Redis broker: raise maxmemory or free memory",
                full,
                self.config.reclaim_ttl,
            )
        if stale:
            self.stats.stale_acks += stale
            logger.warning(
                "delayq: %d claimed job(s) were no longer leased to this beat when pushed (lease "
                "expired and re-claimed, or cancelled/replaced meanwhile); not published by this beat",
                stale,
            )
        return delivered

    def _can_publish_direct(self, producer: Any) -> bool:
        """True when nothing would notice Celery's ``send_task_message`` being skipped.

        That is: no receiver of ``before_task_publish``/``after_task_publish``/
        ``task_sent``, no task-sent events, and a transport with kombu publish
        batches (Redis). Then each message is handed to kombu's ``Producer.publish``
        with the arguments :meth:`_direct_args` works out (exactly the same message), or,
        when the broker is the store's Redis, built by :func:`wire_message` and pushed by
        :meth:`_deliver`.
        """
        if self.app.conf.task_send_sent_event:
            return False
        if any(sig.receivers for sig in (before_task_publish, after_task_publish, task_sent)):
            return False
        return self._transport_batches(producer)

    @staticmethod
    def _transport_batches(producer: Any) -> bool:
        """Whether the producer's transport has kombu publish batches (Redis: the publishes
        are buffered and sent when the batch is flushed)."""
        try:
            channel = producer.channel
        except Exception:  # broker unreachable: the normal path reports it per job
            return False
        return bool(getattr(channel, "create_publish_batch", None)) and getattr(
            channel, "supports_batch_publish", True
        )

    def _publish_conf(self) -> dict[str, Any]:
        """The settings :meth:`_direct_args` reads, looked up once per pass."""
        conf = self.app.conf
        names = ("task_compression", "task_default_delivery_mode", "task_default_routing_key")
        return {name: conf[name] for name in (*names, "task_serializer")}

    def _direct_args(self, producer: Any, envelope: Envelope, due_ms: int) -> dict[str, Any]:
        """``send_task_message``'s routing, without the signal machinery: the keyword
        arguments of the ``Producer.publish`` call it would make."""
        amqp, conf = self.app.amqp, self._conf
        headers = dict(envelope.headers)
        headers[DUE_HEADER] = due_ms / 1000.0
        if self.config.publish_eta:
            headers["eta"] = due_iso(due_ms)
        route = dict(envelope.route)
        extra = route.pop("headers", None)
        if extra:
            headers.update(extra)
        qname = queue = route.pop("queue", None)
        exchange = route.pop("exchange", None)
        routing_key = route.pop("routing_key", None)
        exchange_type = route.pop("exchange_type", None)
        delivery_mode = route.pop("delivery_mode", None)
        compression = route.pop("compression", None) or conf["task_compression"]
        declare = route.pop("declare", None)
        for name in ("retry", "retry_policy", "serializer", "timeout", "confirm_timeout", "event_dispatcher"):
            route.pop(name, None)
        if envelope.expires_ms is not None:
            route["expiration"] = max(0.0, (envelope.expires_ms - self.server_now_ms()) / 1000.0)
        if queue is None and exchange is None:
            queue = amqp.default_queue
        if queue is not None:
            if isinstance(queue, str):
                queue = amqp.queues[queue]
            qname = queue.name
            if declare is None:
                self._declare(producer, queue)
                declare = []
        if delivery_mode is None:
            delivery_mode = getattr(getattr(queue, "exchange", None), "delivery_mode", None)
            delivery_mode = delivery_mode or conf["task_default_delivery_mode"]
        if exchange_type is None:
            exchange_type = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
        if (not exchange or not routing_key) and exchange_type == "direct":
            exchange, routing_key = "", qname
        elif exchange is None:
            exchange = queue.exchange.name or amqp.default_exchange
            routing_key = routing_key or queue.routing_key or conf["task_default_routing_key"]
        properties = dict(envelope.props)
        properties.update(route)
        return dict(
            body=envelope.body,
            exchange=exchange,
            routing_key=routing_key,
            serializer=conf["task_serializer"],
            compression=compression,
            retry=False,
            delivery_mode=delivery_mode,
            declare=declare,
            headers=headers,
            content_type=envelope.content_type,
            content_encoding=envelope.content_encoding,
            **properties,
        )

    def _declare_once(self, producer: Any, envelope: Envelope) -> Envelope:
        """Declare the job's queue once per pass (:meth:`_declare`) and publish with
        ``declare=[]``. Raises KeyError for a queue the app does not know.
        """
        qname = envelope.route.get("queue")
        if not isinstance(qname, str) or "declare" in envelope.route:
            return envelope
        if qname not in self._declared:
            self._declare(producer, self.app.amqp.queues[qname])
        return replace(envelope, route={**envelope.route, "declare": []})

    def _fire_points(
        self,
        producer: Any,
        errors: tuple[type[BaseException], ...],
        points: list[tuple[int, ClaimedJob, Envelope]],
        sent: list[int],
        buffering: bool = False,
    ) -> list[ScriptCall]:
        """Publish due schedule points (per their missed-run policy); return the fire calls that
        ack them and advance each schedule (run once the publishes reached the broker)."""
        from .rules import rule_from_json
        from .schedules import Schedules, plan_point

        if self._schedules is None:
            self._schedules = Schedules(self.app)
        keys = self.store.keys
        with self.store.client.pipeline(transaction=False) as pipe:
            for shard, _, envelope in points:
                assert envelope.schedule is not None
                pipe.hget(keys.shard(shard).schedules, envelope.schedule[0])
            definitions = pipe.execute()
        calls: list[ScriptCall] = []
        for (shard, job, envelope), raw in zip(points, definitions, strict=True):
            assert envelope.schedule is not None
            name, at_ms = envelope.schedule
            published = ""
            next_id, next_due, next_envelope = "", 0, ""
            try:
                # A definition holds the arguments as JSON values, not as the envelope's text:
                # twice the envelope's bound leaves room for that.
                limit = 2 * self.config.max_payload + MAX_SMALL
                definition = load_json(raw, f"definition of schedule {name!r}", dict, limit) if raw else None
            except CorruptData as exc:
                # Nothing to plan from: the point goes to the dead letters with the reason, and
                # the schedule stays stopped until it is stored again (upsert, or the beat's sync).
                self.stats.corrupt["definition"] += 1
                self._bury(job, f"schedule stopped: {exc}", envelope)
                continue
            if definition is not None and definition.get("enabled"):
                now_ms = int(self.server_now_ms())
                try:
                    rule = rule_from_json(definition["rule"])
                    publish_it, nxt = plan_point(
                        rule,
                        at_ms,
                        now_ms,
                        definition["missed"],
                        int(definition["max_missed"]),
                        int(float(definition["grace"]) * 1000),
                    )
                except Exception as exc:  # a definition that no longer reads: say so, stop it
                    logger.error("delayq: schedule %r cannot compute its next point: %r", name, exc)
                    publish_it, nxt = True, None
                if not publish_it:
                    logger.info("delayq: schedule %r skipped its point %s (missed-run policy)", name, job.id)
                else:
                    if self.wire:
                        self._leaves_atomic("schedule points")
                    outcome = self._try_publish(producer, errors, job, envelope, buffering=buffering)
                    if outcome is _OUTAGE:
                        break
                    if outcome is _BURIED:
                        # The point is in the dead letters; the schedule goes on from now.
                        try:
                            self._schedules.rearm(name)
                        except Exception as exc:
                            logger.error(
                                "delayq: schedule %r has no next run: its point was dead-lettered and "
                                "a new one cannot be built here: %r",
                                name,
                                exc,
                            )
                        continue
                    if outcome is not _SENT:
                        continue  # retried after its lease
                    published = job.id
                    sent.append(at_ms)
                if nxt is not None:
                    try:
                        next_id, next_envelope = self._schedules.envelope_for(definition, nxt)
                        next_due = nxt
                    except Exception as exc:  # a definition that no longer builds: say so, stop it
                        logger.error("delayq: schedule %r cannot build its next point: %r", name, exc)
            calls.append(
                ScriptCall(
                    SCRIPTS["fire"],
                    keys.shard(shard).core,
                    [
                        self.token,
                        job.id,
                        name,
                        at_ms,
                        published,
                        next_id,
                        next_due,
                        next_envelope,
                        keys.wake_channel,
                        shard,
                    ],
                )
            )
        return calls

    def _broker_errors(self, producer: Any) -> tuple[type[BaseException], ...]:
        if self._connection_errors is None:
            conn = producer.connection
            errors = tuple(conn.connection_errors) + tuple(getattr(conn, "recoverable_connection_errors", ()))
            # kombu's Redis transport counts KeyError as a connection error, but
            # Celery's QueueNotFound (a queue this app does not know) is a KeyError:
            # that job can never be published here, so it must be buried, not retried.
            self._connection_errors = tuple(e for e in errors if e is not KeyError)
            from kombu.exceptions import OperationalError

            self._connection_errors += (OperationalError,)
        return self._connection_errors

    def _bury(self, job: ClaimedJob, reason: str, envelope: Envelope | None) -> None:
        record = {
            "reason": reason,
            "task": envelope.task if envelope else None,
            "due": job.due_ms,
            "tries": job.tries,
            "dead_at": int(self.server_now_ms()),
            "beat": self.token,
            "envelope": job.envelope,
        }
        self._buried.add(job.id)
        if self.store.bury(self.token, job.id, record):
            self.stats.dead_lettered += 1
            logger.error("delayq: job %s moved to dead letters: %s", job.id, reason)

    # -- lateness, heartbeat, metrics ---------------------------------------------------------

    def _next_chore(self) -> float:
        """Monotonic time of the next :meth:`chores` work: the next heartbeat or stall sweep,
        or the next lateness flush when something waits to be flushed."""
        at = min(self._heartbeat_at, self._stall_sweep_at)
        if self.lateness.pending:
            at = min(at, self._flushed_at + LATENESS_FLUSH_EVERY)
        return at

    def chores(self, force: bool = False) -> None:
        """Flush the lateness histogram (at most every LATENESS_FLUSH_EVERY s), write the
        heartbeat (every HEARTBEAT_EVERY s) and, every PRUNE_EVERY s, remove the heartbeats
        of beats not seen for BEAT_FORGET_MS; ``force``: all of it now. Every
        STALL_SWEEP_EVERY s (not forced), one step of the sweep for stalled schedules.

        Never raises: delivery must not stop because of them. On a Redis error the
        observations are kept for the next flush, and one warning is logged until one works.
        """
        now = time.monotonic()
        if self.lateness.pending and (force or now - self._flushed_at >= LATENESS_FLUSH_EVERY):
            self._flushed_at = now
            try:
                self.lateness.flush(self.store.client, self._lateness_key)
            except Exception as exc:
                if not self._flush_failing:
                    logger.warning(
                        "delayq: cannot write the lateness histogram to Redis (%r); the counts are "
                        "kept and written at the next try",
                        exc,
                    )
                self._flush_failing = True
            else:
                self._flush_failing = False
        if force or now >= self._heartbeat_at:
            self._heartbeat_at = now + HEARTBEAT_EVERY
            prune = force or now >= self._prune_at
            try:
                self._heartbeat(prune)
            except Exception as exc:
                if not self._heartbeat_failing:
                    logger.warning("delayq: cannot write this beat's heartbeat to Redis (%r)", exc)
                self._heartbeat_failing = True
            else:
                self._heartbeat_failing = False
                if prune:
                    self._prune_at = now + PRUNE_EVERY
        if now >= self._stall_sweep_at:
            self._stall_sweep_at = now + STALL_SWEEP_EVERY
            self.sweep_stalls()

    def sweep_stalls(self) -> int:
        """One step of the sweep for stalled schedules (every STALL_SWEEP_EVERY s, from
        :meth:`chores`): how many it re-armed. Never raises."""
        try:
            if self._stalls is None:
                from .schedules import Schedules, StallSweep

                self._stalls = StallSweep(Schedules(self.app))
            repaired = len(self._stalls.step(int(self.server_now_ms())))
        except Exception as exc:
            logger.warning("delayq: the sweep for stalled schedules failed (%r); tried again in %.0f s",
                           exc, STALL_SWEEP_EVERY)
            return 0
        self.stats.stalls_repaired += repaired
        return repaired

    def heartbeat(self) -> dict[str, Any]:
        """This beat's entry in ``<prefix>:beats`` (the value is its JSON)."""
        stats = self.stats
        self._seen_ms = max(self._seen_ms, int(self.server_now_ms()))
        return {
            "token": self.token,
            "host": self.host,
            "pid": os.getpid(),
            "started_ms": self.started_ms,
            "seen_ms": self._seen_ms,
            "passes": stats.passes,
            "published": stats.published,
            "dead_lettered": stats.dead_lettered,
            "errors": stats.publish_errors + stats.errors,
        }

    def _heartbeat(self, prune: bool) -> None:
        """One pipeline: HSET this beat's entry (and HGETALL the hash when ``prune``); then
        HDEL the entries not refreshed for BEAT_FORGET_MS, if any."""
        entry = self.heartbeat()
        key, client = self.store.keys.beats, self.store.client
        with client.pipeline(transaction=False) as pipe:
            pipe.hset(key, self.token, json.dumps(entry, separators=(",", ":")))
            if prune:
                pipe.hgetall(key)
            replies = pipe.execute()
        if prune:
            oldest = entry["seen_ms"] - BEAT_FORGET_MS
            gone = [token for token, raw in replies[1].items() if _seen_ms(raw) < oldest]
            if gone:
                client.hdel(key, *gone)
                logger.info("delayq: forgot %d beat(s) not seen for %d min: %s", len(gone),
                            BEAT_FORGET_MS // 60_000, ", ".join(gone))

    def serve_metrics(self, port: int | None = None, addr: str | None = None) -> int:
        """Start the Prometheus endpoint (``/metrics``) of this dispatcher on ``port``/``addr``
        (default ``delayq_metrics_port``/``delayq_metrics_addr``); returns the port.

        Raises OSError when the port cannot be bound. See :mod:`.metrics`."""
        from .metrics import MetricsServer

        if self.metrics is not None:
            return self.metrics.port
        port = self.config.metrics_port if port is None else port
        if port is None:
            raise ValueError(f"no port: set {setting_name(self.app, 'delayq_metrics_port')}")
        self.metrics = MetricsServer(self, port, addr or self.config.metrics_addr)
        return self.metrics.port

    # -- sleeping ----------------------------------------------------------------------------

    def _subscribe(self) -> Any:
        if self._pubsub is None:
            pubsub = self.store.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(self.store.keys.wake_channel)
            self._pubsub = pubsub
            # Anything enqueued before the subscription took effect: look at every shard.
            self._next = [None] * self.config.shards
        return self._pubsub

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, waking early when a job becomes due sooner."""
        deadline = time.monotonic() + timeout
        pubsub = self._subscribe()
        while True:
            now = time.monotonic()
            remaining = min(deadline - now, self.seconds_until_due())
            if remaining <= 0:
                return
            chore_in = self._next_chore() - now
            if chore_in <= 0:
                self.chores()
                continue
            try:
                message = pubsub.get_message(timeout=min(remaining, chore_in))
            except REDIS_ERRORS:
                self._drop_pubsub()
                raise
            if message is None:
                continue
            self._on_wake(message.get("data"))

    def _on_wake(self, data: Any) -> None:
        try:
            shard_s, due_s = str(data).split(":", 1)
            shard, due = int(shard_s), float(due_s)
        except ValueError:
            return
        if 0 <= shard < len(self._next):
            current = self._next[shard]
            if current is None or due < current:
                self._next[shard] = due
                self.stats.wakeups += 1

    def _drop_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                self._pubsub.close()
        self._pubsub = None
        self._next = [None] * self.config.shards

    def close(self) -> None:
        """Drop the wake subscription (the Scheduler does on a Redis error; a later pass
        subscribes again). See :meth:`stop` for the end of the beat."""
        self._drop_pubsub()

    def stop(self) -> None:
        """The beat is stopping: flush the lateness histogram, remove this beat's heartbeat,
        stop the metrics endpoint, drop the subscription. Never raises for Redis. Logs the
        fence's residual window (see :meth:`fence_window`) when anything went through kombu."""
        count, p99, most = self.fence_window()
        if count:
            logger.info(
                "delayq: fence: residual window (last lease check -> publish sent or batch flushed) "
                "over the last %d publishes/flushes: p99 %.1f ms, max %.1f ms; %d renewal(s), %d "
                "job(s) not published for a lost lease",
                count,
                p99,
                most,
                self.stats.renewals,
                self.stats.fenced,
            )
            self.fence_windows.clear()  # logged once, however often stop() is called
        if self.lateness.pending:
            try:
                self.lateness.flush(self.store.client, self._lateness_key)
            except Exception as exc:
                logger.warning("delayq: lateness of the last %.0f s not written: %r",
                               LATENESS_FLUSH_EVERY, exc)
        try:
            self.store.client.hdel(self.store.keys.beats, self.token)
        except Exception as exc:
            logger.warning("delayq: cannot remove this beat's heartbeat (%r); it is forgotten "
                           "after %d min", exc, BEAT_FORGET_MS // 60_000)
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self.close()



def _seen_ms(raw: str) -> float:
    """``seen_ms`` of a heartbeat entry; 0 (forget it) for one that does not read."""
    try:
        return float(load_json(raw, "heartbeat", dict, MAX_SMALL)["seen_ms"])
    except (ValueError, KeyError, TypeError):
        return 0.0


def _why_not_wired(channel: Any, kwargs: dict[str, Any]) -> str:
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
