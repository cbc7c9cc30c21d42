"""The JSON views of what is stored: the shapes ``celery delayq ... --json`` prints and the web
dashboard's JSON API serves (``celery_delayq.web``), built in one place so that the two agree.

Nothing here needs ``rich`` or ``click``; every read goes through :class:`~.store.Store`.
Times are ISO-8601 in UTC with milliseconds (:func:`iso`); a field ending in ``_ms`` holds
the same time as milliseconds since the epoch.

>>> iso(1_700_000_000_500)
'2023-11-14T22:13:20.500Z'
>>> parse_cursor("1700000000500:3:reminder-42")
(1700000000500, 3, b'reminder-42')
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta, tzinfo
from typing import Any

from ..due import ms_to_datetime
from ..exceptions import InvalidInput
from ..flow.gate import GATE_HEADER, Gate, batch_of, completion_id
from ..schedules.spec import Schedule
from ..store import lateness
from ..store.envelope import decode_envelope, loaded_form
from ..store.facade import BatchState, JobRecord, KeyState, ShardStats, Store
from .jobs import CANCELLED, DELIVERING, MOVED, DelayQ

__all__ = [
    "BEAT_ALIVE_MS",
    "CANCEL_TEXT",
    "GATED_BY",
    "JOB_STATES",
    "JobFilter",
    "batch_json",
    "batches_view",
    "beat_view",
    "bucket_ms",
    "cancel_result",
    "cursor_text",
    "dead_page",
    "dead_view",
    "gated_counts",
    "gated_reason",
    "id_search",
    "iso",
    "job_detail",
    "job_view",
    "jobs_page",
    "key_json",
    "keys_view",
    "lateness_view",
    "lateness_window_view",
    "local_text",
    "missing_text",
    "move_result",
    "parse_cursor",
    "parse_scan_cursor",
    "point_refusal",
    "schedule_json",
    "shard_view",
    "status_view",
    "stored_lateness",
]

#: A beat whose heartbeat is older than this (ms) is shown as stale.
BEAT_ALIVE_MS = 60_000

#: The states a job listing can be narrowed to (``Store.scan``'s states).
JOB_STATES = ("waiting", "leased", "gated", "running")


def iso(ms: int | float | None) -> str | None:
    """ISO-8601 in UTC (JSON output), None stays None.

    >>> iso(0), iso(None)
    ('1970-01-01T00:00:00.000Z', None)
    """
    return (
        None if ms is None else ms_to_datetime(ms).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def local_text(ms: int | float | None, tz: tzinfo) -> str:
    """A time for humans, in timezone ``tz``: ``2026-11-21 15:03:07Z``, ``... 16:03:07+01:00``.

    >>> from zoneinfo import ZoneInfo
    >>> local_text(1_700_000_000_500, ZoneInfo("UTC")), local_text(0, ZoneInfo("Europe/Paris"))
    ('2023-11-14 22:13:20Z', '1970-01-01 01:00:00+01:00')
    >>> local_text(None, ZoneInfo("UTC"))
    '-'
    """
    if ms is None:
        return "-"
    local = ms_to_datetime(ms).astimezone(tz)
    text = local.strftime("%Y-%m-%d %H:%M:%S")
    offset = local.utcoffset() or timedelta(0)
    if not offset:
        return text + "Z"
    return text + local.strftime("%z")[:3] + ":" + local.strftime("%z")[3:]


def bucket_ms(window_ms: int) -> int:
    """One minute, or more for long windows (at most 60 columns), in whole minutes.

    >>> bucket_ms(3_600_000), bucket_ms(86_400_000)
    (60000, 1440000)
    """
    return max(60_000, math.ceil(window_ms / 60 / 60_000) * 60_000)


# -- jobs -------------------------------------------------------------------------------------------


def job_view(record: JobRecord, default_queue: str, detail: bool = False) -> dict[str, Any]:
    """The JSON of one job (stable keys; ``detail`` adds the message's options and headers)."""
    out: dict[str, Any] = {
        "id": record.id,
        "state": record.state,
        "task": None,
        "shard": record.shard,
        "due": iso(record.due_ms),
        "due_ms": record.due_ms,
        "queue": None,
        "args": None,
        "kwargs": None,
        "tries": record.tries,
        "lease_until": iso(record.lease_until_ms),
        "schedule": None,
    }
    envelope = None
    error = None
    try:
        envelope = decode_envelope(record.envelope)
    except ValueError as exc:
        error = str(exc)
    if envelope is not None:
        args, kwargs = envelope.arguments(reprs_if_unreadable=True)
        out.update(
            task=envelope.task,
            queue=default_queue if envelope.queue is None else envelope.queue,
            args=args,
            kwargs=kwargs,
            schedule=envelope.schedule[0] if envelope.schedule else None,
        )
    if detail:
        out.update(
            created=iso(envelope.created_ms) if envelope and envelope.created_ms else None,
            expires=iso(envelope.expires_ms) if envelope and envelope.expires_ms is not None else None,
            options=dict(envelope.route) if envelope else None,
            headers=dict(envelope.headers) if envelope else None,
            properties=dict(envelope.props) if envelope else None,
            content_type=envelope.content_type if envelope else None,
            content_encoding=envelope.content_encoding if envelope else None,
            envelope_error=error,
            dead=None,
        )
    elif error:
        out["task"] = "<corrupt envelope>"
    return out


def gated_reason(store: Store, record: JobRecord, headers: Any, now_ms: int) -> tuple[str, str]:
    """What a gated job waits for: a key of :data:`GATED_BY` (or ``"released"``: its key let it
    through, a beat claims it now) and a sentence saying so, read per key (its state, or its
    batch's counts), never by scanning jobs."""
    bid = batch_of(record.id)
    gate = Gate.from_header(headers.get(GATE_HEADER)) if isinstance(headers, dict) else None
    if record.lease_until_ms is None:  # parked: score PARK_MS
        if bid is not None and record.id == completion_id(bid):
            batch = store.batch_state(bid)
            if batch is None:
                return "batch", f"batch {bid!r} not complete (its record is gone)"
            ended = batch.succeeded + batch.failed + batch.cancelled
            return "batch", (
                f"batch {bid!r} not complete: {ended:,} of {batch.total:,} members ended; "
                "this completion job is published when the last one ends"
            )
        if gate is None:
            return "slot", "parked by its key (its gate header does not read)"
        key = store.key_state(gate.key)
        if key.paused:
            return "paused", (
                f"key {gate.key!r} is paused: released when it is resumed "
                f"(`celery delayq resume {shlex.quote(gate.key)}`); {key.waiting:,} job(s) of it wait"
            )
        limit = "no limit" if key.limit is None else f"its limit of {key.limit:,}"
        return "slot", (
            f"waiting for a slot: key {gate.key!r} runs {key.running:,} job(s), {limit}; "
            "released when one of them ends"
        )
    if record.lease_until_ms > now_ms:
        key_text = f" of key {gate.key!r}" if gate is not None else ""
        return "rate", f"deferred by the rate{key_text}: released when its turn comes (lease_until)"
    return "released", "released by its key: a beat claims it now"


def job_detail(store: Store, default_queue: str, job_id: str) -> dict[str, Any] | None:
    """``delayq show ID --json``: a waiting, leased, gated, running or dead job; None: no such
    id. A gated job says what it waits for (``gated_by``: a key of :data:`GATED_BY` or
    ``"released"``; ``gated_reason``: a sentence)."""
    record = store.get(job_id)
    if record is None:
        return None
    view = job_view(record, default_queue, detail=True)
    view["gated_by"] = view["gated_reason"] = None
    if record.state == "gated":
        # The message's headers: its own and its route's (as publish.message_headers merges them).
        extra = (view.get("options") or {}).get("headers")
        headers = {**(view.get("headers") or {}), **(extra if isinstance(extra, dict) else {})}
        view["gated_by"], view["gated_reason"] = gated_reason(store, record, headers, store.server_now_ms())
    if record.state == "dead":
        dead = store.dead_record(job_id) or {}
        view["dead"] = {k: dead.get(k) for k in ("reason", "beat")}
        view["dead"]["dead_at"] = iso(dead["dead_at"]) if dead.get("dead_at") else None
    return view


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
        "jobs": [job_view(r, default_queue) for r in shown],
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
    otherwise :meth:`~.store.Store.search_ids` examines about ``budget`` ids from ``cursor`` on
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
        "jobs": [job_view(r, default_queue) for r in records],
        "count": len(records),
        "next_cursor": resume,
        "scan": scan,
    }


