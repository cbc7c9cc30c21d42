"""Reads over the stored jobs: counts, scans in due order, id search, per-shard stats, due
histograms and the overview the dashboard and CLI show (:class:`ShardStats`,
:class:`StoreOverview`, :class:`IdSearch`), and the dashboard's chart counts kept a short while
for every dashboard process (``keep_counts``, ``kept_counts``). Nothing here writes a job.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ..exceptions import CorruptData
from ..flow.gate import PARK_MS
from .base import StoreBase, _int_or
from .bounded import MAX_SMALL, load_json
from .jobs import JobRecord, _lease_state
from .lua_formats import parse_lease
from .scripts import SCRIPTS, ScriptCall, run_pipelined


def _shard_order(record: JobRecord) -> tuple[int, bytes]:
    """Where a record stands among its shard's in a listing: its time (a leased, running or
    deferred job's lease expiry, else its due time), then its id's bytes (as Redis orders
    members of one score)."""
    return record.lease_until_ms or record.due_ms, record.id.encode("utf-8", "surrogateescape")


def _bound(limit: Any) -> tuple[float, float | None]:
    """A ``ZRANGE BYSCORE`` bound (ms, ``"-inf"``, ``"+inf"`` or exclusive ``"(<ms>"``) as
    ``(value, value again when it is included, else None)``.

    >>> _bound(5), _bound("(5"), _bound("+inf")
    ((5.0, 5.0), (5.0, None), (inf, None))
    """
    if isinstance(limit, str) and limit.startswith("("):
        return float(limit[1:]), None
    value = float(limit)
    return value, (value if math.isfinite(value) else None)


def _below_park(end_ms: Any) -> Any:
    """A scan's upper bound without the parked jobs' score (``PARK_MS``): they are read apart."""
    return f"({PARK_MS}" if end_ms == "+inf" or int(end_ms) >= PARK_MS else end_ms


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


class ReadsPart(StoreBase):
    """Reads over the stored jobs (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def count(self) -> int:
        """Jobs stored (waiting or leased) over all shards."""
        with self.client.pipeline(transaction=False) as pipe:
            for shard in self.keys.all_shards():
                pipe.zcard(shard.due)
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
        """A shard's jobs in :meth:`scan`'s order: those with a time score, and the parked ones
        (score ``PARK_MS``) merged in at their due time (:meth:`_parked`)."""
        timed = self._scan_timed(index, start_ms, _below_park(end_ms), page)
        yield from heapq.merge(timed, self._parked(index, start_ms, end_ms, page), key=_shard_order)

    def _scan_timed(self, index: int, start_ms: Any, end_ms: Any, page: int) -> Iterator[JobRecord]:
        for job_id, score, envelope, lease in self.due_entries(index, start_ms, end_ms, page):
            if envelope is not None:
                yield self._record(index, job_id, score, envelope, lease)

    def _parked(self, index: int, start_ms: Any, end_ms: Any, page: int) -> Iterator[JobRecord]:
        """A shard's parked jobs (held back by flow control until a slot, a resume or their
        batch's end: due score ``PARK_MS``) whose due time, kept in their lease entry, lies in
        ``[start_ms, end_ms]``, by due time then id. Their ids and lease entries are read first
        (``page`` a round trip), their envelopes a page at a time as they are listed."""
        due_key, leases_key = self.keys.shard(index).due, self.keys.shard(index).leases
        lo, hi = _bound(start_ms), _bound(end_ms)
        held: list[tuple[int, bytes, str]] = []
        offset = 0
        while True:
            ids = self.client.zrange(due_key, PARK_MS, "+inf", byscore=True, offset=offset, num=page)
            if not ids:
                break
            for job_id, lease in zip(ids, self.client.hmget(leases_key, ids), strict=True):
                parsed = None if lease is None else parse_lease(lease)
                due_ms = PARK_MS if parsed is None else parsed[0]  # no entry that reads: last
                if lo[0] < due_ms < hi[0] or due_ms in (lo[1], hi[1]):
                    held.append((due_ms, job_id.encode("utf-8", "surrogateescape"), job_id))
            if len(ids) < page:
                break
            offset += page
        held.sort()
        for at in range(0, len(held), page):
            chunk = [(job_id, float(PARK_MS)) for _, _, job_id in held[at : at + page]]
            for job_id, score, envelope, lease in self._entries(index, chunk):
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
        its original due time in ``due_ms``. A parked job (held back by flow control, its
        score ``PARK_MS``) is ordered and selected by its due time (:meth:`_parked`).
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
        if at is None or rank is None or int(at) != score:  # gone, moved, or parked (by due time)
            yield from self._scan_shard(index, score, end_ms, page)
            return
        timed = self._timed_after(index, int(rank), end_ms, page)
        yield from heapq.merge(timed, self._parked(index, score, end_ms, page), key=_shard_order)

    def _timed_after(self, index: int, rank: int, end_ms: Any, page: int) -> Iterator[JobRecord]:
        """The shard's jobs with a time score after rank ``rank``, up to
        ``end_ms``: by rank, so that many jobs of one score cost nothing to pass."""
        due = self.keys.shard(index).due
        last = min(PARK_MS - 1, math.inf if end_ms == "+inf" else int(end_ms))
        start = rank + 1
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
