"""The sharded job store, and the one door to Redis: enqueue, claim, ack, bury, cancel,
reschedule, get, scan, schedules and dead letters.

Every method maps onto one Lua script per shard (see ``lua/``), or onto a few plain reads;
calls that touch several shards are pipelined, one round trip for all of them. Times are
milliseconds since the epoch; "now" inside a claim is the server's ``TIME``.

No other module of the package holds a Redis client or runs a script (``tests/test_layers.py``
checks it): each script has one typed method here, and a script's integer reply becomes an
``enum`` outcome (:class:`EnqueueOutcome`, :class:`CancelOutcome`, :class:`RescheduleOutcome`,
:class:`RequeueOutcome`, :class:`FireOutcome`, :class:`PushClaimedOutcome` in a :class:`PushClaimedReply`)
or a bool (held or not) before it leaves this module; a reply that is none of a script's codes
raises :class:`~celery_delayq.exceptions.StoreError`. That is why this module is longer than
the others: it is the whole of the Redis side, one method per script and per read. Building a
client and classifying Redis errors live in :mod:`celery_delayq.store.connection`.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import json
import logging
import math
import re
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from ..config import DelayQConfig, extension
from ..exceptions import CorruptData, InvalidInput, ReservedTaskId, StoreError, StoreFull, UnsupportedServer
from ..flow.gate import (
    BATCH_DONE_HEADER,
    GATE_HEADER,
    GATE_TOKEN,
    PARK_MS,
    RUN_TOKEN,
    Gate,
    batch_key,
    member_id,
)
from . import lateness
from .bounded import MAX_SMALL, load_json
from .connection import (
    OOM_REPLY,
    REDIS_ERRORS,
    error_text,
    evicts_jobs,
    is_oom,
    make_client,
    redis_error_kind,
    version_problem,
)
from .envelope import id_opening, joined_form, loaded_form, shape_id_of, shared_form, stored_form
from .keys import KeySpace, is_point_id, shard_of
from .lua_formats import parse_lease
from .scripts import SCRIPTS, DirectCalls, LuaScript, ScriptCall, run_pipelined, run_replicated

__all__ = [
    "MAX_STORED_TEMPLATES",
    "OOM_REPLY",
    "REDIS_ERRORS",
    "TEMPLATES_TTL_MS",
    "BatchState",
    "CancelOutcome",
    "ClaimResult",
    "ClaimedJob",
    "EnqueueOutcome",
    "FireOutcome",
    "GateDecision",
    "GateResult",
    "IdSearch",
    "JobRecord",
    "KeyState",
    "PushClaimedOutcome",
    "PushClaimedReply",
    "PushResult",
    "ReleaseResult",
    "RequeueOutcome",
    "RescheduleOutcome",
    "ShardStats",
    "Store",
    "StoreOverview",
    "error_text",
    "evicts_jobs",
    "get_store",
    "glob_escape",
    "is_oom",
    "make_client",
    "redis_error_kind",
    "refuse_point_id",
    "refused_when_full",
    "version_problem",
]


class EnqueueOutcome(enum.StrEnum):
    """What storing one job did (``lua/enqueue.lua``)."""

    KEPT = "kept"  # a job with this id was stored already and is kept (not ``replace``)
    NEW = "new"  # stored, no job had this id
    REPLACED = "replaced"  # stored in place of the waiting job with this id (``replace``)
    AFTER_HELD = "after-held"  # stored in place of a job a beat held (its lease is dropped)


class CancelOutcome(enum.StrEnum):
    """What cancelling a job did (``lua/cancel.lua``)."""

    CANCELLED = "cancelled"  # it was waiting: it will never run
    DELIVERING = "delivering"  # removed while a beat held it: it may already be in the broker
    MISSING = "missing"  # no such job


class RescheduleOutcome(enum.StrEnum):
    """What moving a job did (``lua/reschedule.lua``)."""

    MOVED = "moved"
    DELIVERING = "delivering"  # refused: a beat holds the job now
    MISSING = "missing"


class RequeueOutcome(enum.StrEnum):
    """What putting a dead letter back did (``lua/requeue.lua``)."""

    MISSING = "missing"  # no dead letter with this id
    REQUEUED = "requeued"
    STORED = "stored"  # refused: a job with this id is stored, waiting or being delivered
    NO_ENVELOPE = "no-envelope"  # refused: the record holds no message


class FireOutcome(enum.StrEnum):
    """What acking a schedule's point did (``lua/fire.lua``)."""

    STALE = "stale"  # the point was no longer leased to this beat: nothing done
    FIRED = "fired"  # acked, and the schedule moved to its next point
    STOPPED = "stopped"  # acked, not advanced: the schedule was deleted, paused or replaced
    HISTORY_RESET = "history-reset"  # fired, but the run state did not read and was reset


class PushClaimedOutcome(enum.StrEnum):
    """What pushing one job's message did (``lua/push_claimed.lua``)."""

    STALE = "stale"  # the job was no longer leased to this beat: nothing done
    PUSHED = "pushed"  # in its queue list, and gone from the store
    REFUSED = "refused"  # the broker refused the push (see the error): the job keeps its lease


@dataclass(frozen=True)
class PushClaimedReply:
    """One job's answer from :meth:`Store.push_claimed`."""

    outcome: PushClaimedOutcome
    error: str = ""  # the refused LPUSH's error text (``REFUSED`` only)


_PUSHED = PushClaimedReply(PushClaimedOutcome.PUSHED)
_NOT_HELD = PushClaimedReply(PushClaimedOutcome.STALE)

# The scripts' integer replies, by code (see each script's header).
_ENQUEUE = tuple(EnqueueOutcome)  # 0 kept, 1 new, 2 replaced, 3 after-held
_CANCEL = (CancelOutcome.MISSING, CancelOutcome.CANCELLED, CancelOutcome.DELIVERING)
_RESCHEDULE = (RescheduleOutcome.MISSING, RescheduleOutcome.MOVED, RescheduleOutcome.DELIVERING)
_REQUEUE = tuple(RequeueOutcome)  # 0 missing, 1 requeued, 2 stored, 3 no-envelope
_FIRE = (FireOutcome.STALE, FireOutcome.FIRED, FireOutcome.STOPPED, FireOutcome.HISTORY_RESET)
_PUSH_CLAIMED = (_NOT_HELD, _PUSHED)  # an error text stands for REFUSED

#: A wake marker as the scripts write it: ms, digits (a score Redis prints may have a fraction).
_MARKER = re.compile(r"-?[0-9]{1,17}(\.[0-9]{1,17})?")


def is_acl_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command to the user's ACL (``NOPERM``).

    >>> is_acl_refusal(redis.exceptions.NoPermissionError("no permissions")), is_acl_refusal(ValueError())
    (True, False)
    """
    return isinstance(exc, redis.exceptions.NoPermissionError)


def read_marker(raw: Any) -> float | None:
    """A shard's wake marker (ms), or None when it is missing or does not read as one: Lua's
    ``tonumber`` reads every text this accepts as the same number, so a marker the scripts
    would take as missing is never trusted here.

    >>> read_marker("1700000000000"), read_marker("9999999999999999"), read_marker("12.5")
    (1700000000000.0, 1e+16, 12.5)
    >>> read_marker(None), read_marker("soon"), read_marker("1e3"), read_marker(" 12"), read_marker("nan")
    (None, None, None, None, None)
    """
    if not isinstance(raw, str) or not _MARKER.fullmatch(raw):
        return None
    return float(raw)


_DONE = (False, True)  # 0 nothing done, 1 done (bury, sched_del)
_PUT = (False, True, False)  # sched_put: 0 refused (exists), 1 stored, 2 not stalled

_Code = TypeVar("_Code")


def _decode(script: str, table: Sequence[_Code], code: Any) -> _Code:
    """What ``table`` lists for ``code``, an integer reply of ``lua/<script>.lua``.

    A reply that is none of the script's codes (a script out of step with this module) raises
    :class:`StoreError` rather than being taken for another answer.

    >>> _decode("cancel", _CANCEL, 2)
    <CancelOutcome.DELIVERING: 'delivering'>
    >>> _decode("cancel", _CANCEL, -1)
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.StoreError: delayq cancel: unexpected reply -1 (its codes are 0 to 2)
    """
    if type(code) is int and 0 <= code < len(table):
        return table[code]
    raise StoreError(f"delayq {script}: unexpected reply {code!r} (its codes are 0 to {len(table) - 1})")


logger = logging.getLogger(__name__)

#: Longest wait (s) for the server's confirmation of the wake channel's SUBSCRIBE.
SUBSCRIBE_TIMEOUT = 5.0

#: Seconds :meth:`Store.server_now_ms` counts from one reading of the server's ``TIME`` at most
#: (a monotonic clock drifts from the server's by well under 1 ms in that time).
SERVER_CLOCK_MAX_AGE = 60.0

#: Jobs sent to one enqueue call at most (ARGV stays small, the server stays responsive). The
#: script's ZADD of 2 values a job goes in slices of ``scripts.LUA_UNPACK_MAX`` values, as every
#: script's ``unpack`` does (Lua's limit is about 8000), so the size of a call is not bound by it.
ENQUEUE_CHUNK = 1000
#: Ids sent to one ack call at most.
ACK_CHUNK = 5000
#: Jobs per push_claimed script call (each carries its whole broker message).
PUSH_CLAIMED_CHUNK = 1000


@dataclass(frozen=True)
class ClaimedJob:
    id: str
    envelope: str
    due_ms: int
    tries: int
    #: the gate key of a capped job the claim gave a slot itself (``lua/includes/gating.lua``):
    #: publish it and hold it, without asking the gate; None for any other job
    gate_key: str | None = None


@dataclass(frozen=True)
class ClaimResult:
    """What one ``lua/claim.lua`` call claimed on a shard. It has the attributes of a
    :class:`PushResult`, with nothing pushed, so that a pass reads either alike."""

    shard: int
    now_ms: int
    next_ms: int | None
    jobs: list[ClaimedJob]
    #: lease entries of claimed jobs that did not read and were replaced (see lua/claim.lua)
    repaired: int = 0
    #: (as :class:`PushResult`'s) nothing is pushed by claim.lua
    pushed: int = 0
    lateness: list[tuple[int, int]] = field(default_factory=list)
    used: list[tuple[str, str, int]] = field(default_factory=list)
    misses: dict[str, str] = field(default_factory=dict)
    #: due capped jobs the claim parked itself (``lua/includes/gating.lua``): not in ``jobs``
    parked: int = 0


@dataclass(frozen=True)
class PushResult:
    """What one ``lua/push.lua`` call did on a shard (the push path, pushing on claim)."""

    shard: int
    now_ms: int
    next_ms: int | None
    #: the jobs returned to the beat, leased as ``claim`` leases them
    jobs: list[ClaimedJob]
    repaired: int
    #: how many jobs were pushed into their queues and removed
    pushed: int
    #: (lateness ms, count) of the pushed jobs: the server's time after the push - due
    lateness: list[tuple[int, int]]
    #: (queue, task, count) of the pushed jobs
    used: list[tuple[str, str, int]]
    #: job id -> the templates-hash field to fill for that job's shape
    misses: dict[str, str]
    #: due capped jobs the call parked itself (``lua/includes/gating.lua``): not in ``jobs``
    parked: int = 0


#: Most templates a shard's ``wire`` hash takes (one per job shape and beat settings): past it,
#: new shapes go the beat's way (``lua/push.lua``), so a header unique to each job cannot grow it.
MAX_STORED_TEMPLATES = 1000
#: Most shapes a shard's shapes hash holds (one per task, options and producer process seen since
#: the shard was last empty); past it, lua/enqueue.lua stores jobs whole.
MAX_STORED_SHAPES = 1000
#: Most shapes a process keeps read (they never change: an id names one text).
MAX_KEPT_SHAPES = 10_000
#: Envelopes whose shape names one of these are stored whole (lua/push.lua leaves them to the beat
#: by their shape, which it must then see).
_KEEP_WHOLE = (GATE_HEADER, BATCH_DONE_HEADER)
#: How long (ms) a shard's ``wire`` hash lives after the last template added to it. A job's shape
#: names its producer (origin, reply-to), so each producer process adds its own shapes; the hash
#: of a shard that takes no new shape for a day is dropped and refilled on demand, and a full one
#: is dropped a day after it filled.
TEMPLATES_TTL_MS = 86_400_000


@dataclass(frozen=True)
class JobRecord:
    """One stored job as ``get``/``pending`` see it."""

    id: str
    shard: int
    due_ms: int
    envelope: str
    state: str  # "waiting", "leased", "gated", "running" or "dead" (see _lease_state)
    tries: int = 0
    lease_until_ms: int | None = None


@dataclass(frozen=True)
class StoreOverview:
    """Counts over all shards (:meth:`Store.overview`)."""

    stored: int  # waiting + leased
    overdue: int  # score <= now (leased jobs count at their lease expiry)
    leased: int
    dead: int
    lateness: dict[str, str]  # the lateness hash asked for, as stored (empty when not asked)
    dropped: int = 0  # stale copies workers dropped at their start (lua/start.lua), all shards


@dataclass(frozen=True)
class ShardStats:
    """One shard's counts as ``lua/stats.lua`` reads them (times in ms, server clock)."""

    shard: int
    now_ms: int
    stored: int  # waiting + every job with a lease entry
    entries: int  # lease entries: leased + running + gated
    dead: int
    schedules: int
    overdue: int  # due (score <= now) and held by no live lease
    head_due_ms: int | None  # the overdue job a claim takes first: its (original) due time
    head_id: str | None
    next_due_ms: int | None  # the waiting job due soonest after now
    next_id: str | None
    running: int = 0  # released gated jobs whose task is published or runs (slots taken)
    gated_slot: int = 0  # parked: their capped key is full
    gated_paused: int = 0  # parked: their key is paused
    gated_batch: int = 0  # batch completion jobs waiting for their batch's members
    gated_rate: int = 0  # deferred by their key's rate

    @property
    def waiting(self) -> int:
        """Jobs with no lease entry: due or not, no beat holds them."""
        return self.stored - self.entries

    @property
    def gated(self) -> int:
        """Jobs the gate holds back (parked or deferred): no beat holds them."""
        return self.gated_slot + self.gated_paused + self.gated_batch + self.gated_rate

    @property
    def leased(self) -> int:
        """Jobs a beat holds (claimed, not yet acked): being delivered, or held by a beat that
        died until their lease expires."""
        return max(self.entries - self.running - self.gated, 0)


