"""Listing and searching stored jobs: a page of pending jobs in due order, resumed from a
cursor (``delayq pending``, the dashboard's jobs page), and the search by id (``delayq search``).

>>> parse_cursor("1700000000500:3:reminder-42")
(1700000000500, 3, b'reminder-42')
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidInput
from ..store.envelope import decode_envelope
from ..store.facade import Store
from ..store.jobs import JobRecord
from .views import PageReads, gated_by, job_view

__all__ = [
    "JobFilter",
    "cursor_text",
    "id_search",
    "jobs_page",
    "parse_cursor",
    "parse_scan_cursor",
]


def cursor_text(record: JobRecord) -> str:
    """Where a listing stopped: ``<score>:<shard>:<id>`` (the ``next_cursor`` of :func:`jobs_page`)."""
    return f"{record.lease_until_ms or record.due_ms}:{record.shard}:{record.id}"


def parse_cursor(text: str) -> tuple[int, int, bytes]:
    """A ``next_cursor`` read back; ValueError when it is not one."""
    try:
        score, shard, job_id = text.split(":", 2)
        return int(score), int(shard), job_id.encode("utf-8", "surrogateescape")
    except ValueError:
        raise InvalidInput(f"bad cursor {text!r}: pass the next_cursor an earlier listing gave") from None


def _order(record: JobRecord) -> tuple[int, int, bytes]:
    """Where a record stands in ``Store.scan``'s order: score, shard, then id bytes (Redis
    orders members of equal score by their bytes; the merge keeps shards in index order)."""
    return record.lease_until_ms or record.due_ms, record.shard, record.id.encode("utf-8", "surrogateescape")


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class JobFilter:
    """What a job listing keeps: each field None keeps everything.

    ``start_ms``/``end_ms`` bound the score (a leased job's is its lease expiry).
    """

    task: str | None = None
    queue: str | None = None
    state: str | None = None
    start_ms: int | None = None
    end_ms: int | None = None

    @property
    def narrowed(self) -> bool:
        """Whether a job can be passed over for what it holds (task, queue, state)."""
        return bool(self.task or self.queue or self.state)


def _task_needle(where: JobFilter) -> str | None:
    """A task name any JSON encoder writes as it is: an envelope without it quoted is not of it,
    and is passed over without being decoded (a task filter reads every job in the window)."""
    return json.dumps(where.task) if where.task and _PLAIN_NAME.fullmatch(where.task) else None


def _keeps(record: JobRecord, default_queue: str, where: JobFilter, needle: str | None) -> bool:
    """Whether ``record`` is of the task, queue and state ``where`` asks for (not its window)."""
    if where.state and record.state != where.state:
        return False
    if needle is not None and needle not in record.envelope:
        return False
    if where.task or where.queue:
        try:
            envelope = decode_envelope(record.envelope)
        except ValueError:
            return False  # listed only without a task/queue filter, as "<corrupt envelope>"
        if where.task and envelope.task != where.task:
            return False
        if where.queue and (default_queue if envelope.queue is None else envelope.queue) != where.queue:
            return False
    return True


def _matching(
    store: Store, default_queue: str, where: JobFilter, after: tuple[int, int, bytes] | None, page: int
) -> Iterator[tuple[JobRecord, bool]]:
    """Every job read from the cursor on, and whether it matches ``where``."""
    start_ms = where.start_ms
    if after is not None:
        start_ms = after[0] if start_ms is None else max(start_ms, after[0])
    needle = _task_needle(where)
    if after is not None and (where.start_ms is None or where.start_ms <= after[0]):
        records = store.scan_after(after, where.end_ms, page=page)  # by rank: many may share a score
    else:
        records = store.scan(start_ms, where.end_ms, page=page)
    for record in records:
        if after is not None and _order(record) <= after:
            yield record, False
            continue
        yield record, _keeps(record, default_queue, where, needle)


def _with_gated_by(
    store: Store, views: list[dict[str, Any]], records: list[JobRecord]
) -> list[dict[str, Any]]:
    """``views`` of ``records``, each with ``gated_by``: what a gated job waits for (``slot``,
    ``paused``, ``batch``, ``rate`` or ``released``, as ``show`` says), else None. A read per
    key or batch of the page's gated jobs, none when there is none."""
    gated = [r for r in records if r.state == "gated"]
    reads = PageReads(store) if gated else None
    now_ms = store.server_now_ms() if gated else 0
    for view, record in zip(views, records, strict=True):
        view["gated_by"] = None if reads is None else gated_by(reads, record, now_ms)
    return views


def jobs_page(
    store: Store,
    default_queue: str,
    where: JobFilter = JobFilter(),
    limit: int = 50,
    offset: int = 0,
    cursor: str | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """``delayq ls --json``: ``{"jobs": [...], "count": n, "next_cursor": text or None}``.

    In due order (a leased job by its lease expiry); ``cursor`` (an earlier page's
    ``next_cursor``) goes on after the job it names, reading from there on: a page costs
    O(log n) a shard plus the jobs it reads, however many are stored. ValueError: a bad cursor.

    ``budget``: read at most this many jobs (a filter that few jobs match would otherwise read
    every one); when it runs out first, the answer adds ``"examined": budget`` and
    ``"exhausted": true``, and its ``next_cursor`` goes on after the last job read.
    """
    after = parse_cursor(cursor) if cursor else None
    page = 500 if where.narrowed else max(10, min(500, limit + offset + 2))
    if budget is not None:
        page = max(1, min(page, budget + 1))
    shown: list[JobRecord] = []
    more = False
    skipped = 0
    examined = 0
    last: JobRecord | None = None
    for record, keep in _matching(store, default_queue, where, after, page):
        if budget is not None and examined == budget:
            more = True
            break
        examined += 1
        if not keep:
            last = record
            continue
        if skipped < offset:
            skipped += 1
            last = record
            continue
        if len(shown) == limit:
            more = True
            break
        shown.append(record)
        last = record
    out: dict[str, Any] = {
        "jobs": _with_gated_by(store, [job_view(r, default_queue) for r in shown], shown),
        "count": len(shown),
        "next_cursor": cursor_text(shown[-1]) if more and shown else None,
    }
    if budget is not None and examined == budget and more and len(shown) < limit and last is not None:
        out.update(next_cursor=cursor_text(last), examined=budget, exhausted=True)
    return out


def parse_scan_cursor(text: str) -> tuple[int, int]:
    """Where an id-prefix search stopped (``<shard>:<ZSCAN cursor>``, its ``next_cursor``).

    >>> parse_scan_cursor("3:1792")
    (3, 1792)
    >>> parse_scan_cursor("x")
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidInput: bad cursor 'x' of an id search: ...
    """
    bad = f"bad cursor {text!r} of an id search: pass the next_cursor an earlier search gave"
    try:
        shard, cursor = (int(part) for part in text.split(":"))
    except ValueError:
        raise InvalidInput(bad) from None
    if shard < 0 or cursor < 0:
        raise InvalidInput(bad)
    return shard, cursor


def id_search(
    store: Store,
    default_queue: str,
    prefix: str,
    where: JobFilter = JobFilter(),
    cursor: str | None = None,
    budget: int = 200_000,
    enough: int = 50,
) -> dict[str, Any]:
    """The jobs whose id is ``prefix`` or begins with it, narrowed by ``where``: the shape of
    :func:`jobs_page` (in due order) plus ``"scan"``: what was searched.

    An exact id (a waiting, leased or dead job) is looked up first (``"exact": true``);
    otherwise :meth:`~..store.facade.Store.search_ids` examines about ``budget`` ids from ``cursor`` on
    (an earlier search's ``next_cursor``), stopping sooner once ``enough`` jobs matched.
    ``next_cursor`` is None when every shard was searched; ``"complete"`` says the same.
    ValueError: a bad cursor.
    """
    needle = _task_needle(where)

    def keeps(record: JobRecord) -> bool:
        score = record.lease_until_ms or record.due_ms
        if where.start_ms is not None and score < where.start_ms:
            return False
        if where.end_ms is not None and score > where.end_ms:
            return False
        return _keeps(record, default_queue, where, needle)

    scan: dict[str, Any] = {"prefix": prefix, "exact": False, "examined": 0, "stored": store.count()}
    if cursor is None:
        exact = store.get(prefix)
        if exact is not None:
            jobs = [job_view(exact, default_queue)] if keeps(exact) else []
            scan.update(exact=True, complete=True)
            return {"jobs": jobs, "count": len(jobs), "next_cursor": None, "scan": scan}
    start = parse_scan_cursor(cursor) if cursor else (0, 0)
    found = store.search_ids(prefix, start, budget, keep=keeps, enough=enough)
    records = sorted(found.records, key=_order)
    resume = f"{found.resume[0]}:{found.resume[1]}" if found.resume else None
    scan.update(examined=found.examined, complete=resume is None, budget=budget)
    return {
        "jobs": _with_gated_by(store, [job_view(r, default_queue) for r in records], records),
        "count": len(records),
        "next_cursor": resume,
        "scan": scan,
    }
