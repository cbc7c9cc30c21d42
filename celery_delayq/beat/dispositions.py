"""One pass of the beat as values: what becomes of each claimed job, and what the pass hands on.

A pass (:meth:`.dispatch.Dispatcher.publish_claimed`) takes the jobs a claim returned and
gives each one a :class:`Disposition`, decided by :func:`disposition` from the job's values
alone (its due time, its decoded envelope, the gate's answer for the pass, the tasks the beat
knows): no Redis, no broker, no clock. :mod:`.publish_pass` then carries it out (publishes,
dead-letters, holds) and gathers what it did in a :class:`PassState`, made afresh for each
pass; what the ack step needs of it is a :class:`PassResult`.

A claimed job goes, in order of the checks:

- ``CORRUPT_DUE``: its due time is no time: dead-lettered before the gate is asked;
- ``KEPT``: the gate keeps it out of this pass (parked, deferred, not held, or it ran already):
  it stays stored, neither published nor acked;
- ``CORRUPT_ENVELOPE``: its envelope does not read: dead-lettered;
- ``FIRE``: a point of a recurring schedule: published by :mod:`.firing`, whose fire call acks
  it and stores the next point;
- ``UNKNOWN_TASK``: its task is not registered in the beat (with ``delayq_dead_letter_unknown``,
  and not a retry): dead-lettered, its result set to FAILURE;
- ``RELEASE``: a gated job the gate released: published through kombu, then held for its worker;
- ``PUBLISH``: published by the pass's strategy (push path, kombu, or Celery), then acked.

Two shortcuts come before the decision, both in the pass's loop (:mod:`.publish_pass`): a job
the gate keeps is not decoded again, and on the push path a job that is neither gated nor a
batch's completion is first built from its stored text, undecoded
(:meth:`.push.Pusher.publish_raw`, which leaves to the decoded way any job it cannot build or
whose task the beat does not know).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum

from ..due import MAX_DUE_MS
from ..store.delivery import ClaimedJob
from ..store.envelope import Envelope
from .firing import FireCall
from .gating import GatePass
from .publish import Publisher
from .push import Pusher

__all__ = ["Disposition", "PassResult", "PassState", "disposition", "due_in_range", "is_retry"]


class Disposition(Enum):
    """What a pass does with one claimed job (see the module's docstring)."""

    CORRUPT_DUE = "corrupt_due"
    KEPT = "kept"
    CORRUPT_ENVELOPE = "corrupt_envelope"
    FIRE = "fire"
    UNKNOWN_TASK = "unknown_task"
    RELEASE = "release"
    PUBLISH = "publish"


def due_in_range(job: ClaimedJob) -> bool:
    """Whether ``job``'s due time is a time from 1970 to year 9999 (a lease entry or a score
    written by something else, such as ``1e23|1|x``, is read by the scripts as a number that is
    no time)."""
    return 0 <= job.due_ms <= MAX_DUE_MS


def is_retry(envelope: Envelope) -> bool:
    """Whether ``envelope`` is a task's retry (its ``retries`` header is above 0): a worker
    that runs the task stored it, so its name and routing are real and the beat publishes it
    by name, as ``send_task`` would, even when it does not import the task.

    >>> def env(headers): return Envelope("t", headers, {}, b"", "", "", {}, None, 0)
    >>> is_retry(env({"retries": 1})), is_retry(env({"retries": 0})), is_retry(env({}))
    (True, False, False)
    """
    retries = envelope.headers.get("retries")
    return isinstance(retries, int) and not isinstance(retries, bool) and retries > 0


def disposition(
    job: ClaimedJob,
    envelope: Envelope | ValueError,
    gate: GatePass,
    *,
    registered: Container[str],
    dead_letter_unknown: bool,
) -> Disposition:
    """What the pass does with ``job``: ``envelope`` is its decoded envelope (the gate's, with
    a completion job's arguments appended, when it has one) or the ValueError its decoding
    raised; ``gate`` is the gate's answer for the pass; ``registered`` the tasks the beat
    knows, looked at only with ``dead_letter_unknown``.

    >>> job = ClaimedJob("j1", "", 1_700_000_000_000, 1)
    >>> env = Envelope("t.add", {}, {}, b"", "", "", {}, None, 0)
    >>> disposition(job, env, GatePass(), registered={"t.add"}, dead_letter_unknown=True)
    <Disposition.PUBLISH: 'publish'>
    >>> disposition(job, env, GatePass(), registered=set(), dead_letter_unknown=True)
    <Disposition.UNKNOWN_TASK: 'unknown_task'>
    """
    if not due_in_range(job):
        return Disposition.CORRUPT_DUE
    if job.id in gate.skip:
        return Disposition.KEPT
    if isinstance(envelope, ValueError):
        return Disposition.CORRUPT_ENVELOPE
    if envelope.schedule is not None:
        return Disposition.FIRE
    if dead_letter_unknown and envelope.task not in registered and not is_retry(envelope):
        return Disposition.UNKNOWN_TASK
    if job.id in gate.released:
        return Disposition.RELEASE
    return Disposition.PUBLISH


@dataclass(frozen=True)
class PassResult:
    """What a pass hands to its ack step (:meth:`.dispatch.Dispatcher._settle`), once its
    messages reached the broker."""

    #: ids of the published jobs to ack, by shard
    acks: dict[int, list[str]] = field(default_factory=dict)
    #: released gated jobs published, by shard: (id, gate key), held for their worker, not acked
    holds: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    #: the fire calls that ack the published schedule points and store their next points
    fires: list[FireCall] = field(default_factory=list)


@dataclass
class PassState:
    """One pass between its claim and its ack: what it works with (the gate's answer, its
    publishing strategy) and what it gathers. Made for each pass, passed to the steps of the
    pass, never kept on the dispatcher."""

    #: the gate's answer for the pass's gated and completion jobs
    gate: GatePass
    #: the pass's strategy (:meth:`.push.PushPath.begin`)
    publisher: Publisher
    #: the jobs ``lua/push.lua`` asked a template for: (shard, templates-hash field) -> a job
    misses: dict[tuple[int, str], ClaimedJob] = field(default_factory=dict)
    #: ``publisher`` on the push path, else None
    pusher: Pusher | None = field(init=False)
    acks: defaultdict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    holds: defaultdict[int, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    fires: list[FireCall] = field(default_factory=list)
    #: the schedule points of the pass: published together by :mod:`.firing` after the others
    points: list[tuple[int, ClaimedJob, Envelope]] = field(default_factory=list)
    #: due times of the jobs published (then acked), each as its publish lateness counts from
    #: it: the original due time, or when flow control let the job go (a batch's completion job)
    sent: list[int] = field(default_factory=list)
    #: original due times of the released gated jobs published (then held): the slot wait
    released: list[int] = field(default_factory=list)
    #: the released gated jobs published, each as its publish lateness counts from it: when flow
    #: control let it go (it was held back), else its due time
    let_go: list[int] = field(default_factory=list)
    #: how long (ms) each published job flow control held back was held: due time -> let go
    gated_ms: list[int] = field(default_factory=list)
    #: the broker was unreachable: the pass stopped publishing
    outage: bool = False
    #: the kombu strategy of the released gated jobs (made at the first one)
    kombu: Publisher | None = None

    def __post_init__(self) -> None:
        self.pusher = self.publisher if isinstance(self.publisher, Pusher) else None

    def discard(self) -> None:
        """The pass's publishes did not reach the broker: nothing to ack, hold or fire."""
        self.acks, self.holds = defaultdict(list), defaultdict(list)
        self.fires, self.sent, self.released, self.gated_ms, self.let_go = [], [], [], [], []

    def result(self) -> PassResult:
        return PassResult(dict(self.acks), dict(self.holds), list(self.fires))