# -- actions on jobs (``delayq cancel|reschedule|run-now`` and the dashboard's) --------------------

#: What each outcome of a cancel says (a missing job: :func:`missing_text`).
CANCEL_TEXT = {
    CANCELLED: "cancelled",
    DELIVERING: "removed, but a beat was delivering it at that moment: it may already be in the broker",
}


def point_refusal(dq: DelayQ, job_id: str, what: str) -> str | None:
    """Why ``job_id`` may not be ``what`` (``cancel``, ``reschedule``, ``run``): it is a
    schedule's next run; None: it is not one."""
    name = dq.is_schedule_point(job_id)
    if name is None:
        return None
    return (
        f"{job_id!r} is the next run of schedule {name!r}: {what} it with "
        f"`delayq schedules pause|update|rm|run-now {name}`"
    )


def missing_text(store: Store, job_id: str) -> str:
    """What a job found neither waiting nor leased is: dead-lettered, or not stored at all."""
    if store.dead_record(job_id) is not None:
        return f"no waiting job {job_id!r}: it is dead-lettered (see `delayq dead show {job_id}`)"
    return f"no job with id {job_id!r}"


def cancel_result(dq: DelayQ, store: Store, job_id: str) -> dict[str, Any]:
    """Cancel one job: ``{"id", "outcome", "message"}`` as ``delayq cancel --json`` prints it
    (outcome ``cancelled``, ``delivering``, ``missing`` or ``schedule-point``: refused)."""
    refusal = point_refusal(dq, job_id, "cancel")
    if refusal:
        return {"id": job_id, "outcome": "schedule-point", "message": refusal}
    outcome = dq.cancel_outcome(job_id)
    message = CANCEL_TEXT.get(outcome) or missing_text(store, job_id)
    if outcome == DELIVERING:
        message = f"{job_id!r} {message}"
    return {"id": job_id, "outcome": str(outcome), "message": message}


