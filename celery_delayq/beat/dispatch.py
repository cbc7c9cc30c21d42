"""The claim loop: claim due jobs, publish them into their Celery queues, ack them.

One :class:`Dispatcher` runs inside each beat (see :mod:`.scheduler`); any
number of them may share one store with no leader. Each pass claims a bounded
batch from the shards that may have due jobs (:mod:`.wake` says which), publishes every
claimed job as its disposition says (:mod:`.dispositions`; :mod:`.publish` and :mod:`.push`,
fenced by :mod:`.fence`), and only then acks it. A beat that dies between claim and ack loses
nothing: its leases expire after ``delayq_reclaim_ttl`` and another beat delivers the batch
again (so a crash can duplicate at most the batch it held).

Flow control: before publishing, the gated jobs of a pass go to the gate, all at once
(:meth:`.gating.Gating.gate_pass`). A released one is published through kombu, then *held*
for its worker (``Store.hold``) instead of acked: its key's slot stays taken until the
worker's :mod:`..flow.slots` gives it back. Parked and deferred ones stay stored, out of the pass.

Between passes the dispatcher sleeps (:meth:`Dispatcher.wait`) until the earliest due time it
knows of, on the wake subscription (:mod:`.wake`), and runs its :mod:`.chores` (lateness
flush, heartbeat, sweeps) when they are due. Schedule points are fired by :mod:`.firing`. The
clocks are injected: ``clock`` (monotonic s), ``wall`` (s) and ``sleep``; a test stalls a pass
at one of its steps through :attr:`Dispatcher.pause`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..config import setting_name
from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER
from ..store.connection import REDIS_ERRORS, error_text, redis_error_kind
from ..store.delivery import ClaimedJob, ClaimResult, PushResult
from ..store.facade import Store, get_store
from ..store.lateness import Histogram, PublishLateness
from .backoff import Backoff
from .behind import Behind
from .chores import Chores
from .dispositions import PassResult, PassState
from .fence import Fence
from .firing import ScheduleFiring
from .gating import Gating
from .heartbeat import Heartbeat
from .publish import Publishing
from .publish_pass import PassPublisher
from .push import PushPath
from .stats import CLAIM_SIZE_BOUNDS, DispatchStats
from .wake import Wake

__all__ = ["Dispatcher", "PassHook"]

logger = logging.getLogger(__name__)

#: Longest back-off (s) between claims while the broker is unreachable.
BROKER_BACKOFF_MAX = 5.0

#: How soon (ms) a beat claims again the shards of a cluster node that failed while others
#: answered (a primary failing over).
CLUSTER_RETRY_MS = 1000.0

#: The line that says some shards could not be claimed is logged at most this often (s); the
#: passes between are counted in the next one.
CLAIM_FAILURE_LOG_EVERY = 10.0

#: What :attr:`Dispatcher.pause` is called with: ``(step, detail)``.
PassHook = Callable[[str, Any], None]


class Dispatcher:
    """Claims, publishes and acks due jobs of one app; sleeps until the next one."""

    #: The seam a test stalls a pass at (a GC pause, a stopped process) instead of replacing a
    #: method: when set, called in the beat's thread as ``pause(step, detail)`` at each step of a
    #: pass, and may sleep, run another beat's pass or stop the process before returning.
    #: ``step`` is ``"claimed"`` (detail: the claimed ``(shard, job)`` pairs, before any is
    #: published), ``"handed"`` (a job id handed to kombu: in the open publish batch, or sent),
    #: ``"sent"`` (how many messages just reached the broker: a publish returned or the batch was
    #: flushed) or ``"hold"`` (the published released gated jobs about to be held: shard ->
    #: ``[(id, slot)]``). Set it on a dispatcher, or on the class (as a ``staticmethod``) in a
    #: beat process. None: no pause.
    pause: PassHook | None = None

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
        #: which shards to claim when, and the server's clock
        self.wake = Wake(self.store, self.stats, clock, wall)
        self._claim_failures = 0  # passes with shards not claimed, since the last line logged
        self._claim_logged_at = -CLAIM_FAILURE_LOG_EVERY  # clock time of that line
        self.fence = Fence(self.store, self.token, self.stats, clock, pause=self._pause_at)
        self.publishing = Publishing(app, self.store, self.token, self.stats, self.fence, self.server_now_ms)
        self.push_path = PushPath(self.publishing)
        self.gating = Gating(self.publishing)
        self.firing = ScheduleFiring(app, self.store, self.token, self.stats, self.server_now_ms)
        #: back-off from claiming while the broker is unreachable (0.5 s, doubling up to
        #: BROKER_BACKOFF_MAX or delayq_max_sleep)
        self.broker_backoff = Backoff(0.5, min(BROKER_BACKOFF_MAX, self.config.max_sleep), clock)
        self.publish_lateness = PublishLateness(self.store, self.config.prefix, clock)
        self.beat = Heartbeat(self.store, self.token, self.stats, self.server_now_ms, clock, wall)
        self.pass_publisher = PassPublisher(
            app, self.stats, self.fence, self.publishing, self.push_path, self.gating, self.firing
        )
        self._chores = Chores(
            app, self.store, self.stats, self.publish_lateness, self.beat, self.server_now_ms, clock
        )
        #: how far behind the due work this beat is (delayq_behind_warning)
        self.behind = Behind(self.config.behind_warning, setting_name(app, "delayq_behind_warning"))
        self._pass_late_ms = 0.0  # the latest lateness published in the current pass

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
        return self.push_path.pushing

    @property
    def lateness(self) -> Histogram:
        """Due -> publish lateness not yet flushed to Redis."""
        return self.publish_lateness.pending

    @property
    def lateness_seen(self) -> Histogram:
        """Due -> publish lateness since the start."""
        return self.publish_lateness.seen

    @property
    def behind_seconds(self) -> float:
        """The lateness (s) of the latest job or schedule point the last pass published: how far
        behind the due work this beat is (:mod:`.behind`)."""
        return self.behind.seconds

    @property
    def gated_seen(self) -> Histogram:
        """How long the published jobs flow control held back were held, since the start."""
        return self.publish_lateness.gated_seen

    def fence_window(self) -> tuple[int, float, float]:
        """``(count, p99 ms, max ms)`` of the fence's residual windows kept (the last
        FENCE_WINDOWS_KEPT): the time from the last lease check to the end of a publish or
        batch flush."""
        return self.fence.window()

    @property
    def subscription(self) -> Any:
        """The wake channel's pub/sub connection (None before the first pass or after
        :meth:`close`)."""
        return self.wake.pubsub

    def heartbeat(self) -> dict[str, Any]:
        """This beat's entry in ``<prefix>:beats`` (the value is its JSON)."""
        return self.beat.entry()

    # -- clock -------------------------------------------------------------------------------

    def server_now_ms(self) -> float:
        return self.wake.server_now_ms()

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self) -> float:
        """Claim, publish and ack one batch from every shard that may have due jobs.

        Returns the seconds until the next known due time (0 when a batch came
        back full, so the caller should pass again at once).
        """
        self.wake.subscribe()  # when it fails, the safety poll stands in for it
        if self.broker_backoff.remaining() <= 0:
            shards = self.wake.shards_to_claim()
            if shards:
                self._pass(shards)
        # else the broker was unreachable: wait out the back-off
        if self.clock() >= self._chores.due_at():
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
        """Seconds until the next pass: the broker's back-off, or the earliest due time known
        (:meth:`.wake.Wake.seconds_until_due`)."""
        backoff = self.broker_backoff.remaining()
        if backoff > 0:
            return min(backoff, self.config.max_sleep)
        return self.wake.seconds_until_due()

    def _pass(self, shards: list[int]) -> None:
        self._pass_late_ms = 0.0
        self._claim_and_publish(shards)  # (a pass that raised says nothing of how late work is)
        self.behind.passed(self._pass_late_ms)

    def _claim_and_publish(self, shards: list[int]) -> None:
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
            self.wake.measured(result.now_ms, sent, received)
            batch_full = taken >= self.config.batch_size
            full = full or batch_full
            self.wake.claimed(result.shard, result.next_ms, full=batch_full)
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
            self._pause_at("claimed", claimed)
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
            self.wake.retry(missed, retry_at)
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
        space = self.push_path.probe() if self.config.push_on_claim else None
        # The claim gates the capped jobs it can (lua/includes/gating.lua); it parks those of a
        # full key unless a result backend can say whether a slot's task ended: then the gate
        # parks them, naming the slots to look up (Gating._give_back).
        gating = self.gating.ran.backend is None
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
        # ms, with how many jobs each: the script's pairs, by due time, tallied once a pair. Beat CPU a
        # job pushed on claim (20,000 real jobs due at once drained by run_once, as bench.push_cost
        # drains them; a shared 2-core VM): 0.74-0.78 µs when expanded to one value a job, 0.33-0.39 µs
        late: list[float] = []
        counts: list[int] = []
        for result in results:
            if not result.pushed:
                continue
            pushed += result.pushed
            for ms, count in result.lateness:
                late.append(float(ms))
                counts.append(count)
            queues.update(queue for queue, _, _ in result.used)
        if not pushed:
            return
        stats = self.stats
        stats.claimed += pushed
        stats.published += pushed
        stats.acked += pushed
        stats.pushed_on_claim += pushed
        self.publish_lateness.record(late, counts)
        self._pass_late_ms = max(self._pass_late_ms, max(late, default=0.0))
        if self._keep_lateness:
            room = max(0, self._keep_lateness - len(stats.lateness_ms))
            each = itertools.chain.from_iterable(map(itertools.repeat, late, counts))
            stats.lateness_ms.extend(itertools.islice(each, room))
        self.push_path.declare_pushed(sorted(queues))
        self._broker_state(False, True)

    def _settle(self, result: PassResult) -> None:
        """The ack step, after the publish: fire the published schedule points, hold the
        published released gated jobs for their workers, ack the other published jobs."""
        self.firing.settle(result.fires)
        if result.holds:
            self._pause_at("hold", result.holds)
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
            check_ms = int(self.config.slot_ttl * 1000) if self.gating.ran.backend is not None else 0
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
        """Publish each claimed job of this pass (``(shard, job)``) as its disposition says
        (:meth:`.publish_pass.PassPublisher.publish`); return what the ack step (:meth:`_settle`)
        does: the ids to ack by shard, the released gated jobs to hold, the fire calls of the
        published schedule points. ``misses``: the jobs ``lua/push.lua`` asked a template for, (shard,
        templates-hash field) -> job."""
        state = self.pass_publisher.publish(claimed, misses or {})
        self._count_pass(state)
        return state.result()

    def _count_pass(self, state: PassState) -> None:
        """After a pass's publish: the broker's state, the published count, the slot wait of the
        released gated jobs, the time flow control held jobs back, and the publish lateness (a
        job held back counts from when it was let go)."""
        self._broker_state(state.outage, bool(state.sent or state.acks or state.released))
        now = self.server_now_ms()
        self.stats.published += len(state.sent) + len(state.released)
        for due in state.released:  # original due -> publish
            self.stats.slot_wait.observe(now - due)
        if state.gated_ms:
            self.publish_lateness.record_gated(state.gated_ms)
        counted = [*state.sent, *state.let_go]  # from due, or from when flow control let it go
        if counted:
            # bucketed once per job here; one pipeline per LATENESS_FLUSH_EVERY s (chores)
            self.publish_lateness.record(now - due for due in counted)
            self._pass_late_ms = max(self._pass_late_ms, now - min(counted))
        if self._keep_lateness:
            room = self._keep_lateness - len(self.stats.lateness_ms)
            self.stats.lateness_ms.extend(now - due for due in state.sent[: max(0, room)])

    def _pause_at(self, step: str, detail: Any) -> None:
        """Call :attr:`pause` at ``step`` of a pass, when set."""
        if self.pause is not None:
            self.pause(step, detail)

    # -- lateness, heartbeat, sweeps -----------------------------------------------------------

    def chores(self, force: bool = False) -> None:
        """Run the chores that are due (:meth:`.chores.Chores.run`); ``force``: flush the
        lateness and write the heartbeat now. Never raises."""
        self._chores.run(force)

    def sweep_stalls(self) -> int:
        """One step of the sweep for stalled schedules: how many it re-armed. Never raises."""
        return self._chores.sweep_stalls()

    def sweep_batches(self) -> int:
        """Remove what is left of the finished batches whose time passed: how many. Never raises."""
        return self._chores.sweep_batches()

    # -- sleeping ----------------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, waking early when a job becomes due sooner."""
        deadline = self.clock() + timeout
        pubsub = self.wake.subscribe()
        while True:
            now = self.clock()
            remaining = min(deadline - now, self.seconds_until_due())
            if remaining <= 0:
                return
            chore_in = self._chores.due_at() - now
            if chore_in <= 0:
                self.chores()
                continue
            if pubsub is None:  # until the next safety poll (seconds_until_due)
                self.sleep(min(remaining, chore_in))
                continue
            try:
                message = pubsub.get_message(timeout=min(remaining, chore_in))
            except REDIS_ERRORS as exc:
                self.wake.lost(exc)  # never the tick's outage back-off: claim now
                return
            if message is None:
                continue
            self.wake.on_wake(message.get("data"))

    def close(self) -> None:
        """Drop the wake subscription (the Scheduler does on a Redis error; a later pass
        subscribes again). See :meth:`stop` for the end of the beat."""
        self.wake.drop()

    def stop(self) -> None:
        """The beat is stopping: flush the lateness histogram, remove this beat's heartbeat,
        drop the subscription. Never raises for Redis. Logs the fence's residual window (see
        :meth:`fence_window`) when anything went through kombu."""
        self.fence.log_window()
        self.publish_lateness.last_flush()
        self.beat.remove()
        self.close()


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