#: The state of a job by its lease token, for the tokens of flow control (:mod:`..flow.gate`).
_GATE_STATES = {GATE_TOKEN: "gated", RUN_TOKEN: "running"}


def _lease_state(lease: str) -> str:
    """A stored job's state by its (readable) lease entry: "gated" (held back by the gate:
    parked or deferred), "running" (a released gated job whose task runs) or "leased" (a beat
    holds it).

    >>> _lease_state("17|1|gate"), _lease_state("17|2|run"), _lease_state("17|2|beat:1:ab")
    ('gated', 'running', 'leased')
    """
    return _GATE_STATES.get(lease.rsplit("|", 1)[-1], "leased")


def glob_escape(text: str) -> str:
    r"""``text`` with the characters Redis's glob patterns (``MATCH``) give a meaning escaped
    (``* ? [ ] \``), so that ``glob_escape(prefix) + "*"`` matches the ids beginning with
    ``prefix`` and no others.

    >>> print(glob_escape("r:7:[x]"), glob_escape("a*b?c\\d"))
    r:7:\[x\] a\*b\?c\\d
    """
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class IdSearch:
    """What :meth:`Store.search_ids` found: the stored jobs whose id begins with the prefix
    among the ``examined`` (about) it looked at, and where to go on (``resume``: the shard
    and its ``ZSCAN`` cursor; None: every shard was searched to its end)."""

    records: list[JobRecord]
    examined: int
    resume: tuple[int, int] | None


# -- flow control: what the gate scripts answer (see celery_delayq/flow/gate.py) -------------------


class GateDecision(enum.StrEnum):
    """What the gate did with one claimed gated job (``lua/gate.lua``)."""

    RELEASED = "released"  # a slot is taken: publish it, then hold it (running)
    PARKED = "parked"  # its key is full or paused: it waits in gate:wait:<key>
    DEFERRED = "deferred"  # its key's rate is spent: due again at until_ms
    HELD = "held"  # a check of a job whose message waits for a worker: held again, not published
    NOT_HELD = "not-held"  # this beat no longer holds it, or Redis refused the call (full): skip it


@dataclass(frozen=True)
class GateResult:
    job_id: str
    decision: GateDecision
    until_ms: int | None = None  # DEFERRED: when it is due again
    #: PARKED: slots of the key whose job is gone and that have not expired, as (id, expiry ms)
    suspects: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ReleaseResult:
    released: bool  # False: the slot was given back already (a double release: nothing done)
    promoted: int  # parked jobs of the key made due
    batch_done: bool  # this release completed its batch


@dataclass(frozen=True)
class KeyState:
    """One gate key as :meth:`Store.key_state` reads it."""

    key: str
    limit: int | None  # the limit in force: the override, else the last limit a job carried; None: no cap
    override: str | None  # the run-time override as stored: "<n>", "none" (no cap), or None
    running: int
    waiting: int  # parked
    paused: bool


@dataclass(frozen=True)
class BatchState:
    """One batch's counts (:meth:`Store.batch_state`)."""

    batch_id: str
    total: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    waiting: int  # total - running - succeeded - failed - cancelled
    done: bool
    created_ms: int
    expires_ms: int | None = None  # when the finished batch's record expires; None: kept

    def progress(self) -> dict[str, int]:
        return {
            "total": self.total,
            "waiting": self.waiting,
            "running": self.running,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }


_GATE_DECISIONS = {d.value: d for d in GateDecision}
#: Jobs per gate/hold/slot_renew call (each call's ARGV holds a few short strings a job).
GATE_CHUNK = 1000
#: The outcomes :meth:`Store.release` takes.
RELEASE_OUTCOMES = ("succeeded", "failed", "retry")


#: What each ``lua/gate_admin.lua`` operation changes, for :class:`StoreFull`'s message.
_GATE_ADMIN_WORDS = {"unlimit": "limit", "clear": "limit", "resume": "pause"}


def _int_or(raw: Any, default: int = 0) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default


def _gated_reply(raw: Sequence[Any]) -> tuple[int, dict[str, str]]:
    """``(parked, {id: key})`` of the gating part of a claim or push reply: ``{parked, id, key,
    ...}`` (``gate_claimed`` in ``lua/includes/gating.lua``)."""
    return int(raw[0]), {str(raw[i]): str(raw[i + 1]) for i in range(1, len(raw) - 1, 2)}


def refuse_point_id(job_id: str) -> None:
    """Raise :class:`ReservedTaskId` when ``job_id`` is a schedule's point id (``is_point_id``).

    >>> refuse_point_id("{nightly}@2026-01-01T00:00:00.000Z")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.ReservedTaskId: task id '{nightly}@2026-01-01T00:00:00.000Z' is reserved: ...
    >>> refuse_point_id("{nightly}@run-now-2026-01-01T00:00:00.000Z")  # not a point id
    """
    if is_point_id(job_id):
        name = job_id[1 : job_id.index("}")]
        raise ReservedTaskId(
            f"task id {job_id!r} is reserved: it is the form of an execution point of schedule "
            f"{name!r} ({{name}}@<time>), and a job stored under it would take the point's place and "
            f"stop the schedule; use another id (Schedules(app).run_now({name!r}) runs the "
            "schedule's task now)"
        )


@contextmanager
def refused_when_full(refused: str, not_stored: Sequence[str] = ()) -> Iterator[None]:
    """Raise :class:`StoreFull` (``refused`` says what was not written; ``not_stored``, the
    jobs of the call) when Redis refuses a write inside for memory; any other error as is.

    Every producer and operator write of the store goes through this (:meth:`Store._write`, the
    pipelined cancels, the plain commands that write), so each one refused by a full Redis
    raises the same error with the same advice. A refused script call wrote nothing: Redis
    refuses a script's first write that may grow memory when it was over ``maxmemory`` at the
    script's start, and never stops a script once it has written."""
    try:
        yield
    except REDIS_ERRORS as exc:
        full = _full_error(exc, refused, not_stored)
        if full is not None:
            raise full from exc
        raise


def _full_error(exc: BaseException, refused: str, not_stored: Sequence[str]) -> StoreFull | None:
    """The :class:`StoreFull` that :func:`refused_when_full` raises for ``exc``, or None."""
    if not is_oom(exc):
        return None
    ids = list(not_stored)
    return StoreFull([], ids, list(range(len(ids))), refused)


def _raise_store_full(
    jobs: Sequence[tuple[str, int, str]], owners: Sequence[Sequence[int]], results: Sequence[Any]
) -> None:
    """Raise :class:`StoreFull` when Redis refused any enqueue call for memory, naming the jobs
    of the calls that ran and of those it refused; raise any other error of a call as is.
    A refused call wrote nothing: Redis refuses a script's first write (HSETNX/HSET) when it
    was over maxmemory at the script's start, and never stops a script once it has written."""
    refused = [isinstance(result, Exception) and is_oom(result) for result in results]
    if not any(refused):
        for result in results:
            if isinstance(result, Exception):
                raise result
        return
    for result, full in zip(results, refused, strict=True):
        if isinstance(result, Exception) and not full:
            raise result
    not_stored = sorted(p for chunk, full in zip(owners, refused, strict=True) if full for p in chunk)
    stored = sorted(p for chunk, full in zip(owners, refused, strict=True) if not full for p in chunk)
    first = next(result for result, full in zip(results, refused, strict=True) if full)
    raise StoreFull([jobs[p][0] for p in stored], [jobs[p][0] for p in not_stored], not_stored) from first


def _shaped(args: list[Any], triples: list[tuple[str, int, str]]) -> None:
    """Append ``lua/enqueue.lua``'s arguments for ``(id, due ms, stored envelope)`` jobs of one
    shard to ``args``: the count of shapes, each shape's id and text once, then the triples, each
    envelope with its shape's id in place of its shape where it has one
    (:func:`~.envelope.shared_form`)."""
    shapes: dict[str, str] = {}
    out: list[Any] = []
    for job_id, due_ms, stored in triples:
        shared = shared_form(stored, _KEEP_WHOLE)
        if shared is not None:
            shape_id, shape, stored = shared
            shapes[shape_id] = shape
        out.extend((job_id, due_ms, stored))
    args.append(len(shapes))
    for item in shapes.items():
        args.extend(item)
    args.extend(out)