def move_result(
    dq: DelayQ, store: Store, job_id: str, due_ms: int, what: str, due_text: str
) -> dict[str, Any]:
    """Move one waiting job to ``due_ms`` (``what``: ``reschedule``, or ``run`` for run-now):
    ``{"id", "outcome", "message", "due"}`` as ``delayq reschedule --json`` prints it (outcome
    ``moved``, ``delivering``, ``missing``, or ``schedule-point`` without ``due``: refused).
    ``due_text`` is the message of a move (``due <time> (in 5m)``, as the caller writes times)."""
    refusal = point_refusal(dq, job_id, what)
    if refusal:
        return {"id": job_id, "outcome": "schedule-point", "message": refusal}
    outcome = dq.reschedule_outcome(job_id, due_ms / 1000.0)
    if outcome == MOVED:
        message = due_text
    elif outcome == DELIVERING:
        message = f"{job_id!r} not moved: a beat is delivering it now"
    else:
        message = missing_text(store, job_id)
    return {"id": job_id, "outcome": str(outcome), "message": message, "due": iso(due_ms)}


# -- dead letters -----------------------------------------------------------------------------------


def dead_view(
    store: Store, default_queue: str, job_id: str, record: dict[str, Any], detail: bool = False
) -> dict[str, Any]:
    """The JSON of one dead letter: a job's view plus why and when it died (``detail``: as
    ``delayq dead show --json``, with the reason under ``dead``)."""
    envelope_text = record.get("envelope") or ""
    job = JobRecord(
        job_id,
        store.keys.shard_of(job_id),
        int(record.get("due") or 0),
        loaded_form(job_id, envelope_text) if isinstance(envelope_text, str) else "",
        "dead",
        int(record.get("tries") or 0),
    )
    view = job_view(job, default_queue, detail=detail)
    if view["task"] in (None, "<corrupt envelope>") and record.get("task"):
        view["task"] = record["task"]
    dead_at = record.get("dead_at")
    dead = {
        "reason": record.get("reason"),
        "dead_at": iso(dead_at) if isinstance(dead_at, int | float) else None,
        "beat": record.get("beat"),
    }
    if detail:
        view["dead"] = dead
    else:
        view.update(reason=dead["reason"], dead_at=dead["dead_at"], dead_at_ms=dead_at)
    return view


