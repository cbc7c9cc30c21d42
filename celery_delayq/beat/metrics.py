"""The beat's Prometheus endpoint: ``delayq_metrics_port`` (see docs/operations.md).

One :class:`DispatcherCollector` per beat, in a :class:`~prometheus_client.CollectorRegistry`
of its own (never the process-wide default registry), served by
:func:`prometheus_client.start_http_server` on ``delayq_metrics_addr:delayq_metrics_port``.
Nothing is observed on the dispatch path: at each scrape the collector turns the
dispatcher's counters (:class:`~celery_delayq.beat.stats.DispatchStats`) and its in-process
lateness histogram into metric families, and reads the store's sizes and the workers'
lateness histogram from Redis in one pipeline, at most every ``REDIS_READ_EVERY`` s (later
scrapes in that time reuse the last read). In the same read, the flow-control keys
(``Store.key_states``): each key's running and waiting jobs as gauges, for at most
``MAX_KEY_SERIES`` keys (the busiest: most running + waiting), and how many keys there are.

>>> from celery_delayq.store.lateness import Snapshot
>>> buckets = seconds_buckets(Snapshot.from_fields({"le:5": 2, "le:inf": 1, "count": 3}).cumulative())
>>> buckets[:4], buckets[-1]
([('0.001', 0.0), ('0.002', 0.0), ('0.005', 2.0), ('0.01', 2.0)], ('+Inf', 3.0))
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # an extra: the core runs without it
    raise ImportError(
        "delayq_metrics_port needs prometheus-client: pip install 'celery-delayq[metrics]'"
    ) from exc

from ..store import lateness
from ..store.connection import error_text
from .stats import CLAIM_SIZE_BOUNDS, DispatcherView

__all__ = ["MAX_KEY_SERIES", "REDIS_READ_EVERY", "DispatcherCollector", "MetricsServer", "seconds_buckets"]

logger = logging.getLogger(__name__)

#: Seconds a read of the store's sizes and of the workers' lateness is reused by later scrapes.
REDIS_READ_EVERY = 5.0

#: Most flow-control keys given a running/waiting series (the busiest ones): a key per tenant
#: must not make a scrape unbounded.
MAX_KEY_SERIES = 100


def seconds_buckets(cumulative: Sequence[tuple[float, int]]) -> list[tuple[str, float]]:
    """``(bound ms, count)`` pairs (:meth:`lateness.Snapshot.cumulative`) as Prometheus buckets
    in seconds: ``(le, count)`` with ``le`` as the exposition writes it."""
    out: list[tuple[str, float]] = []
    for bound_ms, count in cumulative:
        le = "+Inf" if bound_ms == float("inf") else f"{bound_ms / 1000.0:g}"
        out.append((le, float(count)))
    return out


def _labelled(name: str, documentation: str, label: str, counts: dict[str, int]) -> Iterator[Metric]:
    """One counter family with a sample per key of ``counts`` (none before the first)."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, value in sorted(counts.items()):
        family.add_metric([key], value)
    yield family


def _histogram(name: str, documentation: str, snapshot: lateness.Snapshot) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        name,
        documentation,
        buckets=seconds_buckets(snapshot.cumulative()),
        sum_value=snapshot.sum_ms / 1000.0,
    )