class Store:
    """One app's shards in one Redis deployment."""

    def __init__(
        self,
        config: DelayQConfig,
        client: Any | None = None,
        connect_timeout: float | None = None,
        socket_timeout: float | None = None,
    ) -> None:
        """The store of ``config``, through ``client`` or a client of its own
        (:func:`~celery_delayq.store.connection.make_client`, each connection attempt bounded by
        ``connect_timeout`` seconds and each reply by ``socket_timeout`` when given). A bad URL
        raises ``ValueError``."""
        self.config = config
        self.keys = KeySpace(config.prefix, config.shards)
        if client is None:
            client = make_client(config.url, config.cluster, connect_timeout, socket_timeout)
        self.client = client
        self._clock: tuple[int, float] | None = None  # (server ms, time.monotonic()) read together
        self._direct = DirectCalls.for_client(client)
        self._warned_past = False
        #: shape id -> shape (envelope.shared_form): an id names one text, so it is kept
        self._shapes: dict[str, str] = {}

    @classmethod
    def for_app(cls, app: Any, connect_timeout: float | None = None) -> Store:
        """The app's store (one per app and process, kept by the app's extension,
        :func:`~celery_delayq.config.extension`; redis-py pools are fork-safe).
        ``connect_timeout`` applies when this call makes it (the CLI's)."""
        ext = extension(app)
        store: Store | None = ext.parts.get("store")
        if store is None:
            store = ext.part(
                "store", lambda: cls(DelayQConfig.from_app(app), connect_timeout=connect_timeout)
            )
        return store

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    def _write(
        self,
        script: LuaScript,
        keys: Sequence[str],
        args: Sequence[Any],
        refused: str,
        not_stored: Sequence[str] = (),
    ) -> Any:
        """Run one producer-side script (it stores or removes a job, a schedule, a batch or a
        limit); with ``delayq_wait_replicas``, only return once that many replicas have it
        (``WAIT``). Refused by a full Redis: :class:`StoreFull` (:func:`refused_when_full`, written
        out: this is every producer call's path, and the generator costs a few µs a call)."""
        try:
            if self.config.wait_replicas:
                call = ScriptCall(script, keys, args)
                return run_replicated(self.client, [call], self.config.wait_replicas)[0]
            direct = self._direct
            if direct is not None and direct.client is self.client:
                return direct.call(script, keys, args)
            return script(self.client, keys, args)
        except REDIS_ERRORS as exc:
            full = _full_error(exc, refused, not_stored)
            if full is not None:
                raise full from exc
            raise

    def _write_outcome(
        self, script: str, table: Sequence[_Code], keys: Sequence[str], args: Sequence[Any], refused: str
    ) -> _Code:
        """:meth:`_write` of ``lua/<script>.lua``, its reply decoded by ``table`` (:func:`_decode`)."""
        return _decode(script, table, self._write(SCRIPTS[script], keys, args, refused))

    # -- producers -------------------------------------------------------------------------

    def enqueue(
        self, jobs: Sequence[tuple[str, int, str]], replace: bool = False, relative: bool = False
    ) -> list[tuple[EnqueueOutcome, int]]:
        """Store ``(id, due ms, envelope)`` jobs; return ``(outcome, due ms)`` for each, in order.

        Jobs are grouped by shard, ``ENQUEUE_CHUNK`` a call, and all calls go
        in one pipeline. With ``relative``,
        each due is a delay in ms that the script adds to its server's ``TIME`` (``apply_in``,
        ``countdown``): the returned due is that stored time. Otherwise each due is a time,
        and one far in the past of the server's clock is logged once (``delayq_past_warning``).
        An id of the form of a schedule's execution point raises :class:`ReservedTaskId`
        and nothing is stored.
        """
        mode = "replace" if replace else "keep"
        clock = "in" if relative else "at"
        channel = self.keys.wake_channel
        if len(jobs) == 1:  # one script call: no pipeline around it
            job_id, due_ms, envelope = jobs[0]
            refuse_point_id(job_id)
            shard = self.keys.shard_of(job_id)
            keys = self.keys.shard(shard)
            due_ms = int(due_ms)
            one: list[Any] = [mode, channel, shard, clock]
            _shaped(one, [(job_id, due_ms, stored_form(job_id, envelope))])
            now, status, due = self._write(SCRIPTS["enqueue"], keys.with_shapes, one, "", (job_id,))
            now = int(now)
            self._saw_server_time(now)
            if not relative:
                self._check_past(now, [(job_id, due_ms)])
            return [(_decode("enqueue", _ENQUEUE, status), int(due))]
        by_shard: dict[int, list[int]] = defaultdict(list)
        shards, crc32 = self.keys.shards, zlib.crc32
        for position, (job_id, _, _) in enumerate(jobs):
            # keys.shard_of, inline for the ids without a hash tag
            if "{" in job_id:
                refuse_point_id(job_id)
                shard = shard_of(job_id, shards)
            else:
                shard = crc32(job_id.encode()) % shards
            by_shard[shard].append(position)
        calls: list[ScriptCall] = []
        owners: list[list[int]] = []
        for shard, positions in by_shard.items():
            shard_keys = self.keys.shard(shard)
            enqueue_keys = shard_keys.with_shapes
            for start in range(0, len(positions), ENQUEUE_CHUNK):
                chunk = positions[start : start + ENQUEUE_CHUNK]
                args: list[Any] = [mode, channel, shard, clock]
                triples: list[tuple[str, int, str]] = []
                for p in chunk:
                    job_id, due_ms, envelope = jobs[p]
                    triples.append((job_id, int(due_ms), stored_form(job_id, envelope)))
                _shaped(args, triples)
                calls.append(ScriptCall(SCRIPTS["enqueue"], enqueue_keys, args))
                owners.append(chunk)
        out: list[tuple[EnqueueOutcome, int]] = [(EnqueueOutcome.KEPT, 0)] * len(jobs)
        if self.config.wait_replicas:
            results = run_replicated(self.client, calls, self.config.wait_replicas, raise_errors=False)
        else:
            results = run_pipelined(self.client, calls, raise_errors=False)
        _raise_store_full(jobs, owners, results)
        now = 0
        for chunk, result in zip(owners, results, strict=True):
            now = int(result[0])
            pairs = iter(result[1:])
            for p, status, due in zip(chunk, pairs, pairs, strict=True):
                out[p] = (_decode("enqueue", _ENQUEUE, status), int(due))
        if calls:
            self._saw_server_time(now)
            if not relative:
                self._check_past(now, [(job_id, int(due_ms)) for job_id, due_ms, _ in jobs])
        return out

    # -- the server's clock ----------------------------------------------------------------

    def _saw_server_time(self, server_ms: int) -> None:
        """Remember the server's ``TIME`` read now (by a script), with this process's monotonic
        clock: :meth:`server_now_ms` counts from it."""
        self._clock = (server_ms, time.monotonic())

    def server_now_ms(self) -> int:
        """The Redis server's now, in ms: the last ``TIME`` a script returned (or a ``TIME``
        command, when there is none younger than ``SERVER_CLOCK_MAX_AGE`` seconds) plus the time
        elapsed since on this process's monotonic clock, which a change of the wall clock does
        not move. What a job's envelope counts a relative expiry from, and what a schedule's
        first run is computed from; the due time of ``apply_in`` is counted by the script."""
        clock = self._clock
        if clock is None or time.monotonic() - clock[1] > SERVER_CLOCK_MAX_AGE:
            seconds, micros = self.client.time()
            clock = (int(seconds) * 1000 + int(micros) // 1000, time.monotonic())
            self._clock = clock
        return clock[0] + int((time.monotonic() - clock[1]) * 1000)

    def _check_past(self, server_ms: int, jobs: Sequence[tuple[str, int]]) -> None:
        """Log once (per store, so per app and process) a job due more than
        ``delayq_past_warning`` seconds before the server's now: likely a producer whose clock
        is wrong (an ``apply_at`` computed from ``time.time()``)."""
        limit = self.config.past_warning
        if limit is None or self._warned_past or not jobs:
            return
        job_id, due_ms = jobs[0] if len(jobs) == 1 else min(jobs, key=lambda job: job[1])
        behind = (server_ms - due_ms) / 1000.0
        if behind <= limit:
            return
        self._warned_past = True
        skew = time.time() - server_ms / 1000.0
        logger.warning(
            "delayq: job %s was given a due time %.0f s before the Redis server's now (more than "
            "delayq_past_warning = %g s); it runs at once. This process's clock differs from the "
            "server's by %+.1f s: if that is large, this producer's clock is wrong. (Logged once "
            "per process.)",
            job_id,
            behind,
            limit,
            skew,
        )

    # -- beats -------------------------------------------------------------------------------

    def claim(
        self,
        shards: Iterable[int],
        token: str,
        batch: int | None = None,
        failed: list[Exception] | None = None,
        gating: bool | None = None,
    ) -> list[ClaimResult]:
        """Lease up to ``batch`` due jobs from each of ``shards`` (one round trip).

        With ``failed`` (a list), a shard whose claim failed (its cluster node is down) is
        left out of the results and its error appended, instead of raising: the jobs the
        other shards leased are returned, to be published now rather than after their lease.

        With ``gating`` (True or False), the claim gates the due capped jobs it can
        (``lua/includes/gating.lua``): a job it gave a slot comes back with its ``gate_key``,
        one it parked does not come back (counted in ``parked``); ``gating`` says whether it may
        park (False: a job of a full key comes back, for the gate to park). None: no gating.
        """
        shard_list = list(shards)
        batch = batch or self.config.batch_size
        ttl_ms = int(self.config.reclaim_ttl * 1000)
        calls = [
            ScriptCall(
                SCRIPTS["claim"], self.keys.shard(s).core, [token, batch, ttl_ms, *self._gating(s, gating)]
            )
            for s in shard_list
        ]
        results: list[ClaimResult] = []
        raws = run_pipelined(self.client, calls, raise_errors=failed is None)
        for shard, raw in zip(shard_list, raws, strict=True):
            if isinstance(raw, Exception):
                assert failed is not None
                failed.append(raw)
                continue
            next_ms = int(raw[1])
            next_due = None if next_ms < 0 else next_ms
            if gating is None:
                results.append(ClaimResult(shard, int(raw[0]), next_due, self._claimed(raw, 3), int(raw[2])))
                continue
            parked, released = _gated_reply(raw[3])
            jobs = self._claimed(raw, 4, released)
            results.append(ClaimResult(shard, int(raw[0]), next_due, jobs, int(raw[2]), parked=parked))
        return results

    def _gating(self, shard: int, gating: bool | None) -> list[Any]:
        """The gating arguments of a claim or push call on ``shard`` (``gating_args`` in
        ``lua/includes/gating.lua``): none when ``gating`` is None."""
        if gating is None:
            return []
        ttl_ms = int(self.config.slot_ttl * 1000)
        park = "1" if gating else "0"
        return [ttl_ms, park, self.keys.wake_channel, shard, GATE_HEADER, BATCH_DONE_HEADER]

    def push(
        self,
        shards: Iterable[int],
        token: str,
        push_args: Sequence[Any],
        failed: list[tuple[int, Exception]] | None = None,
        gating: bool | None = None,
    ) -> list[PushResult]:
        """The push path on claim: on each of ``shards``, push the due jobs whose message has a
        template and remove them, and lease the others to ``token`` as :meth:`claim` does
        (``lua/push.lua``, one round trip). ``push_args``: the template space, the payload limit
        and the two header names; each call gets a delivery tag prefix of its own.

        With ``failed``, a shard whose call failed is left out and ``(shard, error)`` appended
        (as :meth:`claim`); a Redis over ``maxmemory`` fails the call with nothing written.
        ``gating``: as :meth:`claim`'s.
        """
        shard_list = list(shards)
        ttl_ms = int(self.config.reclaim_ttl * 1000)
        space, *rest = push_args
        # a delivery tag prefix of its own for each call (the script adds the job's id): kombu keys a
        # worker's unacked messages by their tag (two alike: one is lost on restore), and a retry
        # keeps its task's id
        calls = [
            ScriptCall(
                SCRIPTS["push"],
                self.keys.shard(s).core,
                [
                    token,
                    self.config.batch_size,
                    ttl_ms,
                    space,
                    str(uuid.uuid4())[:24],
                    *rest,
                    *self._gating(s, gating),
                ],
            )
            for s in shard_list
        ]
        results: list[PushResult] = []
        raws = run_pipelined(self.client, calls, raise_errors=failed is None)
        for shard, raw in zip(shard_list, raws, strict=True):
            if isinstance(raw, Exception):
                assert failed is not None
                failed.append((shard, raw))
                continue
            late, used, missed = raw[4], raw[5], raw[6]
            next_ms = int(raw[1])
            parked, released = (0, {}) if gating is None else _gated_reply(raw[7])
            results.append(
                PushResult(
                    shard, int(raw[0]), None if next_ms < 0 else next_ms,
                    self._claimed(raw, 7 if gating is None else 8, released), int(raw[2]),
                    int(raw[3]), [(int(late[k]), int(late[k + 1])) for k in range(0, len(late), 2)],
                    [(str(used[k]), str(used[k + 1]), int(used[k + 2])) for k in range(0, len(used), 3)],
                    dict(zip(missed[0::2], missed[1::2], strict=True)), parked,
                )
            )  # fmt: skip
        return results

    def _claimed(
        self, raw: list[Any], start: int, released: Mapping[str, str] | None = None
    ) -> list[ClaimedJob]:
        """The jobs a claim or push reply returns to the beat from ``raw[start]`` on: id,
        envelope, due ms and tries of each (``hand_over`` in ``lua/includes/claiming.lua``);
        ``released``: id -> gate key of the jobs the call gave a slot."""
        released = released or {}
        return [
            ClaimedJob(
                raw[i],
                self._loaded(raw[i], raw[i + 1]),
                int(raw[i + 2]),
                int(raw[i + 3]),
                released.get(raw[i]),
            )
            for i in range(start, len(raw), 4)
        ]

    def _loaded(self, job_id: str, stored: str) -> str:
        """The envelope of ``job_id`` from what the jobs hash keeps: its shape joined back
        (read from the shard's shapes hash the first time this process meets it: one ``HGET``)
        and its id (:func:`~.envelope.loaded_form`). A shape missing from the hash leaves the
        shape's id in the envelope, and decode_envelope says the shape is missing."""
        shape_id = shape_id_of(stored)
        if shape_id is not None:
            shape = self._shapes.get(shape_id)
            if shape is None:
                shape = self.client.hget(self.keys.shard(self.keys.shard_of(job_id)).shapes, shape_id)
                if shape is not None:
                    if len(self._shapes) >= MAX_KEPT_SHAPES:
                        self._shapes.clear()
                    self._shapes[shape_id] = shape
            stored = joined_form(stored, shape)
        return loaded_form(job_id, stored)

    def sweep_shapes(self) -> int:
        """Drop the shapes hash of every shard that holds no job (``lua/shapes_sweep.lua``: in one
        step, so a job stored at the same time keeps its shape); how many were dropped. The beats
        call it with the batch sweep (:meth:`sweep_batches`)."""
        calls = [
            ScriptCall(SCRIPTS["shapes_sweep"], shard.with_shapes, []) for shard in self.keys.all_shards()
        ]
        return sum(int(result) for result in run_pipelined(self.client, calls))

    def add_templates(self, templates: dict[int, dict[str, str]]) -> int:
        """Store message templates (``{shard: {field: template JSON or "-"}}``) for
        ``lua/push.lua``, unless the shard's hash holds :data:`MAX_STORED_TEMPLATES` already, and
        give the hash :data:`TEMPLATES_TTL_MS` to live; how many were stored. Two round trips;
        only a pass that met a new job shape calls it."""
        shards = [s for s, fields in templates.items() if fields]
        with self.client.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.hlen(self.keys.shard(shard).wire)
            sizes = pipe.execute()
        stored = 0
        with self.client.pipeline(transaction=False) as pipe:
            for shard, size in zip(shards, sizes, strict=True):
                if int(size) < MAX_STORED_TEMPLATES:
                    wire = self.keys.shard(shard).wire
                    pipe.hset(wire, mapping=templates[shard])
                    pipe.pexpire(wire, TEMPLATES_TTL_MS)
                    stored += len(templates[shard])
            pipe.execute()
        return stored

    def ack(self, token: str, ids_by_shard: dict[int, list[str]]) -> dict[str, bool]:
        """Remove delivered jobs still leased with ``token``; ``{id: removed}``."""
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        for shard, ids in ids_by_shard.items():
            for start in range(0, len(ids), ACK_CHUNK):
                chunk = ids[start : start + ACK_CHUNK]
                calls.append(ScriptCall(SCRIPTS["ack"], self.keys.shard(shard).core, [token, *chunk]))
                owners.append(chunk)
        removed: dict[str, bool] = {}
        for chunk, result in zip(owners, run_pipelined(self.client, calls), strict=True):
            removed.update({job_id: bool(r) for job_id, r in zip(chunk, result, strict=True)})
        return removed

    def renew(self, token: str, ids_by_shard: dict[int, list[str]]) -> tuple[dict[str, bool], int | None]:
        """Extend to the server's now + ``delayq_reclaim_ttl`` the leases ``token`` still holds
        (``lua/renew.lua``, one pipelined round trip, one call per shard chunk).

        Returns ``({id: held}, server now ms)``: a job not held (re-claimed by another beat,
        cancelled, replaced) must not be published. The time is the earliest "now" of the
        calls (on a Cluster each node reads its own clock, a few ms apart), so every renewed
        lease runs to at least that time + TTL. It is None when nothing was asked.
        """
        ttl_ms = int(self.config.reclaim_ttl * 1000)
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        for shard, ids in ids_by_shard.items():
            for start in range(0, len(ids), ACK_CHUNK):
                chunk = ids[start : start + ACK_CHUNK]
                calls.append(
                    ScriptCall(SCRIPTS["renew"], self.keys.shard(shard).core, [token, ttl_ms, *chunk])
                )
                owners.append(chunk)
        held: dict[str, bool] = {}
        now_ms: int | None = None
        for chunk, result in zip(owners, run_pipelined(self.client, calls), strict=True):
            now_ms = int(result[0]) if now_ms is None else min(now_ms, int(result[0]))
            held.update({job_id: bool(r) for job_id, r in zip(chunk, result[1:], strict=True)})
        return held, now_ms

    def push_claimed(
        self, token: str, items_by_shard: dict[int, list[tuple[str, str, str]]]
    ) -> dict[str, PushClaimedReply]:
        """Push ``(id, list key, message)`` into broker lists and remove the jobs, each only
        while ``token`` holds its lease (``lua/push_claimed.lua``; the broker must be this server).

        Returns ``{id: PushClaimedReply}``: pushed and removed, not held (nothing done), or refused
        with the error text of the push.
        """
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        for shard, items in items_by_shard.items():
            for start in range(0, len(items), PUSH_CLAIMED_CHUNK):
                chunk = items[start : start + PUSH_CLAIMED_CHUNK]
                args: list[Any] = [token]
                for item in chunk:
                    args.extend(item)
                calls.append(ScriptCall(SCRIPTS["push_claimed"], self.keys.shard(shard).core, args))
                owners.append([job_id for job_id, _, _ in chunk])
        out: dict[str, PushClaimedReply] = {}
        for chunk_ids, result in zip(owners, run_pipelined(self.client, calls), strict=True):
            for job_id, reply in zip(chunk_ids, result, strict=True):
                if isinstance(reply, str):
                    out[job_id] = PushClaimedReply(PushClaimedOutcome.REFUSED, reply)
                else:
                    out[job_id] = _decode("push_claimed", _PUSH_CLAIMED, reply)
        return out

    def bury(self, token: str, job_id: str, record: dict[str, Any]) -> bool:
        """Move a job this ``token`` holds to the dead-letter hash with ``record``."""
        keys = self.keys.for_job(job_id).core
        return _decode("bury", _DONE, SCRIPTS["bury"](self.client, keys, [token, job_id, json.dumps(record)]))

    # -- by id -------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> CancelOutcome:
        """Remove a job (``lua/cancel.lua``)."""
        return self._write_outcome(
            "cancel", _CANCEL, self.keys.for_job(job_id).core, [job_id], f"job {job_id!r} not cancelled"
        )

    def cancel_many(self, shard: int, job_ids: Sequence[str]) -> list[CancelOutcome]:
        """Remove jobs of one shard, one ``lua/cancel.lua`` call each, in one pipeline (with
        ``delayq_wait_replicas``, once that many replicas have them); their outcomes in order."""
        core = self.keys.shard(shard).core
        calls = [ScriptCall(SCRIPTS["cancel"], core, [job_id]) for job_id in job_ids]
        replicas = self.config.wait_replicas
        with refused_when_full(f"{len(calls)} job(s) not cancelled"):
            if replicas:
                results = run_replicated(self.client, calls, replicas)
            else:
                results = run_pipelined(self.client, calls)
        return [_decode("cancel", _CANCEL, code) for code in results]

    def reschedule(self, job_id: str, due_ms: int) -> RescheduleOutcome:
        """Move a waiting job (``lua/reschedule.lua``)."""
        shard = self.keys.shard_of(job_id)
        args = [job_id, int(due_ms), self.keys.wake_channel, shard]
        return self._write_outcome(
            "reschedule", _RESCHEDULE, self.keys.shard(shard).core, args, f"job {job_id!r} not moved"
        )

    def get(self, job_id: str) -> JobRecord | None:
        """The job (or dead letter) with this id, or None."""
        shard = self.keys.shard_of(job_id)
        raw = SCRIPTS["get"](self.client, self.keys.shard(shard).core, [job_id])
        if raw is None:
            return None
        if raw[0] == "dead":
            try:
                record = load_json(raw[1], f"dead-letter record of {job_id!r}")
            except CorruptData as exc:
                record = {"envelope": "", "reason": str(exc)}
            return JobRecord(
                job_id,
                shard,
                int(record.get("due", 0)),
                record.get("envelope", ""),
                "dead",
                int(record.get("tries", 0)),
            )
        lease_until = int(raw[4])
        if lease_until < 0:
            state = "waiting"
        else:
            state = _GATE_STATES.get(raw[5], "leased") if len(raw) > 5 else "leased"
        return JobRecord(
            job_id,
            shard,
            int(raw[2]),
            self._loaded(job_id, raw[1]),
            state,
            int(raw[3]),
            lease_until if 0 <= lease_until < PARK_MS else None,  # a parked job has no expiry
        )

    # -- scans -------------------------------------------------------------------------------

    def count(self) -> int:
        """Jobs stored (waiting or leased) over all shards."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zcard(shard.due)
            return sum(int(n) for n in pipe.execute())

    def count_dead(self) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.hlen(shard.dead)
            return sum(int(n) for n in pipe.execute())

    def due_entries(
        self, shard: int, start_ms: Any, end_ms: Any, page: int = 500
    ) -> Iterator[tuple[str, int, str | None, str | None]]:
        """A shard's jobs whose score lies in ``[start_ms, end_ms]`` (ms, or ``"-inf"``/``"+inf"``),
        in score order: ``(id, score, envelope, lease)``. The envelope is None for a job removed
        meanwhile; the lease entry (as stored) is None for a job no beat holds. Read ``page``
        jobs at a time: one ``ZRANGE`` and one pipelined pair of ``HMGET`` a page."""
        offset = 0
        while True:
            members = self._due_page(shard, start_ms, end_ms, offset, page)
            yield from members
            if len(members) < page:
                return
            offset += page

    def _due_page(
        self, shard: int, start_ms: Any, end_ms: Any, offset: int, page: int
    ) -> list[tuple[str, int, str | None, str | None]]:
        keys = self.keys.shard(shard)
        members = self.client.zrange(
            keys.due, start_ms, end_ms, byscore=True, offset=offset, num=page, withscores=True
        )
        return self._entries(shard, members)

    def _entries(
        self, shard: int, members: Sequence[tuple[str, float]]
    ) -> list[tuple[str, int, str | None, str | None]]:
        """Due zset ``(id, score)`` members of one shard with their envelopes and lease entries
        (one pipelined pair of ``HMGET``): ``(id, score, envelope or None, lease or None)``."""
        if not members:
            return []
        keys = self.keys.shard(shard)
        ids = [m for m, _ in members]
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.jobs, ids)
            pipe.hmget(keys.leases, ids)
            envelopes, leases = pipe.execute()
        return [
            (job_id, int(score), None if envelope is None else self._loaded(job_id, envelope), lease)
            for (job_id, score), envelope, lease in zip(members, envelopes, leases, strict=True)
        ]

    def _scan_shard(self, index: int, start_ms: Any, end_ms: Any, page: int) -> Iterator[JobRecord]:
        for job_id, score, envelope, lease in self.due_entries(index, start_ms, end_ms, page):
            if envelope is not None:
                yield self._record(index, job_id, score, envelope, lease)

    def scan(
        self,
        start_ms: float | None = None,
        end_ms: float | None = None,
        page: int = 500,
    ) -> Iterator[JobRecord]:
        """Every stored job whose score lies in ``[start_ms, end_ms]``, merged in due order.

        A leased job is ordered (and selected) by its lease expiry, and reports
        its original due time in ``due_ms``.
        """
        lo: Any = "-inf" if start_ms is None else int(start_ms)
        hi: Any = "+inf" if end_ms is None else int(end_ms)
        streams = [self._scan_shard(i, lo, hi, page) for i in range(self.keys.shards)]
        yield from heapq.merge(*streams, key=lambda r: r.lease_until_ms or r.due_ms)

    def search_ids(
        self,
        prefix: str,
        start: tuple[int, int] = (0, 0),
        budget: int = 200_000,
        count: int = 1000,
        keep: Callable[[JobRecord], bool] | None = None,
        enough: int | None = None,
    ) -> IdSearch:
        """The stored jobs (waiting or leased) whose id begins with ``prefix`` (and that
        ``keep`` keeps): a ``ZSCAN`` of each shard's due zset with ``MATCH <escaped prefix>*``
        and ``COUNT count``, from ``start`` (shard, cursor), until about ``budget`` ids were
        examined or ``enough`` jobs were found (it stops after the call that gets there: the
        records are those of the calls made, ``resume`` where to go on), or every shard was
        searched (``resume`` None). Records as :meth:`scan` gives them, in the order found (a
        zset's hash order; an id may come twice across resumed calls when Redis rehashes
        meanwhile; a job stored throughout is never missed)."""
        pattern = glob_escape(prefix) + "*"
        shard, cursor = start
        found: dict[str, JobRecord] = {}
        examined = 0
        size = -1  # the current shard's jobs, read on entering it
        while shard < self.keys.shards:
            keys = self.keys.shard(shard)
            if size < 0:
                size = int(self.client.zcard(keys.due))
            cursor, members = self.client.zscan(keys.due, cursor, match=pattern, count=count)
            examined += min(count, size)  # a small zset answers whole in one call
            for job_id, score, envelope, lease in self._entries(shard, members):
                if envelope is not None:
                    record = self._record(shard, job_id, score, envelope, lease)
                    if keep is None or keep(record):
                        found[job_id] = record
            if cursor == 0:
                shard, size = shard + 1, -1
            if examined >= budget or (enough is not None and len(found) >= enough):
                break
        resume = (shard, int(cursor)) if shard < self.keys.shards else None
        return IdSearch(list(found.values()), examined, resume)

    @staticmethod
    def _record(index: int, job_id: str, score: int, envelope: str, lease: str | None) -> JobRecord:
        """One due zset entry, its envelope (``loaded_form``) and its lease entry (as stored, None:
        no beat holds it) as a :class:`JobRecord`."""
        parsed = None if lease is None else parse_lease(lease)
        if parsed is not None:
            due, tries = parsed
            until = score if score < PARK_MS else None  # a parked job has no expiry
            return JobRecord(job_id, index, due, envelope, _lease_state(lease or ""), tries, until)
        if lease is not None:  # a lease entry that does not read: a claim replaces it
            return JobRecord(job_id, index, score, envelope, "leased", 0, score)
        return JobRecord(job_id, index, score, envelope, "waiting")

    def scan_after(
        self, after: tuple[int, int, bytes], end_ms: float | None = None, page: int = 500
    ) -> Iterator[JobRecord]:
        """:meth:`scan` from just after the job ``after`` names (its score, shard and id, as a
        listing's cursor holds them) up to ``end_ms``: each shard starts past its jobs of a lower
        score, or in the named job's shard by that job's rank (``ZRANK``), so that going on
        costs O(log n) a shard however many jobs share a score. A job removed or moved since is
        started from by score (its shard may then repeat jobs of that score: the caller skips
        what is not after ``after``)."""
        score, at_shard, job_id = after
        hi: Any = "+inf" if end_ms is None else int(end_ms)
        streams = [
            self._scan_shard(i, f"({score}" if i < at_shard else score, hi, page)
            if i != at_shard
            else self._scan_shard_after(i, score, job_id, hi, page)
            for i in range(self.keys.shards)
        ]
        yield from heapq.merge(*streams, key=lambda r: r.lease_until_ms or r.due_ms)

    def _scan_shard_after(
        self, index: int, score: int, job_id: bytes, end_ms: Any, page: int
    ) -> Iterator[JobRecord]:
        due = self.keys.shard(index).due
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zscore(due, job_id)
            pipe.zrank(due, job_id)
            at, rank = pipe.execute()
        if at is None or rank is None or int(at) != score:
            yield from self._scan_shard(index, score, end_ms, page)
            return
        last = math.inf if end_ms == "+inf" else int(end_ms)
        start = int(rank) + 1
        while True:
            members = self.client.zrange(due, start, start + page - 1, withscores=True)
            inside = [(member, s) for member, s in members if s <= last]
            for member, s, envelope, lease in self._entries(index, inside):
                if envelope is not None:
                    yield self._record(index, member, s, envelope, lease)
            if len(inside) < page:
                return
            start += page

    def shard_stats(self) -> list[ShardStats]:
        """Counts, overdue head and next due job of every shard (``lua/stats.lua``, one round trip).

        Cheap whatever the size of the store: O(log n) a shard, plus one step per lease held,
        and one per gate key, paused key and batch (what gated jobs wait for is counted per
        key, never per job).
        """
        calls = [ScriptCall(SCRIPTS["stats"], shard.core, []) for shard in self.keys.all_shards()]
        out: list[ShardStats] = []
        for index, raw in enumerate(run_pipelined(self.client, calls)):
            now, stored, leased, dead, schedules, overdue, head_due, head_id, next_due, next_id = raw[:10]
            running, slot, paused, batch, rate = (int(n) for n in raw[10:15])
            out.append(
                ShardStats(
                    index,
                    int(now),
                    int(stored),
                    int(leased),
                    int(dead),
                    int(schedules),
                    int(overdue),
                    int(head_due) if head_id else None,
                    head_id or None,
                    int(next_due) if next_id else None,
                    next_id or None,
                    running,
                    slot,
                    paused,
                    batch,
                    rate,
                )
            )
        return out

    def due_counts(self, start_ms: int, bucket_ms: int, buckets: int) -> list[int]:
        """Jobs whose score lies in each of ``buckets`` spans of ``bucket_ms`` from ``start_ms``
        (``[start, start + bucket)``, ...), over all shards. A job being delivered counts at its
        lease expiry. :meth:`due_count_series` of one series."""
        return self.due_count_series([(start_ms, bucket_ms, buckets)])[0]

    def due_count_series(self, series: Sequence[tuple[int, int, int]]) -> list[list[int]]:
        """:meth:`due_counts` of each ``(start_ms, bucket_ms, buckets)`` of ``series``, over all
        shards: one ``lua/due_counts.lua`` a shard (a ``ZCOUNT`` a span inside it), all shards
        in one pipeline, so the client sends one command a shard whatever the spans."""
        series = [(int(start), int(bucket), int(n)) for start, bucket, n in series]
        if not any(n > 0 for _, _, n in series):
            return [[] for _ in series]
        args = [v for start, bucket, n in series if n > 0 for v in (start, bucket, n)]
        calls = [ScriptCall(SCRIPTS["due_counts"], [shard.due], args) for shard in self.keys.all_shards()]
        totals = [0] * sum(n for _, _, n in series if n > 0)
        for counts in run_pipelined(self.client, calls):
            for i, n in enumerate(counts):
                totals[i] += int(n)
        out: list[list[int]] = []
        at = 0
        for _, _, n in series:
            if n <= 0:
                out.append([])
                continue
            out.append(totals[at : at + n])
            at += n
        return out

    def dead_record(self, job_id: str) -> dict[str, Any] | None:
        """The dead-letter record of ``job_id`` (reason, task, due, tries, dead_at, beat,
        envelope), or None."""
        raw = self.client.hget(self.keys.for_job(job_id).dead, job_id)
        if raw is None:
            return None
        record: dict[str, Any] = load_json(raw, f"dead-letter record of {job_id!r}")
        return record

    def beats(self) -> dict[str, Any]:
        """What each beat last wrote into ``<prefix>:beats``: ``{token: decoded JSON}``
        (a value that is not JSON is returned as the string it is)."""
        out: dict[str, Any] = {}
        for token, raw in self.client.hgetall(self.keys.beats).items():
            try:
                out[token] = load_json(raw, "heartbeat", None, MAX_SMALL)
            except CorruptData:
                out[token] = raw
        return out

    def requeue(self, job_id: str, due_ms: int) -> RequeueOutcome:
        """Put a dead-lettered job back as a waiting job due at ``due_ms``, removing its dead
        letter, atomically (``lua/requeue.lua``)."""
        shard = self.keys.shard_of(job_id)
        args = [job_id, int(due_ms), id_opening(job_id), self.keys.wake_channel, shard]
        return self._write_outcome(
            "requeue", _REQUEUE, self.keys.shard(shard).core, args, f"dead letter {job_id!r} not requeued"
        )

    def dead(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every dead-lettered job: ``(id, record)``."""
        for shard in range(self.keys.shards):
            for job_id, raw in self.dead_in_shard(shard):
                try:
                    yield job_id, load_json(raw, f"dead-letter record of {job_id!r}")
                except CorruptData as exc:  # listed with the reason, never ends the listing
                    yield job_id, {"reason": str(exc), "envelope": ""}

    def dead_in_shard(self, shard: int, page: int | None = None) -> Iterator[tuple[str, str]]:
        """The dead letters of one shard as stored: ``(id, record JSON)`` (``HSCAN``, about
        ``page`` a call)."""
        yield from self.client.hscan_iter(self.keys.shard(shard).dead, count=page)

    def delete_dead(self, job_id: str) -> bool:
        """Forget a dead-lettered job; False when there was no dead letter with this id."""
        return bool(self.client.hdel(self.keys.for_job(job_id).dead, job_id))

    def delete_all_dead(self, page: int = 1000) -> int:
        """Forget every dead letter (``HSCAN`` and ``HDEL`` a page at a time); how many were
        removed."""
        client = self.client
        removed = 0
        for shard in self.keys.all_shards():
            batch: list[str] = []
            for job_id, _ in client.hscan_iter(shard.dead, count=page):
                batch.append(job_id)
                if len(batch) >= page:
                    removed += int(client.hdel(shard.dead, *batch))
                    batch = []
            if batch:
                removed += int(client.hdel(shard.dead, *batch))
        return removed

    # -- one shard, by rank and by id --------------------------------------------------------

    def due_ids(self, shard: int, start: int, stop: int) -> list[str]:
        """The ids of a shard's jobs of rank ``start`` to ``stop`` (inclusive) in due order."""
        ids: list[str] = self.client.zrange(self.keys.shard(shard).due, start, stop)
        return ids

    def due_count(self, shard: int) -> int:
        """Jobs stored (waiting or leased) in one shard."""
        return int(self.client.zcard(self.keys.shard(shard).due))

    def envelopes(self, shard: int, job_ids: Sequence[str]) -> list[str | None]:
        """The envelopes of jobs of one shard, in order; None for an id not stored."""
        if not job_ids:
            return []
        raws = self.client.hmget(self.keys.shard(shard).jobs, list(job_ids))
        return [
            None if raw is None else self._loaded(job_id, raw)
            for job_id, raw in zip(job_ids, raws, strict=True)
        ]

    def are_stored(self, shard: int, job_ids: Sequence[str]) -> list[bool]:
        """Is each of these ids a stored job (waiting or leased) of the shard? One pipeline."""
        jobs = self.keys.shard(shard).jobs
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hexists(jobs, job_id)
            return [bool(there) for there in pipe.execute()]

    def leased(self, shard: int) -> list[tuple[str, int, int, str]]:
        """The jobs of one shard with a lease entry: ``(id, original due ms, tries, state)``,
        state ``"leased"`` (a beat holds it), ``"gated"`` or ``"running"`` (flow control); a
        lease entry that does not read (the next claim replaces it) is left out."""
        out: list[tuple[str, int, int, str]] = []
        for job_id, lease in self.client.hgetall(self.keys.shard(shard).leases).items():
            parsed = parse_lease(lease)
            if parsed is not None:
                out.append((job_id, *parsed, _lease_state(lease)))
        return out

    def envelopes_and_scores(self, shard: int, job_ids: Sequence[str]) -> list[tuple[str | None, int | None]]:
        """``(envelope, score)`` of jobs of one shard, in order (a leased job's score is its
        lease expiry); None for what is not stored. One round trip."""
        if not job_ids:
            return []
        keys = self.keys.shard(shard)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.jobs, list(job_ids))
            for job_id in job_ids:
                pipe.zscore(keys.due, job_id)
            raws, *scores = pipe.execute()
        return [
            (None if raw is None else self._loaded(job_id, raw), None if score is None else int(score))
            for job_id, raw, score in zip(job_ids, raws, scores, strict=True)
        ]

    def overview(self, now_ms: int, lateness_key: str | None = None) -> StoreOverview:
        """Counts over all shards in one pipeline (``ZCARD``, ``ZCOUNT`` up to ``now_ms``,
        ``HLEN`` of leases and dead letters, ``GET`` of the copies dropped at start), with the hash
        ``lateness_key`` read alongside."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zcard(shard.due)
                pipe.zcount(shard.due, "-inf", now_ms)
                pipe.hlen(shard.leases)
                pipe.hlen(shard.dead)
                pipe.get(shard.dropped)
            if lateness_key is not None:
                pipe.hgetall(lateness_key)
            replies = pipe.execute()
        extra: dict[str, str] = (replies.pop() or {}) if lateness_key is not None else {}
        return StoreOverview(
            stored=sum(int(n) for n in replies[0::5]),
            overdue=sum(int(n) for n in replies[1::5]),
            leased=sum(int(n) for n in replies[2::5]),
            dead=sum(int(n) for n in replies[3::5]),
            lateness=extra,
            dropped=sum(_int_or(n) for n in replies[4::5]),
        )

    # -- recurring schedules -----------------------------------------------------------------

    def put_schedule(
        self, name: str, mode: str, definition: str, point: tuple[str, int, str], stalled: str = ""
    ) -> bool:
        """Store a schedule's definition (JSON) and its next ``point`` ``(id, due ms,
        envelope)``, or none when the id is empty (``lua/sched_put.lua``). ``mode`` is
        ``"add"`` (refused when the name exists), ``"put"`` or ``"update"``; with ``stalled``,
        only while the schedule still waits for that point and it is not stored. True when
        it was stored."""
        shard = self.keys.shard_of("{" + name + "}")
        args: list[Any] = [name, mode, definition, *point, self.keys.wake_channel, shard]
        if stalled:
            args.append(stalled)
        return self._write_outcome(
            "sched_put", _PUT, self.keys.shard(shard).core, args, f"schedule {name!r} not stored"
        )

    def delete_schedule(self, name: str) -> bool:
        """Delete a schedule and its waiting point (``lua/sched_del.lua``); False when there
        was none."""
        shard = self.keys.shard_of("{" + name + "}")
        return self._write_outcome(
            "sched_del", _DONE, self.keys.shard(shard).core, [name], f"schedule {name!r} not deleted"
        )

    def schedule(self, name: str) -> tuple[str | None, str | None]:
        """A schedule's definition and run state as stored (JSON), each None when absent."""
        shard = self.keys.shard(self.keys.shard_of("{" + name + "}"))
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(shard.schedules, name)
            pipe.hget(shard.history, name)
            definition, state = pipe.execute()
        return definition, state

    def schedule_page(
        self, shard: int, cursor: int, page: int
    ) -> tuple[int, list[tuple[str, str, str | None]]]:
        """One ``HSCAN`` step over a shard's schedules from ``cursor``, with their run states:
        ``(next cursor, [(name, definition, state)])``; the next cursor is 0 at the end."""
        keys = self.keys.shard(shard)
        cursor, found = self.client.hscan(keys.schedules, cursor, count=page)
        if not found:
            return int(cursor), []
        names = list(found)
        states = self.client.hmget(keys.history, names)
        return int(cursor), list(zip(names, found.values(), states, strict=True))

    def may_hold_schedules(self) -> bool:
        """Whether any shard may hold a schedule definition: on one server, one ``EXISTS`` of
        every shard's hash; on a Cluster (keys of many slots), or for a user whose ACL has no
        ``EXISTS`` (the rule of an older version), always True."""
        return self._any_exists([shard.schedules for shard in self.keys.all_shards()])

    def _any_exists(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` (one per shard) may exist: one ``EXISTS`` on one server; on a
        Cluster (keys of many slots), or for a user whose ACL has no ``EXISTS``, always True."""
        if self.is_cluster:
            return True
        try:
            return int(self.client.exists(*keys)) > 0
        except redis.exceptions.NoPermissionError:
            return True

    def kept_counts(self, names: Sequence[str]) -> list[dict[str, Any] | None]:
        """What :meth:`keep_counts` kept under each of ``names`` and has not expired (one
        pipeline of ``GET``: the keys may lie on different nodes of a cluster), None where
        nothing is kept or it does not read."""
        if not names:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(self.keys.web_counts(name))
            raws = pipe.execute()
        out: list[dict[str, Any] | None] = []
        for raw in raws:
            try:
                out.append(load_json(raw, "kept counts", dict, MAX_SMALL) if raw is not None else None)
            except CorruptData:
                out.append(None)
        return out

    def keep_counts(self, name: str, value: Mapping[str, Any], ttl_ms: int) -> None:
        """Keep ``value`` (JSON) under ``name`` for ``ttl_ms`` for every reader of the store
        (``SET ... PX``); a store that is full or a user refused ``SET`` keeps nothing."""
        with contextlib.suppress(redis.exceptions.ResponseError):
            self.client.set(self.keys.web_counts(name), json.dumps(value, separators=(",", ":")), px=ttl_ms)

    def forget_counts(self, names: Sequence[str]) -> None:
        """Drop what :meth:`keep_counts` kept under ``names``: the next reader reads again.
        ``PEXPIRE key 0`` deletes the key, within the store's ACL rule (which has no ``DEL``)."""
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.pexpire(self.keys.web_counts(name), 0)
            pipe.execute()

    def nav_counts(self) -> dict[str, int]:
        """Jobs stored, schedules, dead letters and gate keys over all shards, in one pipeline of
        ``ZCARD``/``HLEN`` a shard (4 commands a shard, whatever is stored): the dashboard's
        navigation counts."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zcard(shard.due)
                pipe.hlen(shard.schedules)
                pipe.hlen(shard.dead)
                pipe.hlen(shard.gate_keys)
            replies = [int(n) for n in pipe.execute()]
        names = ("jobs", "schedules", "dead", "keys")
        return {name: sum(replies[i :: len(names)]) for i, name in enumerate(names)}

    def count_schedules(self) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.hlen(shard.schedules)
            return sum(int(n) for n in pipe.execute())

    def config_schedule_names(self) -> set[str]:
        """The names in the registry of schedules that came from ``beat_schedule``."""
        names: set[str] = self.client.smembers(self.keys.config_registry)
        return names

    def mark_config_schedule(self, name: str, mark: bool = True) -> None:
        """Add ``name`` to the registry of ``beat_schedule`` schedules (remove it: ``mark``
        false)."""
        with refused_when_full(f"registry of beat_schedule schedules: {name!r} not recorded"):
            if mark:
                self.client.sadd(self.keys.config_registry, name)
            else:
                self.client.srem(self.keys.config_registry, name)

    # -- server ------------------------------------------------------------------------------

    def check_server(self) -> list[str]:
        """Raise if the server cannot run the scripts; return warnings worth logging.

        A check the server refuses (an ACL user without ``INFO`` or ``CONFIG``, a managed
        Redis, a renamed command; see docs/security.md) is skipped, with a warning for the
        version check.
        """
        if self.is_cluster:
            return self._check_cluster()
        warnings: list[str] = []
        try:
            info = self.client.info("server")
        except redis.ResponseError as exc:  # NOPERM (a NoPermissionError) or unknown command
            warnings.append(
                f"cannot read INFO ({exc}): the server version was not checked "
                "(celery-delayq needs Redis 6.2 or newer, or Valkey)"
            )
            info = None
        problem = None if info is None else version_problem(info)
        if problem is not None:
            raise UnsupportedServer(problem)
        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.ResponseError:
            policy = None  # CONFIG disabled (managed Redis, ACL): nothing to say
        if policy and evicts_jobs(policy):
            warnings.append(
                f"Redis maxmemory-policy is {policy!r}: when used memory reaches maxmemory, Redis "
                "may evict scheduled jobs; set it to 'noeviction' (a full Redis then refuses new "
                "jobs with StoreFull while the beats go on delivering due ones, which frees memory)"
            )
        return warnings

    def _check_cluster(self) -> list[str]:
        """:meth:`check_server` on every primary of the cluster (each answers for itself)."""
        warnings: list[str] = []
        for node in self.client.get_primaries():
            one = Store(self.config, self.client.get_redis_connection(node))
            warnings.extend(f"{node.name}: {warning}" for warning in one.check_server())
        return warnings

    def ping(self) -> None:
        """Raise when the server cannot be reached (or refuses the credentials)."""
        self.client.ping()

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        self.client.close()

    # -- for the beat (dispatcher) --

    def wake_subscription(self) -> Any:
        """A pub/sub connection subscribed to the wake channel (``get_message``, ``close``).

        On a cluster, redis-py opens it on the node that its cached slot map says serves the
        channel's slot, and a connection error does not refresh that map: when the
        subscription fails, the map is read again (:meth:`refresh_slots`) before the error is
        raised, so that the next attempt goes to the slot's new owner after a failover.

        Returns once the server confirmed the subscription (redis-py's ``subscribe`` only sends
        it): a refusal (an ACL without the channel) raises here, and a job stored after this
        returns sends a wake message that the subscription hears."""
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(self.keys.wake_channel)
            deadline = time.monotonic() + SUBSCRIBE_TIMEOUT
            while True:
                message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None and message.get("type") == "subscribe":
                    break
                if time.monotonic() >= deadline:
                    raise redis.TimeoutError(f"SUBSCRIBE not confirmed in {SUBSCRIBE_TIMEOUT:.0f} s")
            pubsub.ignore_subscribe_messages = True
        except REDIS_ERRORS:
            with contextlib.suppress(*REDIS_ERRORS):
                pubsub.close()
            self.refresh_slots()
            raise
        return pubsub

    def refresh_slots(self) -> bool:
        """On a cluster, read the slot map again from the first node that answers
        (redis-py's ``NodesManager.initialize``: ``CLUSTER SLOTS``); whether it could. Never
        raises. A plain server has no map: False."""
        if not self.is_cluster:
            return False
        try:
            self.client.nodes_manager.initialize()
        except REDIS_ERRORS:
            return False
        return True

    def wake_markers(self) -> tuple[int, list[float | None]]:
        """The server's now (ms, ``TIME``) and every shard's wake marker (ms), read for the
        safety poll in one round trip: ``TIME`` and one ``MGET`` on one server (2 commands); on a
        Cluster, ``TIME`` of one node and a ``GET`` per shard, pipelined by node.

        A marker that is missing, or not a decimal number of ms (see :func:`read_marker`), is
        None: the shard must be claimed to know.
        """
        names = [shard.wake for shard in self.keys.all_shards()]
        if self.is_cluster:
            now = self.client.time()
            raws = self.client.mget_nonatomic(names)
        else:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.mget(names)
                now, raws = pipe.execute()
        return int(now[0]) * 1000 + int(now[1]) // 1000, [read_marker(raw) for raw in raws]

    def is_single_server(self) -> bool:
        """Whether the store is one plain Redis server (no cluster): the only case where it can
        also be a Redis broker and push messages itself (``lua/push_claimed.lua``)."""
        return isinstance(self.client, redis.Redis)

    def is_server_of(self, broker_client: Any) -> bool:
        """Whether ``broker_client`` (a kombu channel's redis client) talks to this store's
        server (``run_id``), database and user. A user that may not run ``INFO`` answers False."""
        broker_kw = broker_client.connection_pool.connection_kwargs
        store_kw = self.client.connection_pool.connection_kwargs
        if int(broker_kw.get("db") or 0) != int(store_kw.get("db") or 0):
            return False
        if broker_kw.get("username") != store_kw.get("username"):
            return False
        try:
            broker_id = broker_client.info("server").get("run_id")
            return bool(broker_id == self.client.info("server").get("run_id"))
        except redis.ResponseError:  # INFO refused (ACL)
            return False

    def database(self) -> int:
        return int(self.client.connection_pool.connection_kwargs.get("db") or 0)

    def schedule_definitions(self, points: Sequence[tuple[int, str]]) -> list[str | None]:
        """The stored definitions (raw JSON, None when gone) of ``(shard, schedule name)``."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard, name in points:
                pipe.hget(self.keys.shard(shard).schedules, name)
            return list(pipe.execute())

    def fire(self, token: str, calls: Sequence[tuple[int, Sequence[Any]]]) -> list[FireOutcome]:
        """Run ``lua/fire.lua`` for each ``(shard, args after the token)`` (args: id, name,
        at_ms, published id, next id, next due, next envelope) in one pipeline; its answers
        in order."""
        script_calls = [
            ScriptCall(
                SCRIPTS["fire"], self.keys.shard(shard).core, [token, *args, self.keys.wake_channel, shard]
            )
            for shard, args in calls
        ]
        return [_decode("fire", _FIRE, result) for result in run_pipelined(self.client, script_calls)]

    def write_heartbeat(self, token: str, entry: Mapping[str, Any], read_all: bool) -> dict[str, str] | None:
        """Set ``token``'s entry of ``<prefix>:beats``; with ``read_all``, return the whole hash
        (in the same round trip)."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.beats, token, json.dumps(entry, separators=(",", ":")))
            if read_all:
                pipe.hgetall(self.keys.beats)
            replies = pipe.execute()
        return dict(replies[1]) if read_all else None

    def forget_beats(self, *tokens: str) -> None:
        """Remove the entries of ``tokens`` from ``<prefix>:beats``."""
        if tokens:
            self.client.hdel(self.keys.beats, *tokens)

    def add_lateness(self, key: str, fields: Mapping[str, float], minute: int | None = None) -> None:
        """Add a lateness histogram's counts (:mod:`.lateness`) to the hash ``key`` and, in the
        same pipeline, to the hash of ``minute`` (epoch minute; default: the server's now), which
        expires an hour after that minute ends (:func:`.lateness.minute_ttl_ms`; a minute older
        than that is not written)."""
        now = self.server_now_ms()
        minute = now // lateness.MINUTE_MS if minute is None else int(minute)
        ttl = lateness.minute_ttl_ms(minute, now)
        keys = [key, lateness.minute_key(key, minute)] if ttl > 0 else [key]
        with self.client.pipeline(transaction=False) as pipe:
            for target in keys:
                for name, value in fields.items():
                    if name == "sum_ms":
                        pipe.hincrbyfloat(target, name, round(value, 3))
                    else:
                        pipe.hincrby(target, name, int(value))
            if ttl > 0:
                pipe.pexpire(keys[1], ttl)
            pipe.execute()

    def lateness_fields(self, key: str) -> dict[str, Any]:
        """The hash ``key`` of a lateness histogram, as stored."""
        return dict(self.client.hgetall(key))

    def lateness_minutes(self, key: str, minutes: Iterable[int]) -> list[dict[str, Any]]:
        """The minute hashes (:func:`.lateness.minute_key`) of the histogram ``key`` for each of
        ``minutes``, as stored (empty when absent), in one pipeline."""
        with self.client.pipeline(transaction=False) as pipe:
            for minute in minutes:
                pipe.hgetall(lateness.minute_key(key, minute))
            return [dict(fields or {}) for fields in pipe.execute()]

    # -- flow control (lua/gate.lua and friends; the forms are celery_delayq/flow/gate.py's) ------

    def gate(
        self, token: str, jobs_by_shard: dict[int, list[tuple[str, Gate]]], slot_ttl_ms: int
    ) -> dict[str, GateResult]:
        """Ask the gate (``lua/gate.lua``) about claimed gated jobs ``token`` holds, ``(id,
        gate)`` by shard, in one pipeline; ``{id: GateResult}``.

        A call Redis refuses because it is over ``maxmemory`` wrote nothing: its jobs are
        answered ``NOT_HELD`` (skip them: they keep this beat's lease and are claimed and
        gated again once it expires), and a warning is logged. Any other error is raised.
        """
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        channel = self.keys.wake_channel
        for shard, jobs in jobs_by_shard.items():
            core = self.keys.shard(shard).core
            for start in range(0, len(jobs), GATE_CHUNK):
                chunk = jobs[start : start + GATE_CHUNK]
                args: list[Any] = [token, int(slot_ttl_ms), channel, shard]
                for job_id, gate in chunk:
                    args.append(job_id)
                    args.extend(gate.script_args())
                calls.append(ScriptCall(SCRIPTS["gate"], core, args))
                owners.append([job_id for job_id, _ in chunk])
        out: dict[str, GateResult] = {}
        results = run_pipelined(self.client, calls, raise_errors=False)
        for chunk_ids, result in zip(owners, results, strict=True):
            if isinstance(result, Exception):
                if not is_oom(result):
                    raise result
                logger.warning(
                    "delayq: Redis is over maxmemory and refused to gate %d job(s); they are "
                    "gated again when their lease expires",
                    len(chunk_ids),
                )
                out.update((job_id, GateResult(job_id, GateDecision.NOT_HELD)) for job_id in chunk_ids)
                continue
            for job_id, (code, ms, *rest) in zip(chunk_ids, result, strict=True):
                decision = _GATE_DECISIONS.get(code)
                if decision is None:
                    raise StoreError(f"delayq gate: unexpected reply {code!r}")
                until = int(ms) if decision is GateDecision.DEFERRED else None
                suspects = tuple((str(rest[j]), int(rest[j + 1])) for j in range(0, len(rest) - 1, 2))
                out[job_id] = GateResult(job_id, decision, until, suspects)
        return out

    def _pairs_by_call(
        self, script: str, head: Sequence[Any], pairs_by_shard: Mapping[int, Sequence[tuple[str, str]]]
    ) -> dict[str, bool]:
        """Run ``lua/<script>.lua`` (ARGV ``head`` then pairs id, key; one 0/1 per pair) for
        ``(id, key)`` pairs by shard, in one pipeline; ``{id: bool}``."""
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        for shard, pairs in pairs_by_shard.items():
            core = self.keys.shard(shard).core
            for start in range(0, len(pairs), GATE_CHUNK):
                chunk = pairs[start : start + GATE_CHUNK]
                args: list[Any] = list(head)
                for job_id, key in chunk:
                    args.extend((job_id, key))
                calls.append(ScriptCall(SCRIPTS[script], core, args))
                owners.append([job_id for job_id, _ in chunk])
        out: dict[str, bool] = {}
        for chunk_ids, result in zip(owners, run_pipelined(self.client, calls), strict=True):
            out.update((job_id, bool(r)) for job_id, r in zip(chunk_ids, result, strict=True))
        return out

    def hold(
        self,
        token: str,
        jobs_by_shard: dict[int, list[tuple[str, str]]],
        start_ttl_ms: int,
        check_ms: int = 0,
    ) -> dict[str, bool]:
        """After publishing released gated jobs ``(id, key)``: mark those ``token`` still holds
        running for ``start_ttl_ms`` (``lua/hold.lua``; instead of :meth:`ack`); ``{id: done}``:
        True when held, or when its worker started or finished it already (nothing to do); False
        when ``token`` no longer holds it. One pipeline. ``check_ms``: when > 0, a held job not
        started by then is claimed every ``check_ms`` to look whether its task finished
        already (the gate answers "held": see :class:`GateDecision`)."""
        return self._pairs_by_call("hold", [token, int(start_ttl_ms), int(check_ms)], jobs_by_shard)

    def start(self, job_id: str, due_ms: int, created_ms: int, claim: str, ttl_ms: int) -> bool:
        """A worker is about to run a delivery of job ``job_id`` (stored due ``due_ms``, envelope
        created ``created_ms``) published under ``claim`` (``"<tries>|<beat token>"``): whether
        it may (``lua/start.lua``, one round trip): True for the first claim of this job
        instance to start (its record kept ``ttl_ms``) and for that claim again; False for a copy
        of another claim (counted in the shard's dropped count)."""
        shard = self.keys.for_job(job_id)
        keys = [shard.started(job_id, due_ms, created_ms), shard.dropped]
        return bool(SCRIPTS["start"](self.client, keys, [claim, int(ttl_ms)]))

    def renew_slots(self, jobs: Sequence[tuple[str, str]], slot_ttl_ms: int) -> dict[str, bool]:
        """Extend to now + ``slot_ttl_ms`` the slots of running gated jobs ``(id, key)``
        (``lua/slot_renew.lua``, one pipeline); ``{id: still has its slot}``."""
        by_shard: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for job_id, key in jobs:
            by_shard[self.keys.shard_of(key)].append((job_id, key))
        return self._pairs_by_call("slot_renew", [int(slot_ttl_ms)], by_shard)

    def slot_updates(
        self,
        takes: Sequence[tuple[str, str]],
        slot_ttl_ms: int,
        releases: Sequence[tuple[str, str, str, str | None]],
    ) -> tuple[dict[str, bool], list[ReleaseResult | Exception]]:
        """A worker's slot calls in one round trip (one pipeline): the take-overs ``takes``
        (``(id, key)``, as :meth:`renew_slots`) and the releases ``releases`` (``(id, key,
        outcome, batch id or None)``, each as :meth:`release`). Returns the take-overs'
        ``{id: still has its slot}`` and, per release in order, its result or the error its
        call got (a take-over's error is raised)."""
        for _, _, outcome, _ in releases:
            if outcome not in RELEASE_OUTCOMES:
                raise InvalidInput(f"outcome={outcome!r}: one of {', '.join(RELEASE_OUTCOMES)}")
        calls: list[ScriptCall] = []
        owners: list[list[str]] = []
        by_shard: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for job_id, key in takes:
            by_shard[self.keys.shard_of(key)].append((job_id, key))
        for shard, pairs in by_shard.items():
            core = self.keys.shard(shard).core
            for start in range(0, len(pairs), GATE_CHUNK):
                chunk = pairs[start : start + GATE_CHUNK]
                calls.append(
                    ScriptCall(SCRIPTS["slot_renew"], core, [int(slot_ttl_ms), *itertools.chain(*chunk)])
                )
                owners.append([job_id for job_id, _ in chunk])
        takes_calls = len(calls)
        for job_id, key, outcome, batch_id in releases:
            shard = self.keys.shard_of(key)
            calls.append(
                ScriptCall(
                    SCRIPTS["release"],
                    self.keys.shard(shard).core,
                    self._release_args(job_id, key, outcome, batch_id, shard),
                )
            )
        raws = run_pipelined(self.client, calls, raise_errors=False)
        taken: dict[str, bool] = {}
        for chunk_ids, raw in zip(owners, raws[:takes_calls], strict=True):
            if isinstance(raw, Exception):
                raise raw
            taken.update((job_id, bool(r)) for job_id, r in zip(chunk_ids, raw, strict=True))
        released: list[ReleaseResult | Exception] = []
        for raw in raws[takes_calls:]:
            if isinstance(raw, Exception):
                released.append(raw)
            else:
                released.append(ReleaseResult(bool(raw[0]), int(raw[1]), bool(raw[2])))
        return taken, released

    def _release_args(
        self, job_id: str, key: str, outcome: str, batch_id: str | None, shard: int
    ) -> list[Any]:
        return [
            job_id,
            key,
            outcome,
            batch_id or "",
            self.keys.batch_channel,
            self.keys.wake_channel,
            shard,
            self._batch_keep_ms(),
        ]

    def release(self, job_id: str, key: str, outcome: str, batch_id: str | None = None) -> ReleaseResult:
        """A gated job's task ended with ``outcome`` (``"succeeded"``, ``"failed"``, or
        ``"retry"``: it runs again, not counted): give its slot back, remove the job (unless it
        was stored again meanwhile), count a batch member's outcome and promote parked jobs of
        ``key`` (``lua/release.lua``). A second release of the same slot does nothing. The call
        goes to ``key``'s shard, where a gated job's id (``gate.gated_id``) puts it."""
        if outcome not in RELEASE_OUTCOMES:
            raise InvalidInput(f"outcome={outcome!r}: one of {', '.join(RELEASE_OUTCOMES)}")
        shard = self.keys.shard_of(key)
        args = self._release_args(job_id, key, outcome, batch_id, shard)
        released, promoted, done = SCRIPTS["release"](self.client, self.keys.shard(shard).core, args)
        return ReleaseResult(bool(released), int(promoted), bool(done))

    def _gate_admin(self, op: str, key: str, value: Any = "") -> int:
        shard = self.keys.shard_of(key)
        args = [op, key, value, self.keys.wake_channel, shard]
        refused = f"{_GATE_ADMIN_WORDS.get(op, op)} of key {key!r} not changed"
        return int(self._write(SCRIPTS["gate_admin"], self.keys.shard(shard).core, args, refused))

    def set_limit(self, key: str, limit: int | None) -> int:
        """Override ``key``'s limit at run time (None: no cap) and promote parked jobs into
        the free slots; how many were promoted. A lower limit holds back the next jobs gated
        (running ones finish)."""
        if limit is None:
            return self._gate_admin("unlimit", key)
        return self._gate_admin("limit", key, int(limit))

    def clear_limit(self, key: str) -> int:
        """Drop ``key``'s override (each job's own limit counts again); promoted count."""
        return self._gate_admin("clear", key)

    def pause(self, key: str) -> int:
        """Hold back every job of ``key`` gated from now on (running ones finish); 0."""
        return self._gate_admin("pause", key)

    def resume(self, key: str) -> int:
        """Let ``key``'s jobs go again; how many parked jobs were promoted."""
        return self._gate_admin("resume", key)

    def key_limit(self, key: str) -> tuple[bool, int | None]:
        """``(an override is set?, its number, or None for "none" / no override)``."""
        raw = self.client.hget(self.keys.for_key(key).gate_limits, key)
        if raw is None:
            return False, None
        return True, (None if raw == "none" else _int_or(raw))

    def key_state(self, key: str) -> KeyState:
        """``key``'s limit in force, override, running and parked counts, and paused flag."""
        return self._key_states(self.keys.shard_of(key), [key])[0]

    def _key_states(self, shard: int, keys: Sequence[str]) -> list[KeyState]:
        names = self.keys.shard(shard)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(names.gate_keys, key)
                pipe.hget(names.gate_limits, key)
                pipe.hexists(names.gate_paused, key)
                pipe.zcard(names.running(key))
                pipe.zcard(names.waiting(key))
            replies = iter(pipe.execute())
        out: list[KeyState] = []
        for key in keys:
            own, override, paused, running, waiting = (next(replies) for _ in range(5))
            # As includes/gate.lua's limit_in_force: an override that does not read is ignored.
            if override == "none":
                limit = None
            elif override is not None and _int_or(override) >= 1:
                limit = _int_or(override)
            else:
                limit = _int_or(own) if own else None
            out.append(KeyState(key, limit, override, int(running), int(waiting), bool(paused)))
        return out

    def key_states(self) -> list[KeyState]:
        """Every gate key of every shard (``gate:keys``), by name."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.hgetall(shard.gate_keys)  # HGETALL: in the ACL rule (HKEYS is not)
            found = pipe.execute()
        out: list[KeyState] = []
        for index, keys in enumerate(found):
            if keys:
                out.extend(self._key_states(index, sorted(keys)))
        return sorted(out, key=lambda state: state.key)

    def open_batch(
        self, batch_id: str, total: int, completion: tuple[str, str] | None, meta: Mapping[str, Any]
    ) -> bool:
        """Record batch ``batch_id`` of ``total`` members, with its completion job ``(id,
        envelope)`` stored parked until the batch ends (``lua/batch_open.lua``). False when
        a batch with this id exists (nothing written)."""
        shard = self.keys.shard_of(batch_key(batch_id))
        cid, envelope = completion if completion is not None else ("", "")
        args = [
            batch_id,
            int(total),
            cid,
            stored_form(cid, envelope) if cid else "",
            self.server_now_ms(),
            json.dumps(dict(meta), separators=(",", ":")),
        ]
        refused = f"batch {batch_id!r} not opened"
        return bool(self._write(SCRIPTS["batch_open"], self.keys.shard(shard).core, args, refused))

    def batch_state(self, batch_id: str) -> BatchState | None:
        """A batch's counts, or None when there is no such batch."""
        return self._batch_states(self.keys.shard_of(batch_key(batch_id)), [batch_id])[0]

    def _batch_states(self, shard: int, batch_ids: Sequence[str]) -> list[BatchState | None]:
        names = self.keys.shard(shard)
        with self.client.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hgetall(names.batch(batch_id))
                pipe.zcard(names.running(batch_key(batch_id)))
            replies = iter(pipe.execute())
        out: list[BatchState | None] = []
        for batch_id in batch_ids:
            fields, running = next(replies), int(next(replies))
            if not fields:
                out.append(None)
                continue
            total, succeeded, failed, cancelled = (
                _int_or(fields.get(name)) for name in ("total", "succeeded", "failed", "cancelled")
            )
            waiting = max(total - running - succeeded - failed - cancelled, 0)
            out.append(
                BatchState(
                    batch_id,
                    total,
                    succeeded,
                    failed,
                    cancelled,
                    running,
                    waiting,
                    fields.get("done") == "1",
                    _int_or(fields.get("created")),
                    _int_or(fields["expires"]) if fields.get("expires") else None,
                )
            )
        return out

    def batch_states(self) -> list[BatchState]:
        """Every batch of every shard (``batches``), by id."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.smembers(shard.batches)
            found = pipe.execute()
        out: list[BatchState] = []
        for index, ids in enumerate(found):
            if ids:
                out.extend(state for state in self._batch_states(index, sorted(ids)) if state is not None)
        return sorted(out, key=lambda state: state.batch_id)

    def cancel_batch(self, batch_id: str, job_ids: Sequence[str] | None = None) -> int:
        """Remove the batch's members that were not released (waiting, parked or deferred) and
        count them cancelled (``lua/batch_cancel.lua``; the batch completes when that was the
        rest of it); how many were removed. ``job_ids`` None: every member, ``0..total-1``,
        in calls of ``ACK_CHUNK`` ids."""
        key = batch_key(batch_id)
        shard = self.keys.shard_of(key)
        if job_ids is None:
            total = _int_or(self.client.hget(self.keys.shard(shard).batch(batch_id), "total"))
            job_ids = [member_id(batch_id, i) for i in range(total)]
        head = [batch_id, key, self.keys.batch_channel, self.keys.wake_channel, shard, self._batch_keep_ms()]
        core = self.keys.shard(shard).core
        calls = [
            ScriptCall(SCRIPTS["batch_cancel"], core, [*head, *job_ids[start : start + ACK_CHUNK]])
            for start in range(0, max(len(job_ids), 1), ACK_CHUNK)
        ]
        with refused_when_full(f"batch {batch_id!r} not cancelled"):
            return sum(int(result[0]) for result in run_pipelined(self.client, calls))

    def _batch_keep_ms(self) -> int | str:
        """ARGV of the scripts that may complete a batch: ms it is kept (``""``: until deleted)."""
        keep = self.config.batch_expires
        return "" if keep is None else max(int(keep * 1000), 1)

    def delete_batch(self, batch_id: str, force: bool = False) -> str:
        """Delete batch ``batch_id``'s record (``lua/batch_delete.lua``): ``"deleted"``,
        ``"missing"`` (no such batch; what was left of one is removed all the same) or
        ``"pending"`` (not finished and not ``force``: nothing done).

        ``force``: a batch not finished is deleted too: its members not released yet are
        cancelled first (:meth:`cancel_batch`), its parked completion job removed (on_complete
        never runs); members running or held by a beat run to their end, counted nowhere.
        Deleting only removes, so it works on a full Redis. A ``batch:<id>`` written by hand
        as another type: :class:`CorruptData`."""
        key = batch_key(batch_id)
        shard = self.keys.shard_of(key)
        if force:
            try:
                if self.batch_state(batch_id) is not None:
                    self.cancel_batch(batch_id)
            except redis.ResponseError as exc:  # WRONGTYPE: the script below says it
                if "WRONGTYPE" not in str(exc):
                    raise
        args = [batch_id, key, "force" if force else "done"]
        names = self.keys.shard(shard)
        try:
            status = self._write(SCRIPTS["batch_delete"], names.core, args, f"batch {batch_id!r} not deleted")
        except redis.ResponseError as exc:
            if "is not a hash" in str(exc):
                raise CorruptData(
                    f"batch {batch_id!r}: {names.batch(batch_id)} is not a hash (written by hand); "
                    "nothing deleted: remove that key by hand (DEL)"
                ) from exc
            raise
        return {0: "missing", 1: "deleted", 2: "pending"}[int(status)]

    def sweep_batches(self, limit: int = 100) -> int:
        """Remove what is left of up to ``limit`` finished batches per shard whose time
        (``delayq_batch_expires``) passed: their hash expired by itself, their ids and key
        records go now (``lua/batch_delete.lua``, mode ``expired``). How many were removed.
        The beats call it every ``BATCH_SWEEP_EVERY`` s; it also drops the shapes hash of each
        shard that holds no job (:meth:`sweep_shapes`). On one server with no finished batch and
        no shape stored, it costs one ``EXISTS``."""
        shards = self.keys.all_shards()
        if not self._any_exists([key for shard in shards for key in (shard.batch_expiry, shard.shapes)]):
            return 0
        self.sweep_shapes()
        now = self.server_now_ms()
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zrange(shard.batch_expiry, "-inf", int(now), byscore=True, offset=0, num=limit)
            found = pipe.execute()
        calls = [
            ScriptCall(SCRIPTS["batch_delete"], self.keys.shard(index).core, [bid, batch_key(bid), "expired"])
            for index, ids in enumerate(found)
            for bid in ids
        ]
        if not calls:
            return 0
        results = run_pipelined(self.client, calls, raise_errors=False)
        failed = [result for result in results if isinstance(result, Exception)]
        if failed:  # a batch:<id> written by hand as another type: left, said once a sweep
            logger.warning("delayq: %d expired batch(es) not removed: %s", len(failed), failed[0])
        return sum(1 for result in results if not isinstance(result, Exception) and int(result) in (0, 1))

    def batch_subscription(self) -> Any:
        """A pub/sub connection subscribed to the batch channel (``"<bid>|<counts JSON>"`` when a
        batch completes; ``get_message``, ``close``)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.batch_channel)
        return pubsub


def get_store(app: Any) -> Store:
    """The app's :class:`Store`: :meth:`Store.for_app`."""
    return Store.for_app(app)