def dead_page(
    store: Store,
    default_queue: str,
    dead: Iterator[tuple[str, dict[str, Any]]],
    task: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> dict[str, Any]:
    """``delayq dead ls --json``: ``{"dead": [...], "count": n, "total": m}``, newest first.

    ``dead`` is ``DelayQ.dead()`` (every dead letter: an HSCAN of each shard)."""
    views = [dead_view(store, default_queue, job_id, record) for job_id, record in dead]
    if task:
        views = [v for v in views if v["task"] == task]
    views.sort(key=lambda v: (-(v["dead_at_ms"] or 0), v["id"]))
    page = views[offset : offset + limit]
    return {"dead": page, "count": len(page), "total": len(views)}


# -- schedules, keys, batches -------------------------------------------------------------------------


def schedule_json(sch: Schedule) -> dict[str, Any]:
    """``Schedule.to_json()`` with its times as the CLI writes every time (UTC, ms, ``Z``)."""
    out = sch.to_json()
    for name in ("created", "updated", "last_run", "next_run"):
        value = getattr(sch, name)
        out[name] = iso(value.timestamp() * 1000) if value is not None else None
    return out


def key_json(state: KeyState) -> dict[str, Any]:
    """The JSON of one key (stable keys): ``limit`` is the one in force (the run-time one when
    set, else the one the key's last job carried; null: no cap), ``override`` the run-time one
    as stored ("none", "<n>", null)."""
    return {
        "key": state.key,
        "limit": state.limit,
        "override": state.override,
        "running": state.running,
        "waiting": state.waiting,
        "paused": state.paused,
    }


def keys_view(store: Store) -> dict[str, Any]:
    """``delayq keys --json``: every gate key, by name."""
    views = sorted((key_json(st) for st in store.key_states()), key=lambda v: v["key"])
    return {"keys": views, "count": len(views)}


def batch_json(state: BatchState) -> dict[str, Any]:
    """The JSON of one batch (stable keys)."""
    return {
        "id": state.batch_id,
        **state.progress(),
        "done": state.done,
        "created": iso(state.created_ms),
        "created_ms": state.created_ms,
        "expires": None if state.expires_ms is None else iso(state.expires_ms),
        "expires_ms": state.expires_ms,
    }


def batches_view(store: Store) -> dict[str, Any]:
    """``delayq batches --json``: every stored batch, newest first."""
    views = sorted((batch_json(b) for b in store.batch_states()),
                   key=lambda v: (-(v["created_ms"] or 0), v["id"]))  # fmt: skip
    return {"batches": views, "count": len(views)}


# -- status -----------------------------------------------------------------------------------------


def stored_lateness(store: Store, kind: str) -> lateness.Snapshot:
    """The ``kind`` (``publish``: the beats', ``start``: the workers') lateness histogram in Redis."""
    return lateness.read(store, store.config.prefix, kind)


def lateness_view(snap: lateness.Snapshot) -> dict[str, Any]:
    """A lateness histogram: count, mean, p50, p99 (bucket bounds, ms) and its buckets."""

    def finite(v: float | None) -> float | None:
        return v if v is not None and math.isfinite(v) else None

    return {
        "count": snap.count,
        "mean_ms": round(snap.mean_ms, 3) if snap.mean_ms is not None else None,
        "p50_ms": finite(snap.quantile(0.5)),
        "p99_ms": finite(snap.quantile(0.99)),
        "buckets": [
            {"le_ms": bound if math.isfinite(bound) else None, "count": n}
            for bound, n in zip((*lateness.BOUNDS, math.inf), snap.buckets, strict=True)
        ],
    }


def lateness_window_view(
    store: Store, kind: str, minutes: int = lateness.WINDOW_MINUTES, now_ms: int | None = None
) -> dict[str, Any]:
    """:func:`lateness_view` of the ``kind`` histogram over the last ``minutes`` minutes (the
    per-minute record, :func:`.lateness.read_window`; ``now_ms`` defaults to the server's now):
    the same shape."""
    return lateness_view(lateness.read_window(store, store.config.prefix, kind, minutes, now_ms))


def beat_view(token: str, raw: Any, now_ms: int) -> dict[str, Any]:
    """One beat's heartbeat: who, since when, last seen, counters, alive (seen in the last 60 s)."""
    entry = raw if isinstance(raw, dict) else {}
    keys = ("host", "pid", "started_ms", "seen_ms", "passes", "published", "dead_lettered", "errors")
    out: dict[str, Any] = {"token": token, **{k: entry.get(k) for k in keys}}
    seen = entry.get("seen_ms")
    seen_ok = isinstance(seen, int | float) and not isinstance(seen, bool)
    out["alive"] = bool(seen_ok and now_ms - float(seen or 0) <= BEAT_ALIVE_MS)
    out["seen"] = iso(seen) if seen_ok else None
    started = entry.get("started_ms")
    out["started"] = (
        iso(started) if isinstance(started, int | float) and not isinstance(started, bool) else None
    )
    if not isinstance(raw, dict):
        out["error"] = f"unreadable heartbeat {str(raw)[:60]!r}"
    return out


#: Why a gated job waits, as ``status --json`` counts them (``gated_by``) and ``show --json``
#: names a job's (``gated_by``), with the words every page and the CLI use for each.
GATED_BY = {
    "slot": "waiting for a slot",
    "paused": "key paused",
    "batch": "batch not complete",
    "rate": "deferred by rate",
}


def gated_counts(st: ShardStats) -> dict[str, int]:
    """A shard's gated jobs by what they wait for (the keys of :data:`GATED_BY`)."""
    return {"slot": st.gated_slot, "paused": st.gated_paused, "batch": st.gated_batch, "rate": st.gated_rate}


def shard_view(st: ShardStats) -> dict[str, Any]:
    """One shard's counts, oldest overdue and next due job."""
    return {
        "shard": st.shard,
        "waiting": st.waiting,
        "leased": st.leased,
        "running": st.running,
        "gated": st.gated,
        "gated_by": gated_counts(st),
        "dead": st.dead,
        "overdue": st.overdue,
        "oldest_overdue": iso(st.head_due_ms),
        "oldest_overdue_ms": st.head_due_ms,
        "oldest_overdue_id": st.head_id,
        "next_due": iso(st.next_due_ms),
        "next_due_ms": st.next_due_ms,
        "next_due_id": st.next_id,
        "schedules": st.schedules,
    }


def status_view(store: Store, url: str, window_ms: int = 3_600_000) -> dict[str, Any]:
    """``delayq status --json``: shards, totals, beats, lateness, and the jobs due in each
    bucket (:func:`bucket_ms`) of the next ``window_ms``. ``url`` is shown as given: pass it
    redacted (``config.redact_url``)."""
    stats = store.shard_stats()
    now = stats[0].now_ms
    bucket = bucket_ms(window_ms)
    buckets = math.ceil(window_ms / bucket) if window_ms else 0
    counts = store.due_counts(now, bucket, buckets)
    beats = sorted(
        (beat_view(token, raw, now) for token, raw in store.beats().items()),
        key=lambda b: (not b["alive"], -(b["seen_ms"] or 0) if isinstance(b["seen_ms"], int | float) else 0),
    )
    late = {kind: lateness_view(stored_lateness(store, kind)) for kind in ("publish", "start")}
    heads = [st for st in stats if st.head_due_ms is not None]
    nexts = [st for st in stats if st.next_due_ms is not None]
    oldest = min(heads, key=lambda st: st.head_due_ms or 0) if heads else None
    soonest = min(nexts, key=lambda st: st.next_due_ms or 0) if nexts else None
    totals = {
        "waiting": sum(st.waiting for st in stats),
        "leased": sum(st.leased for st in stats),
        "running": sum(st.running for st in stats),
        "gated": sum(st.gated for st in stats),
        "gated_by": {name: sum(gated_counts(st)[name] for st in stats) for name in GATED_BY},
        "dead": sum(st.dead for st in stats),
        "overdue": sum(st.overdue for st in stats),
        "schedules": sum(st.schedules for st in stats),
        "oldest_overdue": iso(oldest.head_due_ms) if oldest else None,
        "oldest_overdue_ms": oldest.head_due_ms if oldest else None,
        "oldest_overdue_id": oldest.head_id if oldest else None,
        "next_due": iso(soonest.next_due_ms) if soonest else None,
        "next_due_ms": soonest.next_due_ms if soonest else None,
        "next_due_id": soonest.next_id if soonest else None,
    }
    return {
        "prefix": store.config.prefix,
        "url": url,
        "now": iso(now),
        "now_ms": now,
        "shards": [shard_view(st) for st in stats],
        "totals": totals,
        "beats": beats,
        "lateness": late,
        "due": {"start": iso(now), "bucket_seconds": bucket // 1000, "counts": counts},
    }
