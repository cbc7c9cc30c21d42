"""The claim loop: claim due jobs, publish them into their Celery queues, ack them.

One :class:`Dispatcher` runs inside each beat (see :mod:`.scheduler`); any
number of them may share one store with no leader. Each pass claims a bounded
batch from the shards that may have due jobs, publishes every claimed job as its
disposition says (:mod:`.dispositions`; :mod:`.publish`, fenced by :mod:`.fence`), and only
then acks it. A beat that dies between claim and ack loses nothing: its leases expire after
``delayq_reclaim_ttl`` and another beat delivers the batch again (so a crash can duplicate at
most the batch it held).

Flow control: before publishing, the gated jobs of a pass go to the gate, all at once
(:meth:`.publish.Publishing.gate_pass`). A released one is published through kombu, then
*held* for its worker (``Store.hold``) instead of acked: its key's slot stays taken until the
worker's :mod:`..flow.slots` gives it back. Parked and deferred ones stay stored, out of the pass.

Between passes the dispatcher sleeps until the earliest due time it knows of,
on a pub/sub subscription: the enqueue script publishes on the wake channel
when it stores a job earlier than the shard's wake marker, which wakes every
beat at once. Every ``delayq_max_sleep`` seconds the safety poll reads every shard's wake
marker with the server's clock (one round trip) and claims the shards whose marker is due,
missing or unreadable (:meth:`Dispatcher._safety_poll`); after any lost subscription all
shards are claimed.

Besides delivering, a dispatcher keeps things that cost no Redis call per job
(:meth:`Dispatcher.chores`, run after a pass and from the sleep): the due -> publish
lateness of what it published (:class:`..store.lateness.PublishLateness`), its heartbeat
(:mod:`.heartbeat`), and every ``STALL_SWEEP_EVERY`` s one bounded step of the sweep that
finds and re-arms stalled schedules (:class:`.upkeep.StallSweep`), and every
``BATCH_SWEEP_EVERY`` s the sweep of expired batches (:meth:`.Store.sweep_batches`). Schedule points are
fired by :mod:`.firing`. The clocks are injected: ``clock`` (monotonic s) and ``wall`` (s).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import os
import random
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from celery import states
from celery.exceptions import NotRegistered
from kombu.exceptions import BatchPublishError

from ..config import setting_name
from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER
from ..schedules.api import Schedules
from ..store.beats import is_acl_refusal
from ..store.connection import REDIS_ERRORS, error_text, redis_error_kind
from ..store.delivery import ClaimedJob, ClaimResult, PushResult
from ..store.envelope import Envelope, decode_envelope
from ..store.facade import Store, get_store
from ..store.lateness import LATENESS_FLUSH_EVERY, Histogram, PublishLateness
from ..store.lua_formats import parse_wake
from .backoff import Backoff
from .dispositions import Disposition, PassResult, PassState, disposition, due_in_range
from .fence import FENCE_FRACTION, Fence, LeaseLost
from .firing import ScheduleFiring
from .heartbeat import BEAT_FORGET_MS, HEARTBEAT_EVERY, PRUNE_EVERY, Heartbeat
from .publish import PUBLISH_ATTEMPTS, Outcome, Publishing
from .stats import CLAIM_SIZE_BOUNDS, DispatchStats
from .upkeep import StallSweep

__all__ = [
    "BEAT_FORGET_MS",
    "FENCE_FRACTION",
    "HEARTBEAT_EVERY",
    "LATENESS_FLUSH_EVERY",
    "PRUNE_EVERY",
    "PUBLISH_ATTEMPTS",
    "DispatchStats",
    "Dispatcher",
]

logger = logging.getLogger(__name__)

#: Longest back-off (s) between claims while the broker is unreachable.
BROKER_BACKOFF_MAX = 5.0

#: Broker commands one kombu publish batch may buffer: more than a pass ever
#: publishes, so the batch is sent once, when it closes, and acks follow it.
PUBLISH_BATCH_MAX = 1_000_000

#: Seconds between two steps of the sweep for stalled schedules (see schedule_upkeep.StallSweep).
STALL_SWEEP_EVERY = 10.0
#: Seconds between two sweeps of expired batches (:meth:`.Store.sweep_batches`): a finished
#: batch's hash expires by itself; its id and its key's record go at the next sweep.
BATCH_SWEEP_EVERY = 60.0

#: The safety poll claims a shard whose wake marker is due within this (ms) of the server's
#: now: the clocks of a cluster's nodes differ by a little.
MARKER_MARGIN_MS = 1000.0

#: How soon (ms) a beat claims again the shards of a cluster node that failed while others
#: answered (a primary failing over).
CLUSTER_RETRY_MS = 1000.0

#: The line that says some shards could not be claimed is logged at most this often (s); the
#: passes between are counted in the next one.
CLAIM_FAILURE_LOG_EVERY = 10.0

#: While the wake subscription cannot be made (its node is down, a primary failing over), the
#: beat tries again, and runs the safety poll, this often (s).
RESUBSCRIBE_EVERY = 1.0


class Dispatcher:
    """Claims, publishes and acks due jobs of one app; sleeps until the next one."""

    def __init__(
        self,
        app: Any,
        store: Store | None = None,
        keep_lateness: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.app = app
        self.store = store or get_store(app)
        self.config = self.store.config
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}".replace("|", "_")
        self.stats = DispatchStats()
        self.clock = clock
        self.wall = wall
        #: How :meth:`wait` sleeps while it has no wake subscription (a test gives a sleep
        #: that moves its ``clock`` instead).
        self.sleep = sleep
        self._keep_lateness = keep_lateness
        shards = self.config.shards
        # Earliest time (server ms) each shard may have something due; None: look now.
        self._next: list[float | None] = [None] * shards
        self._offset_ms = 0.0  # server clock - local clock, measured at each claim
        self._last_full = 0.0
        self._markers_failed = False  # the last safety poll could not read the markers (logged)
        self._pubsub: Any = None
        self._subscribe_at = 0.0  # clock time of the next attempt to subscribe
        self._subscription_failed = False  # since the last subscription made (logged once)
        self._claim_failures = 0  # passes with shards not claimed, since the last line logged
        self._claim_logged_at = -CLAIM_FAILURE_LOG_EVERY  # clock time of that line
        self.fence = Fence(self.store, self.token, self.stats, clock)
        self.publishing = Publishing(app, self.store, self.token, self.stats, self.fence, self.server_now_ms)
        self.firing = ScheduleFiring(app, self.store, self.token, self.stats, self.server_now_ms)
        #: back-off from claiming while the broker is unreachable (0.5 s, doubling up to
        #: BROKER_BACKOFF_MAX or delayq_max_sleep)
        self.broker_backoff = Backoff(0.5, min(BROKER_BACKOFF_MAX, self.config.max_sleep), clock)
        self.publish_lateness = PublishLateness(self.store, self.config.prefix, clock)
        self.beat = Heartbeat(self.store, self.token, self.stats, self.server_now_ms, clock, wall)
        self._stalls: StallSweep | None = None  # built at its first step
        self._stall_sweep_at = 0.0  # clock time: the first chores run one
        self._batch_sweep_at = 0.0  # the same, for the sweep of expired batches

    # -- what the beat shows --------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self.beat.host

    @property
    def started_ms(self) -> int:
        return self.beat.started_ms

    @property
    def pushing(self) -> bool:
        """Whether the last pass took the push path (messages pushed by push_claimed.lua)."""
        return self.publishing.pushing

    @property
    def lateness(self) -> Histogram:
        """Due -> publish lateness not yet flushed to Redis."""
        return self.publish_lateness.pending

    @property
    def lateness_seen(self) -> Histogram:
        """Due -> publish lateness since the start."""
        return self.publish_lateness.seen

    def fence_window(self) -> tuple[int, float, float]:
        """``(count, p99 ms, max ms)`` of the fence's residual windows kept (the last
        FENCE_WINDOWS_KEPT): the time from the last lease check to the end of a publish or
        batch flush."""
        return self.fence.window()

    @property
    def subscription(self) -> Any:
        """The wake channel's pub/sub connection (None before the first pass or after
        :meth:`close`)."""
        return self._pubsub

    def heartbeat(self) -> dict[str, Any]:
        """This beat's entry in ``<prefix>:beats`` (the value is its JSON)."""
        return self.beat.entry()

    # -- clock -------------------------------------------------------------------------------

    def server_now_ms(self) -> float:
        return self.wall() * 1000.0 + self._offset_ms

    # -- one pass ----------------------------------------------------------------------------

    def _poll_every(self) -> float:
        """Seconds between two safety polls: ``delayq_max_sleep``, or ``RESUBSCRIBE_EVERY``
        while there is no wake subscription (no wake message can say what became due)."""
        if self._pubsub is None:
            return min(self.config.max_sleep, RESUBSCRIBE_EVERY)
        return self.config.max_sleep

    def _shards_to_claim(self) -> list[int]:
        if self.clock() - self._last_full >= self._poll_every():
            self._last_full = self.clock()
            self._safety_poll()
        now = self.server_now_ms()
        shards = [i for i, nxt in enumerate(self._next) if nxt is None or nxt <= now]
        random.shuffle(shards)  # beats start on different shards
        return shards

    def _safety_poll(self) -> None:
        """Every ``delayq_max_sleep`` s: learn what no wake message said (a lost message, a
        job another beat leased, a slot expiry) from the shards' wake markers, read with the
        server's clock in one round trip (:meth:`.Store.wake_markers`).

        The scripts keep each marker no later than its shard's earliest score (see
        ``lua/includes/wake.lua``), so a shard whose marker is in the future has nothing due
        before it: it is claimed then. A shard whose marker is due (within
        ``MARKER_MARGIN_MS``), missing or unreadable is claimed now, and the claim sets its
        marker again. When the markers cannot be read, every shard is claimed (that claim
        reports the error)."""
        if all(nxt is None for nxt in self._next):
            return  # every shard is claimed anyway
        sent = self.wall()
        try:
            now_ms, markers = self.store.wake_markers()
        except REDIS_ERRORS as exc:
            log = logger.debug if self._markers_failed else logger.warning
            self._markers_failed = True
            hint = " (the Redis ACL user needs +mget: see docs/security.md)" if is_acl_refusal(exc) else ""
            log(
                "delayq: the shards' wake markers could not be read (%s); every shard is claimed instead%s",
                error_text(exc),
                hint,
            )
            self._next = [None] * self.config.shards
            return
        self._markers_failed = False
        received = self.wall()
        self._offset_ms = now_ms - (sent + received) * 500.0
        horizon = now_ms + MARKER_MARGIN_MS
        for shard, marker in enumerate(markers):
            current = self._next[shard]
            if marker is None or marker <= horizon:
                self._next[shard] = None
            elif current is not None:
                self._next[shard] = min(current, marker)

    def run_once(self) -> float:
        """Claim, publish and ack one batch from every shard that may have due jobs.

        Returns the seconds until the next known due time (0 when a batch came
        back full, so the caller should pass again at once).
        """
        self._subscribe()  # when it fails, the safety poll stands in for it
        if self.broker_backoff.remaining() <= 0:
            shards = self._shards_to_claim()
            if shards:
                self._pass(shards)
        # else the broker was unreachable: wait out the back-off
        if self.clock() >= self._next_chore():
            self.chores()
        return self.seconds_until_due()

    def _broker_state(self, outage: bool, published: bool) -> None:
        """After a pass: back off from claiming while the broker is unreachable, so a beat does
        not claim, fail and log at every due job; reset once something was published."""
        if outage:
            delay = self.broker_backoff.fail()
            logger.warning("delayq: broker unreachable; next claim in %.1f s", delay)
        elif published and self.broker_backoff.reset():
            logger.warning("delayq: broker reachable again; publishing")

    def seconds_until_due(self) -> float:
        backoff = self.broker_backoff.remaining()
        if backoff > 0:
            return min(backoff, self.config.max_sleep)
        now = self.server_now_ms()
        known = [n for n in self._next if n is not None]
        if len(known) < len(self._next):
            return 0.0
        earliest = min(known) if known else now + self.config.max_sleep * 1000
        wait = (earliest - now) / 1000.0
        until_full = self._last_full + self._poll_every() - self.clock()
        return max(0.0, min(wait, until_full, self.config.max_sleep))

    def _pass(self, shards: list[int]) -> None:
        sent = self.wall()
        # On a cluster, a node that is down (failing over) must not hold up the other nodes'
        # shards: their claims stand and are delivered now (see below). The same for a shard
        # whose claim script fails (a key of the wrong type, a full server): it must not wedge
        # the others.
        failed: list[Exception] = []
        claim_sent = self.clock()  # the leases expire at the earliest at claim_sent + TTL
        results = self._claim(shards, failed)
        self.fence.claimed(claim_sent)
        received = self.wall()
        self.stats.passes += 1
        full = False
        claimed: list[tuple[int, ClaimedJob]] = []
        sizes = self.stats.claim_sizes
        for result in results:
            taken = len(result.jobs) + result.pushed
            if taken:
                sizes[bisect.bisect_left(CLAIM_SIZE_BOUNDS, taken)] += 1
            self._offset_ms = result.now_ms - (sent + received) * 500.0
            self._next[result.shard] = result.next_ms
            if result.next_ms is None:
                self._next[result.shard] = float("inf")
            if taken >= self.config.batch_size:
                full = True
                self._next[result.shard] = None
            claimed.extend((result.shard, job) for job in result.jobs)
            if result.parked:  # claimed and parked by the claim (lua/includes/gating.lua)
                self.stats.claimed += result.parked
                self.stats.gated["parked"] += result.parked
            if result.repaired:
                self.stats.corrupt["lease"] += result.repaired
                logger.error(
                    "delayq: shard %d held %d lease entr(ies) that do not read; the claim replaced "
                    "them (each job is delivered as if its lease had expired)",
                    result.shard,
                    result.repaired,
                )
        if claimed:
            self.stats.claimed += len(claimed)  # (what lua/push.lua delivered: _count_pushed)
            jobs: dict[int, list[str]] = defaultdict(list)
            for shard, job in claimed:
                jobs[shard].append(job.id)
            self.fence.start(jobs)
            misses = {
                (result.shard, name): job
                for result in results
                if result.misses
                for job in result.jobs
                if (name := result.misses.get(job.id))
            }
            self._settle(self.publish_claimed(claimed, misses))
            if full:
                logger.debug("delayq: a claimed batch was full; passing again at once")
        if failed:
            unreachable = all(redis_error_kind(exc) == "unreachable" for exc in failed)
            # On a cluster, a pass that tried only some shards and could not reach their node
            # says nothing of the other nodes (a primary failing over): no back-off for it.
            some_nodes = unreachable and self.store.is_cluster and len(shards) < self.config.shards
            if not results and not some_nodes:
                raise failed[0]  # no node answered: the tick backs off as for any outage
            # Some shards answered, or only one node's were tried (a cluster primary is failing
            # over, or one shard's claim failed): no back-off, the others' shards stay on time;
            # the failed shards are tried again each second, after a fresh look at the slot map.
            if unreachable:
                self.store.refresh_slots()
            answered = {result.shard for result in results}
            # At the server's next whole second (within CLUSTER_RETRY_MS): the shards that failed
            # at different times are tried again together, in one pass (not one pass each).
            retry_at = (self.server_now_ms() // CLUSTER_RETRY_MS + 1) * CLUSTER_RETRY_MS
            missed = [shard for shard in shards if shard not in answered]
            for shard in missed:
                self._next[shard] = retry_at
            for exc in failed:
                self.stats.redis_errors[redis_error_kind(exc)] += 1
            self._claim_failures += 1
            if self.clock() - self._claim_logged_at >= CLAIM_FAILURE_LOG_EVERY:
                logger.error(
                    "delayq: %d of %d shard(s) could not be claimed (%s); the other shards are claimed "
                    "as usual; those are tried again each second (%d pass(es) with shards not claimed "
                    "in the last %.0f s)",
                    len(missed),
                    len(shards),
                    error_text(failed[0]),
                    self._claim_failures,
                    CLAIM_FAILURE_LOG_EVERY,
                )
                self._claim_logged_at = self.clock()
                self._claim_failures = 0

    def _claim(self, shards: list[int], failed: list[Exception]) -> list[ClaimResult | PushResult]:
        """Claim ``shards``: with ``lua/push.lua`` when the push path pushes on claim (what it
        pushed itself is counted here), else with ``lua/claim.lua``. A shard whose push call was
        refused for memory (nothing written) is claimed with claim.lua in the same pass, which a
        full Redis runs."""
        space = self.publishing.probe() if self.config.push_on_claim else None
        # The claim gates the capped jobs it can (lua/includes/gating.lua); it parks those of a
        # full key unless a result backend can say whether a slot's task ended: then the gate
        # parks them, naming the slots to look up (Publishing._give_back).
        gating = self.publishing.ran.backend is None
        if space is None:
            return [*self.store.claim(shards, self.token, failed=failed, gating=gating)]
        args = [space, self.config.max_payload, GATE_HEADER, BATCH_DONE_HEADER]
        refused: list[tuple[int, Exception]] = []
        results: list[ClaimResult | PushResult] = []
        results.extend(self.store.push(shards, self.token, args, failed=refused, gating=gating))
        full = [shard for shard, exc in refused if redis_error_kind(exc) == "oom"]
        failed.extend(exc for shard, exc in refused if shard not in full)
        if full:
            results.extend(self.store.claim(full, self.token, failed=failed, gating=gating))
        self._count_pushed(results)
        return results

    def _count_pushed(self, results: list[ClaimResult | PushResult]) -> None:
        """Count what ``lua/push.lua`` pushed: claimed, published and acked in one step; its
        lateness; its queues declared once (as the beat declares those it pushes to)."""
        pushed = 0
        queues: set[str] = set()
        late: list[float] = []
        for result in results:
            if not result.pushed:
                continue
            pushed += result.pushed
            for ms, count in result.lateness:
                late.extend(itertools.repeat(float(ms), count))
            queues.update(queue for queue, _, _ in result.used)
        if not pushed:
            return
        stats = self.stats
        stats.claimed += pushed
        stats.published += pushed
        stats.acked += pushed
        stats.pushed_on_claim += pushed
        self.publish_lateness.record(late)
        if self._keep_lateness:
            room = self._keep_lateness - len(stats.lateness_ms)
            stats.lateness_ms.extend(late[: max(0, room)])
        self.publishing.declare_pushed(sorted(queues))
        self._broker_state(False, True)

    def _settle(self, result: PassResult) -> None:
        """The ack step, after the publish: fire the published schedule points, hold the
        published released gated jobs for their workers, ack the other published jobs."""
        self.firing.settle(result.fires)
        if result.holds:
            self._hold(result.holds)
        if result.acks:
            removed, stale = _count_stale(self.store.ack(self.token, result.acks), "", "acked")
            self.stats.acked += removed
            self.stats.stale_acks += stale

    def _hold(self, holds: dict[int, list[tuple[str, str]]]) -> None:
        """Hand the released gated jobs published in this pass to their workers: their lease
        becomes the "run" one, renewed by the worker until the task ends (lua/hold.lua). A job
        this beat no longer held (its lease expired, another beat claimed it: that beat's gate
        found it running and released it again on its one slot) is counted as a stale hold; a
        Redis error leaves the jobs leased to this beat, and they are delivered again after
        their lease on the same slot."""
        try:
            # With a result backend that can say a task finished, a held job whose worker has
            # not started it is looked at every slot TTL (a store restored from an older
            # snapshot forgets that it ran: docs/guarantees.md); without one, only when its
            # start TTL is over.
            check_ms = int(self.config.slot_ttl * 1000) if self.publishing.ran.backend is not None else 0
            held = self.store.hold(self.token, holds, int(self.config.start_ttl * 1000), check_ms)
        except REDIS_ERRORS as exc:
            self.stats.redis_errors[redis_error_kind(exc)] += 1
            logger.error(
                "delayq: %d published gated job(s) could not be handed to their workers (%s); "
                "they are delivered again after their lease (%.0f s), on the same slot",
                sum(len(v) for v in holds.values()),
                error_text(exc),
                self.config.reclaim_ttl,
            )
            return
        done, stale = _count_stale(held, "gated ", "held")
        self.stats.held += done
        self.stats.stale_holds += stale

    def publish_claimed(
        self,
        claimed: list[tuple[int, ClaimedJob]],
        misses: dict[tuple[int, str], ClaimedJob] | None = None,
    ) -> PassResult:
        """Publish each claimed job of this pass (``(shard, job)``) as its :func:`disposition`
        says; return what the ack step (:meth:`_settle`) does: the ids to ack by shard, the
        released gated jobs to hold, the fire calls of the published schedule points. The step
        between claim and ack: a test may wrap it to stall a beat there. ``misses``: the jobs
        ``lua/push.lua`` asked a template for, (shard, templates-hash field) -> job.

        On a Redis broker, kombu's publish batch builds and routes every message as
        usual and sends the final commands in one pipeline when the batch closes;
        nothing is acked unless that flush succeeded.
        """
        fence, publishing = self.fence, self.publishing
        claimed = self._bury_out_of_range(claimed)
        gated = publishing.gate_pass(claimed)
        if gated.skip:
            # The fence renews only what this pass may publish: a parked or deferred job's
            # lease is the gate's now, not lost.
            fence.start({shard: [i for i in ids if i not in gated.skip] for shard, ids in fence.jobs.items()})
        with self.app.producer_or_acquire() as producer:
            state = PassState(gated, publishing.begin(producer), misses or {})
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
                            publishing, publishing.kombu(), state.points, state.sent
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
                    "delayq: sending %d message(s) to the broker failed (%r; cause: %r); any that "
                    "reached it may run twice: they stay stored and are delivered again after their "
                    "lease (%.0f s)",
                    len(state.sent) + len(state.released),
                    exc,
                    exc.__cause__ or exc.__context__,
                    self.config.reclaim_ttl,
                )
                state.discard()
            if state.pusher is not None:
                state.sent.extend(state.pusher.push())
                if state.misses:
                    publishing.add_lua_templates(state.pusher.templates, state.misses)
        self._fence_report(state.pusher.to_push_ids() if state.pusher is not None else set())
        self._count_pass(state)
        return state.result()

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
            outcome = state.publisher.publish(shard, job, envelope)
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
        else:
            state.acks[shard].append(job.id)
            state.sent.append(job.due_ms)

    def _count_pass(self, state: PassState) -> None:
        """After a pass's publish: the broker's state, the published count, the slot wait of the
        released gated jobs and the publish lateness of the others."""
        self._broker_state(state.outage, bool(state.sent or state.acks or state.released))
        now = self.server_now_ms()
        self.stats.published += len(state.sent) + len(state.released)
        for due in state.released:  # not in the publish lateness: the gate held them back
            self.stats.slot_wait.observe(now - due)
        if state.sent:
            # bucketed once per job here; one pipeline per LATENESS_FLUSH_EVERY s (chores)
            self.publish_lateness.record(now - due for due in state.sent)
        if self._keep_lateness:
            room = self._keep_lateness - len(self.stats.lateness_ms)
            self.stats.lateness_ms.extend(now - due for due in state.sent[: max(0, room)])

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

    def _fence_report(self, to_push: set[str]) -> None:
        """Count and log what the fence kept from the broker in this pass."""
        # Lost jobs of the push path are push_claimed.lua's to drop (and count), not the fence's;
        # those this beat had sent before it found their lease lost were published.
        lost = self.fence.lost.difference(to_push)
        fenced = len(lost.difference(self.fence.sent_ids))
        early = len(lost.intersection(self.fence.sent_ids))
        if early:
            logger.warning(
                "delayq: fence: %d job(s) this beat published in this pass were found re-claimed by "
                "another beat afterwards (this beat was paused or slowed inside its publish): the other "
                "beat published them too, and workers with delayq_start_check on run only the "
                "copy that starts first",
                early,
            )
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
        if self.fence.overran:
            logger.warning(
                "delayq: fence: %d message(s) reached the broker after their lease may have expired "
                "(the publish or the batch flush took longer than the last %.0f%% of the lease, "
                "%.1f s); if another beat re-claimed them meanwhile they run twice",
                self.fence.overran,
                (1 - FENCE_FRACTION) * 100,
                self.config.reclaim_ttl,
            )

    # -- lateness, heartbeat, stalled schedules -----------------------------------------------

    def _next_chore(self) -> float:
        """Clock time of the next :meth:`chores` work: the next heartbeat or stall sweep,
        or the next lateness flush when something waits to be flushed."""
        sweeps = min(self._stall_sweep_at, self._batch_sweep_at)
        return min(self.beat.due_at, sweeps, self.publish_lateness.due_at())

    def chores(self, force: bool = False) -> None:
        """Flush the lateness histogram (at most every LATENESS_FLUSH_EVERY s), write the
        heartbeat (every HEARTBEAT_EVERY s) and, every PRUNE_EVERY s, remove the heartbeats
        of beats not seen for BEAT_FORGET_MS; ``force``: all of it now. Every
        STALL_SWEEP_EVERY s (not forced), one step of the sweep for stalled schedules; every
        BATCH_SWEEP_EVERY s, the sweep of expired batches.

        Never raises: delivery must not stop because of them. On a Redis error the
        observations are kept for the next flush, and one warning is logged until one works.
        """
        now = self.clock()
        self.publish_lateness.flush(force)
        self.beat.beat(force)
        if now >= self._stall_sweep_at:
            self._stall_sweep_at = now + STALL_SWEEP_EVERY
            self.sweep_stalls()
        if now >= self._batch_sweep_at:
            self._batch_sweep_at = now + BATCH_SWEEP_EVERY
            self.sweep_batches()

    def sweep_stalls(self) -> int:
        """One step of the sweep for stalled schedules (every STALL_SWEEP_EVERY s, from
        :meth:`chores`): how many it re-armed. Never raises."""
        try:
            if self._stalls is None:
                self._stalls = StallSweep(Schedules(self.app))
            repaired = len(self._stalls.step(int(self.server_now_ms())))
        except Exception as exc:
            logger.warning(
                "delayq: the sweep for stalled schedules failed (%r); tried again in %.0f s",
                exc,
                STALL_SWEEP_EVERY,
            )
            return 0
        self.stats.stalls_repaired += repaired
        return repaired

    def sweep_batches(self) -> int:
        """Remove what is left of the finished batches whose time passed (every
        BATCH_SWEEP_EVERY s, from :meth:`chores`): how many. Never raises."""
        try:
            return self.store.sweep_batches()
        except Exception as exc:
            logger.warning(
                "delayq: the sweep of expired batches failed (%r); tried again in %.0f s",
                exc,
                BATCH_SWEEP_EVERY,
            )
            return 0

    # -- sleeping ----------------------------------------------------------------------------

    def _subscribe(self) -> Any:
        """The wake subscription; made now when there is none and an attempt is due. None while
        it cannot be made: the beat claims on the safety poll, every ``RESUBSCRIBE_EVERY`` s,
        and tries again as often (after a failover, on the slot's new owner: see
        :meth:`.Store.wake_subscription`). A failed subscription never stops a claim."""
        if self._pubsub is not None or self.clock() < self._subscribe_at:
            return self._pubsub
        try:
            self._pubsub = self.store.wake_subscription()
        except REDIS_ERRORS as exc:
            self._subscription_lost(exc)
            return None
        if self._subscription_failed:
            self._subscription_failed = False
            logger.warning("delayq: wake subscription made again; claiming on wake messages")
        # Anything enqueued before the subscription took effect: look at every shard.
        self._next = [None] * self.config.shards
        return self._pubsub

    def _subscription_lost(self, exc: Exception) -> None:
        """The wake subscription failed (or could not be made): claim every shard now, then on
        the safety poll until it is made again; try again in ``RESUBSCRIBE_EVERY`` s. Logged
        once until a subscription is made."""
        if self._pubsub is not None:
            self._drop_pubsub()  # every shard is claimed now
            self.store.refresh_slots()  # (a failed subscribe has refreshed it)
        self._subscribe_at = self.clock() + RESUBSCRIBE_EVERY
        log = logger.debug if self._subscription_failed else logger.warning
        self._subscription_failed = True
        log(
            "delayq: the wake subscription failed (%s); claiming on the safety poll every %.0f s "
            "while it is made again",
            error_text(exc),
            RESUBSCRIBE_EVERY,
        )

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, waking early when a job becomes due sooner."""
        deadline = self.clock() + timeout
        pubsub = self._subscribe()
        while True:
            now = self.clock()
            remaining = min(deadline - now, self.seconds_until_due())
            if remaining <= 0:
                return
            chore_in = self._next_chore() - now
            if chore_in <= 0:
                self.chores()
                continue
            if pubsub is None:  # until the next safety poll (seconds_until_due)
                self.sleep(min(remaining, chore_in))
                continue
            try:
                message = pubsub.get_message(timeout=min(remaining, chore_in))
            except REDIS_ERRORS as exc:
                self._subscription_lost(exc)  # never the tick's outage back-off: claim now
                return
            if message is None:
                continue
            self._on_wake(message.get("data"))

    def _on_wake(self, data: Any) -> None:
        parsed = parse_wake(data)
        if parsed is None:
            return
        shard, due = parsed
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
        drop the subscription. Never raises for Redis. Logs the fence's residual window (see
        :meth:`fence_window`) when anything went through kombu."""
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
            self.fence.windows.clear()  # logged once, however often stop() is called
        self.publish_lateness.last_flush()
        self.beat.remove()
        self.close()


def fail_result(app: Any, envelope: Envelope, reason: str) -> None:
    """Store FAILURE (``NotRegistered(reason)``) as the result of a job the beat dead-lettered
    for its unknown task, so that a caller waiting on it gets the error instead of waiting for
    good. Never raises: without a result backend, or when it fails, only the log says it."""
    task_id = envelope.headers.get("id")
    if not isinstance(task_id, str):
        return
    try:
        app.backend.store_result(task_id, NotRegistered(reason), states.FAILURE)
    except Exception as exc:  # the job is in the dead letters either way
        logger.warning("delayq: storing the FAILURE of dead-lettered task %s failed: %r", task_id, exc)


def _count_stale(done: dict[str, bool], what: str, verb: str) -> tuple[int, int]:
    """``(done, stale)`` of an ack or hold's ``{id: done}``; the stale ones are logged."""
    count = sum(done.values())
    stale = len(done) - count
    if stale:
        logger.warning(
            "delayq: %d published %sjob(s) were no longer leased to this beat when %s (lease "
            "expired and re-claimed, or cancelled/replaced meanwhile)",
            stale,
            what,
            verb,
        )
    return count, stale