class DispatcherCollector(Collector):
    """The metrics of one beat (its :class:`Dispatcher`) and of its store."""

    def __init__(self, dispatcher: DispatcherView, read_every: float = REDIS_READ_EVERY) -> None:
        self.dispatcher = dispatcher
        self.read_every = read_every
        self._lock = threading.Lock()
        self._read_at = -float("inf")  # monotonic time of the last read from Redis
        self._read: dict[str, Any] | None = None

    # -- from Redis, cached ---------------------------------------------------------------------

    def store_state(self) -> dict[str, Any] | None:
        """Sizes of the store and the workers' lateness, as read at most ``read_every`` s ago;
        None when Redis could not be read."""
        with self._lock:
            if time.monotonic() - self._read_at >= self.read_every:
                self._read_at = time.monotonic()
                try:
                    self._read = self._read_redis()
                except Exception as exc:  # the scrape still answers, with store_up 0
                    logger.warning("delayq: metrics cannot read the store: %s", error_text(exc))
                    self._read = None
            return self._read

    def _read_redis(self) -> dict[str, Any]:
        """One pipeline: per shard ZCARD due, ZCOUNT due up to now, HLEN leases, HLEN dead;
        and the start lateness hash."""
        store = self.dispatcher.store
        now_ms = int(self.dispatcher.server_now_ms())
        seen = store.overview(now_ms, lateness.key_for(store.config.prefix, "start"))
        return {
            "pending": max(0, seen.stored - seen.leased),
            "leased": seen.leased,
            "overdue": seen.overdue,
            "dead": seen.dead,
            "start": lateness.Snapshot.from_fields(seen.lateness),
            "dropped": seen.dropped,
            "keys": self._read_keys(),
        }

    def _read_keys(self) -> tuple[int, list[tuple[str, int, int]]] | None:
        """``(number of keys, [(key, running, waiting)])`` of the busiest MAX_KEY_SERIES keys
        with anything running or waiting; None when they could not be read."""
        try:
            states = self.dispatcher.store.key_states()
        except Exception as exc:
            logger.warning("delayq: metrics cannot read the flow-control keys: %s", error_text(exc))
            return None
        busy = [(s.key, s.running, s.waiting) for s in states if s.running or s.waiting]
        busy.sort(key=lambda row: (-(row[1] + row[2]), row[0]))
        return len(states), busy[:MAX_KEY_SERIES]

    # -- the families -----------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        d = self.dispatcher
        stats = d.stats
        yield InfoMetricFamily(
            "delayq_beat",
            "This beat: its token (the field of its heartbeat in <prefix>:beats), host and pid.",
            value={"token": d.token, "host": d.host, "pid": str(os.getpid()), "prefix": d.config.prefix},
        )
        counters = (
            ("delayq_dispatched", "Jobs this beat published into their Celery queues.", stats.published),
            ("delayq_claimed", "Jobs this beat claimed (leased) from the store.", stats.claimed),
            (
                "delayq_pushed_on_claim",
                "Jobs lua/push.lua pushed into their queues in the script that claimed them, for this "
                "beat (the push path with delayq_push_on_claim; also in delayq_dispatched_total).",
                stats.pushed_on_claim,
            ),
            ("delayq_dead_lettered", "Jobs this beat moved to the dead letters.", stats.dead_lettered),
            (
                "delayq_publish_errors",
                "Failed publishes of this beat (broker unreachable or refusing; retried after their lease).",
                stats.publish_errors,
            ),
            (
                "delayq_stale_acks",
                "Published jobs that were no longer leased to this beat at ack (a duplicate may "
                "have been delivered).",
                stats.stale_acks,
            ),
            (
                "delayq_fenced",
                "Claimed jobs this beat did not publish: their lease was lost when it renewed it "
                "before publishing (the beat was paused or slow; another beat delivers them).",
                stats.fenced,
            ),
            (
                "delayq_lease_renewals",
                "Renews of a pass's leases before publishing (the pass had outlived half its lease).",
                stats.renewals,
            ),
            ("delayq_passes", "Claim passes of this beat.", stats.passes),
            (
                "delayq_tick_errors",
                "Ticks of this beat that failed: Redis or the broker unreachable.",
                stats.errors,
            ),
            ("delayq_wakeups", "Wake messages that brought a shard's next claim forward.", stats.wakeups),
            (
                "delayq_schedules_repaired",
                "Stalled schedules this beat found and re-armed (next run past, its point not stored).",
                stats.stalls_repaired,
            ),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        yield from _labelled(
            "delayq_redis_errors",
            "Ticks of this beat that failed with a Redis error, by kind: "
            "unreachable, oom, script, noscript, other.",
            "kind",
            stats.redis_errors,
        )
        yield from _labelled(
            "delayq_corrupt_entries",
            "Stored entries this beat found unreadable, by what: envelope "
            "and definition and due (dead-lettered), lease (replaced by the claim), history (reset).",
            "what",
            stats.corrupt,
        )
        sizes = stats.claim_sizes
        buckets: list[tuple[str, float]] = []
        seen = 0
        for bound, n in zip((*(str(b) for b in CLAIM_SIZE_BOUNDS), "+Inf"), sizes, strict=True):
            seen += n
            buckets.append((bound, float(seen)))
        yield HistogramMetricFamily(
            "delayq_claim_batch_size",
            "Jobs taken by each claim of one shard that took any (delayq_batch_size at most).",
            buckets=buckets,
            sum_value=float(stats.claimed),
        )
        yield _histogram(
            "delayq_publish_lateness_seconds",
            "Due time -> publish of the jobs this beat published (since it started); a job flow "
            "control held back (a batch's completion job, a parked, paused or deferred gated job) "
            "counts from when it was let go: the time held back is in delayq_gated_seconds.",
            d.lateness_seen.snapshot(),
        )
        yield _histogram(
            "delayq_gated_seconds",
            "How long the jobs this beat published were held back by flow control (gated), due "
            "time -> let go: a batch's completion job until its batch finished, a gated job parked "
            "for a slot, paused or deferred by a rate until it was released.",
            d.gated_seen.snapshot(),
        )
        yield GaugeMetricFamily(
            "delayq_behind_seconds",
            "How long the latest job or schedule point of this beat's last pass waited to be "
            "published (0: it published nothing): over delayq_behind_warning, the beat logs that "
            "it is behind; another beat on the same store shares the load.",
            value=d.behind_seconds,
        )
        yield from self._gate_families()
        state = self.store_state()
        yield GaugeMetricFamily(
            "delayq_store_up",
            "1 when the last read of the store's sizes worked, else 0.",
            value=0 if state is None else 1,
        )
        if state is None:
            return
        gauges = (
            (
                "delayq_pending_jobs",
                "Jobs waiting in the store (all shards), due or not; not leased.",
                "pending",
            ),
            (
                "delayq_overdue_jobs",
                "Stored jobs whose due time (or expired lease) has passed and that no beat holds yet.",
                "overdue",
            ),
            ("delayq_leased_jobs", "Jobs a beat has claimed and not yet published and acked.", "leased"),
            ("delayq_dead_jobs", "Dead-lettered jobs (all shards).", "dead"),
        )
        for name, documentation, field in gauges:
            yield GaugeMetricFamily(name, documentation, value=state[field])
        yield CounterMetricFamily(
            "delayq_stale_starts_dropped",
            "Copies of jobs that workers dropped before running them: "
            "another delivery of the same job had started (a beat published it after losing its "
            "lease; delayq_start_check). All workers; the same in every beat.",
            value=state["dropped"],
        )
        keys = state.get("keys")
        if keys is not None:
            yield from _key_families(*keys)
        yield _histogram(
            "delayq_start_lateness_seconds",
            "Due time -> task start, recorded by every worker with delayq_record_lateness "
            "(<prefix>:lateness:start; the same in every beat).",
            state["start"],
        )

    def _gate_families(self) -> Iterator[Metric]:
        stats = self.dispatcher.stats
        yield from _labelled(
            "delayq_gated",
            "Gated jobs this beat asked the gate about, by its decision: released, "
            "parked (key full or paused), deferred (rate spent), not-held, held (a check of a job "
            "waiting for its worker), finished (the result backend says it ran already).",
            "decision",
            stats.gated,
        )
        yield from _labelled(
            "delayq_schedule_overlap",
            "Due points of schedules with an overlap policy, by what this beat found: run (no run "
            "in flight), skip, wait (buffer_one), cancel (cancel_previous revoked the run in "
            "flight), not-held, error (Redis could not be asked).",
            "decision",
            stats.overlap,
        )
        yield CounterMetricFamily(
            "delayq_gate_holds",
            "Released gated jobs this beat published and handed to their "
            "workers (their slot held until the task ends).",
            value=stats.held,
        )
        yield CounterMetricFamily(
            "delayq_gate_stale_holds",
            "Released gated jobs published by this beat whose hold found "
            "them no longer leased to it (another beat re-claimed them).",
            value=stats.stale_holds,
        )
        yield CounterMetricFamily(
            "delayq_batch_completions",
            "Batch completion jobs this beat published with their batch's counts.",
            value=stats.completions,
        )
        yield _histogram(
            "delayq_slot_wait_seconds",
            "Original due time -> publish of the released gated jobs of this beat (time spent "
            "parked for a slot or deferred by a rate, plus the publish lateness).",
            stats.slot_wait.snapshot(),
        )


def _key_families(count: int, rows: list[tuple[str, int, int]]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "delayq_gate_keys", "Flow-control keys stored (every key a gated job carried).", value=count
    )
    running = GaugeMetricFamily(
        "delayq_key_running",
        f"Released jobs of a key whose task has not finished (its slots "
        f"taken); the {MAX_KEY_SERIES} busiest keys.",
        labels=["key"],
    )
    waiting = GaugeMetricFamily(
        "delayq_key_waiting",
        f"Parked jobs of a key (waiting for a slot or a resume); the {MAX_KEY_SERIES} busiest keys.",
        labels=["key"],
    )
    for key, run, wait in rows:
        running.add_metric([key], run)
        waiting.add_metric([key], wait)
    yield running
    yield waiting


class MetricsServer:
    """The HTTP endpoint of one dispatcher: a registry of its own, a server thread."""

    def __init__(self, dispatcher: DispatcherView, port: int, addr: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = DispatcherCollector(dispatcher)
        self.registry.register(self.collector)
        started: Any = start_http_server(port, addr, registry=self.registry)
        # prometheus-client >= 0.20 returns (server, thread); older versions return None
        self._server: Any = started[0] if isinstance(started, tuple) else None
        self.port = int(self._server.server_address[1]) if self._server is not None else port
        self.addr = addr
        logger.info("delayq: metrics on http://%s:%d/metrics", addr, self.port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
