"""The counters of one beat's dispatcher (:class:`DispatchStats`), read by its heartbeat and
by the Prometheus collector (:mod:`.metrics`), which therefore need not import the dispatcher.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from ..config import DelayQConfig
from ..store.facade import Store
from ..store.lateness import Histogram

__all__ = ["CLAIM_SIZE_BOUNDS", "DispatchStats", "DispatcherView"]

#: Upper bounds of the claim batch size histogram: jobs taken by one claim of one shard.
CLAIM_SIZE_BOUNDS: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


@dataclass
class DispatchStats:
    """Counters of one dispatcher since it started."""

    passes: int = 0
    claimed: int = 0
    published: int = 0
    acked: int = 0
    #: jobs lua/push.lua pushed in the script that claimed them (delayq_push_on_claim; also in
    #: claimed, published, acked)
    pushed_on_claim: int = 0
    stale_acks: int = 0
    #: claimed jobs not published because the fence found their lease lost (also in stale_acks)
    fenced: int = 0
    #: renews of a pass's leases (lua/renew.lua) because the fence's local deadline had passed
    renewals: int = 0
    dead_lettered: int = 0
    publish_errors: int = 0
    wakeups: int = 0
    #: stalled schedules this beat found and re-armed (see schedule_upkeep.StallSweep)
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
    #: gated jobs by what the gate decided (lua/gate.lua): released, parked, deferred, not-held,
    #: held; and finished: the result backend says it ran already (results.Ran)
    gated: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: due points of schedules with an overlap policy by what lua/overlap.lua answered: run,
    #: skip, wait, cancel, not-held
    overlap: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: released gated jobs a beat published and then held for their worker (lua/hold.lua)
    held: int = 0
    #: released gated jobs whose hold found the job no longer leased to this beat (published;
    #: another beat had re-claimed it, or it was cancelled meanwhile)
    stale_holds: int = 0
    #: batch completion jobs published with their batch's counts appended
    completions: int = 0
    #: original due -> publish of the released gated jobs (the time spent parked or deferred)
    slot_wait: Histogram = field(default_factory=Histogram)


class DispatcherView(Protocol):
    """What readers of a beat's dispatcher (its metrics) see of it."""

    token: str
    store: Store
    config: DelayQConfig
    stats: DispatchStats

    @property
    def host(self) -> str: ...

    @property
    def lateness_seen(self) -> Histogram: ...

    @property
    def gated_seen(self) -> Histogram: ...

    @property
    def behind_seconds(self) -> float: ...

    def server_now_ms(self) -> float: ...
