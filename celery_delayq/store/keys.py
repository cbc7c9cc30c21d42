"""Every Redis key and channel name celery-delayq uses.

All keys of one shard share one Redis Cluster hash tag, ``{<prefix>:<shard>}``,
so each Lua script (which only ever touches one shard) runs on a cluster, and
the shards spread over its nodes. A job's shard is a stable hash of its id
(CRC-32, the same in every language), so get/cancel/reschedule need no scan.

>>> keys = KeySpace("delayq", 16)
>>> keys.shard_of("reminder:42")
6
>>> keys.shard(6).due
'delayq:{delayq:6}:due'
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property

__all__ = [
    "START_PARTS",
    "KeySpace",
    "ShardKeys",
    "is_point_id",
    "iso_ms",
    "point_id",
    "shard_of",
    "start_record",
]

#: How many start-record hashes a shard has per time bucket (:meth:`ShardKeys.start_records`).
START_PARTS = 256

#: The form of a recurring schedule's execution point id (:func:`point_id`).
_POINT_ID = re.compile(r"\{[^{}]+\}@\d{4,}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def iso_ms(at_ms: int) -> str:
    """``at_ms`` (ms since the epoch) as UTC ISO-8601 with milliseconds.

    >>> iso_ms(1_767_225_600_007)
    '2026-01-01T00:00:00.007Z'
    """
    when = datetime.fromtimestamp(at_ms // 1000, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at_ms % 1000:03d}Z"


def point_id(name: str, at_ms: int) -> str:
    """The task id of schedule ``name``'s execution point at ``at_ms``: the same in every beat.

    >>> point_id("nightly-report", 1_767_225_600_000)
    '{nightly-report}@2026-01-01T00:00:00.000Z'
    """
    return "{" + name + "}@" + iso_ms(at_ms)


def is_point_id(job_id: object) -> bool:
    """Whether ``job_id`` has the form of a schedule's execution point id, ``{<name>}@<time>``.

    Such ids are reserved for the schedules: a job stored under one would take the place of
    the point and stop its schedule. ``Schedules.run_now`` ids (``{name}@run-now-...``) and
    the ids of a point's retries (``{name}@<time>:retry-<n>``) are not point ids.

    >>> is_point_id("{nightly}@2026-01-01T00:00:00.000Z"), is_point_id("{nightly}@run-now-x")
    (True, False)
    >>> is_point_id("{nightly}@2026-01-01T00:00:00.000Z:retry-1"), is_point_id(42)
    (False, False)
    """
    return isinstance(job_id, str) and job_id.startswith("{") and _POINT_ID.fullmatch(job_id) is not None


def shard_of(job_id: str, shards: int) -> int:
    """The shard of ``job_id``: CRC-32 of its UTF-8 bytes modulo ``shards``.

    As with Redis Cluster hash tags, when the id contains ``{...}`` with
    something between the first ``{`` and the next ``}``, only that part is
    hashed, so ids sharing a tag share a shard (a recurring schedule's points,
    ``{name}@<time>``, live on the schedule's shard this way).

    >>> shard_of("a", 16)
    3
    >>> shard_of("{a}@2026-01-01T00:00:00Z", 16) == shard_of("a", 16)
    True
    """
    start = job_id.find("{")
    if start >= 0:
        end = job_id.find("}", start + 1)
        if end > start + 1:
            job_id = job_id[start + 1 : end]
    return zlib.crc32(job_id.encode("utf-8")) % shards


def start_record(job_id: str, due_ms: int, created_ms: int, claim: str) -> tuple[int, bytes, bytes]:
    """The start record of a delivery (``lua/start.lua``): ``(part, field, mark)``: the part
    (0 to :data:`START_PARTS` - 1) and the hash field (8 bytes) of the job instance (``job_id``
    stored with due ``due_ms``, its envelope created at ``created_ms``), and the value that
    tells its claim (``"<tries>|<beat token>"``) from another (4 bytes). BLAKE2b digests: 72
    bits tell one instance from another within its shard (a mix-up would drop a job: at 500
    starts a second, about once in a million years), 32 bits one claim from another (a mix-up
    would run a stale copy, itself rare: once in 4 x 10^9 stale copies).

    >>> part, field, mark = start_record("job-1", 1000, 7, "1|beat-a")
    >>> part, len(field), len(mark)
    (226, 8, 4)
    >>> start_record("job-1", 1000, 7, "1|beat-b")[2] != mark
    True
    """
    digest = hashlib.blake2b(f"{due_ms}|{created_ms}|{job_id}".encode(), digest_size=9).digest()
    mark = hashlib.blake2b(claim.encode(), digest_size=4).digest()
    return digest[0] % START_PARTS, digest[1:], mark


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard; they all hash to the same cluster slot."""

    prefix: str
    index: int

    @property
    def tag(self) -> str:
        return f"{{{self.prefix}:{self.index}}}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{self.tag}:{name}"

    @property
    def due(self) -> str:
        """Sorted set: job id -> due time (ms); a leased job's score is its lease expiry."""
        return self._key("due")

    @property
    def jobs(self) -> str:
        """Hash: job id -> stored envelope (JSON)."""
        return self._key("jobs")

    @property
    def leases(self) -> str:
        """Hash: job id -> ``"<due ms>|<tries>|<token>"`` while a beat holds it."""
        return self._key("leases")

    @property
    def wake(self) -> str:
        """String: the time (ms) by which some beat will look at this shard again."""
        return self._key("wake")

    @property
    def shapes(self) -> str:
        """Hash: shape id -> the shape of the jobs stored with it (the text their envelopes share:
        :func:`.stored_forms.shared_form`); written with them by ``lua/enqueue.lua``, dropped when the
        shard holds no job (:meth:`.Store.sweep_shapes`)."""
        return self._key("shapes")

    @property
    def unique(self) -> str:
        """Sorted set: id of a job stored with ``unique_for`` -> the end (ms) of its uniqueness
        window (``lua/enqueue.lua``, mode ``unique``); ended windows are removed by the next such
        call on the shard."""
        return self._key("unique")

    @property
    def debounce(self) -> str:
        """Hash: debounce key (of the keys whose tag puts them on this shard) -> ``"<id of its
        pending job>|<ms of the call that opened its window>"`` (``lua/keyed.lua``)."""
        return self._key("debounce")

    @property
    def debounce_due(self) -> str:
        """Sorted set: debounce key -> its pending job's due (ms); a record is dropped a day
        after it by a later debounced call on the shard (``lua/keyed.lua``)."""
        return self._key("debounce:due")

    @property
    def throttle(self) -> str:
        """Sorted set: throttle key -> the end (ms) of its window (``lua/keyed.lua``); ended
        windows are removed by the next throttled call on the shard."""
        return self._key("throttle")

    @property
    def with_keyed(self) -> tuple[str, ...]:
        """KEYS for ``keyed``: :attr:`core`, then :attr:`debounce`, :attr:`debounce_due` and
        :attr:`throttle`."""
        return (*self._core, self.debounce, self.debounce_due, self.throttle)

    @property
    def wire(self) -> str:
        """Hash: ``"<space>|<shape>"`` -> the message template of that job shape (JSON) or ``"-"``
        (``lua/push.lua``, the push path on claim; written by :meth:`.Store.add_templates`)."""
        return self._key("wire")

    @property
    def dead(self) -> str:
        """Hash: job id -> dead-letter record (JSON: reason, envelope, times)."""
        return self._key("dead")

    @property
    def schedules(self) -> str:
        """Hash: schedule name -> definition (JSON)."""
        return self._key("schedules")

    @property
    def history(self) -> str:
        """Hash: schedule name -> run state (JSON: current point id, next run, last run, runs)."""
        return self._key("history")

    # -- the start check (lua/start.lua, celery_delayq/worker/starts.py) --

    def start_records(self, width_s: int, bucket: int, part: int) -> str:
        """Hash: the start records written in time bucket ``bucket`` (server time // ``width_s``
        seconds) whose job instance falls in part ``part`` (of :data:`START_PARTS`): 8-byte
        instance digest -> 4-byte claim digest (:func:`start_record`); the whole hash expires
        ``delayq_start_ttl`` after its bucket ends. ``lua/start.lua`` builds these names from
        :attr:`dropped` (the same form).

        >>> KeySpace("delayq", 16).shard(6).start_records(512, 3456789, 17)
        'delayq:{delayq:6}:starts:512:3456789:17'
        """
        return self._key(f"starts:{width_s}:{bucket}:{part}")

    def started(self, job_id: str, due_ms: int, created_ms: int) -> str:
        """String: the claim that started this instance of job ``job_id`` (stored with due
        ``due_ms``, its envelope created at ``created_ms``): a start record of the form before
        the bucketed one (:meth:`start_records`), one key a started job. No longer written;
        ``lua/start.lua`` still reads it, so that a job started by a worker of an earlier version
        is recognised until its record expires (``delayq_start_ttl`` after it was written)."""
        return self._key(f"start:{due_ms}:{created_ms}:{job_id}")

    @property
    def dropped(self) -> str:
        """String: how many stale copies of this shard's jobs workers dropped (lua/start.lua)."""
        return self._key("starts:dropped")

    # -- flow control (lua/includes/gate.lua builds these names from KEYS[1]: same form) --

    @property
    def base(self) -> str:
        """What every key of the shard begins with, ``<prefix>:{<prefix>:<i>}:``: the gate
        scripts build a gate key's names from it (``KEYS[1]`` minus ``due``)."""
        return self._key("")

    @property
    def gate_keys(self) -> str:
        """Hash: gate key -> its entry: the last limit a job of the key carried (``""``: none),
        and its run-time override and pause when it has either
        (:func:`celery_delayq.store.lua_formats.parse_key_entry`)."""
        return self._key("gate:keys")

    @property
    def gate_rates(self) -> str:
        """Hash: gate key -> GCRA theoretical arrival time (ms): the next release it allows."""
        return self._key("gate:rates")

    @property
    def gate_booked(self) -> str:
        """Hash: id of a job its key's rate deferred -> the release time (ms) it booked."""
        return self._key("gate:booked")

    @property
    def gate_check(self) -> str:
        """Hash: id of a released job waiting for its worker -> "1" while its next claim is a
        check of its slot, not a redelivery (``lua/hold.lua``)."""
        return self._key("gate:check")

    @property
    def gate_overlap(self) -> str:
        """Hash: a schedule's overlap key (its name) -> the id of its point that waits for its
        run to end (overlap ``buffer_one``, ``lua/overlap.lua``; ``lua/sched_del.lua`` removes
        the field with the schedule)."""
        return self._key("gate:overlap")

    def running(self, key: str) -> str:
        """Sorted set: id of a released job of ``key`` whose task has not finished -> slot expiry ms."""
        return self._key("gate:run:" + key)

    def waiting(self, key: str) -> str:
        """Sorted set: id of a parked job of ``key`` -> ``(255 - priority) * 1e13 + due ms``."""
        return self._key("gate:wait:" + key)

    @property
    def batches(self) -> str:
        """Set: the ids of the batches whose hash lives in this shard."""
        return self._key("batches")

    @property
    def batch_expiry(self) -> str:
        """Sorted set: id of a finished batch -> the time (ms) its record expires
        (``delayq_batch_expires``); the beats' sweep removes what is left of it then."""
        return self._key("batches:expiry")

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's counts (total, succeeded, failed, cancelled), created ms, done,
        completion job id and meta (JSON)."""
        return self._key("batch:" + batch_id)

    @property
    def core(self) -> list[str]:
        """KEYS for the scripts, in the order every script expects them."""
        return list(self._core)

    @cached_property
    def with_shapes(self) -> tuple[str, ...]:
        """KEYS for the scripts that also take the shapes hash (``enqueue``, ``shapes_sweep``):
        :attr:`core`, then :attr:`shapes`; made once (every ``apply_at`` passes them)."""
        return (*self._core, self.shapes)

    @property
    def with_unique(self) -> tuple[str, ...]:
        """KEYS for ``enqueue`` in mode ``unique``: :attr:`with_shapes`, then :attr:`unique`."""
        return (*self.with_shapes, self.unique)

    @cached_property
    def _core(self) -> tuple[str, ...]:
        return (self.due, self.jobs, self.leases, self.wake, self.dead, self.schedules, self.history)


@dataclass(frozen=True)
class KeySpace:
    """All key names for one ``prefix`` and shard count."""

    prefix: str
    shards: int

    def shard_of(self, job_id: str) -> int:
        return shard_of(job_id, self.shards)

    def shard(self, index: int) -> ShardKeys:
        return self._all[index]

    def for_job(self, job_id: str) -> ShardKeys:
        return self._all[self.shard_of(job_id)]

    def for_key(self, key: str) -> ShardKeys:
        """The shard of gate key ``key``: that of its tag ``{<key>}``, where its jobs live."""
        return self._all[shard_of(key, self.shards)]

    @cached_property
    def _all(self) -> tuple[ShardKeys, ...]:
        return tuple(ShardKeys(self.prefix, i) for i in range(self.shards))

    def all_shards(self) -> tuple[ShardKeys, ...]:
        return self._all

    @property
    def config_registry(self) -> str:
        """Set: names of the schedules that came from ``beat_schedule`` (one key, no shard)."""
        return f"{self.prefix}:config-schedules"

    @property
    def beats(self) -> str:
        """Hash: beat token -> JSON heartbeat (host, pid, times, counters), written by each beat."""
        return f"{self.prefix}:beats"

    def stream(self, query_id: str) -> str:
        """String: the last micro-batch that Spark streaming query ``query_id`` committed to the
        ``delayq`` sink, kept for the sink's ``uniqueFor`` (a TTL; one key a query, no shard)."""
        return f"{self.prefix}:stream:{query_id}"

    def web_counts(self, name: str) -> str:
        """String: JSON of the dashboard's chart counts ``name`` (``hour``, ``day``), kept a
        short while (a TTL) for every dashboard process (one key, no shard)."""
        return f"{self.prefix}:web:counts:{name}"

    @cached_property
    def wake_channel(self) -> str:
        """Pub/sub channel on which enqueue announces ``"<shard>:<due ms>"``."""
        return f"{self.prefix}:wake"

    @cached_property
    def batch_channel(self) -> str:
        """Pub/sub channel on which a batch's completion is announced: ``"<bid>|<counts JSON>"``."""
        return f"{self.prefix}:batch"
