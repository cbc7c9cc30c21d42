"""The JSON views of what is stored: the shapes ``celery delayq ... --json`` prints and the web
dashboard's JSON API serves (``celery_delayq.web``), built in one place so that the two agree.

Nothing here needs ``rich`` or ``click``; every read goes through :class:`~..store.facade.Store`.
Times are ISO-8601 in UTC with milliseconds (:func:`iso`); a field ending in ``_ms`` holds
the same time as milliseconds since the epoch.

>>> iso(1_700_000_000_500)
'2023-11-14T22:13:20.500Z'

Listing and searching live in :mod:`.listing`, the status view in :mod:`.status`.
"""

from __future__ import annotations

import functools
import math
import shlex
import unicodedata
from collections.abc import Iterator
from datetime import timedelta, tzinfo
from typing import Any, Protocol

from ..due import ms_to_datetime
from ..flow.gate import GATE_HEADER, Gate, batch_of, completion_id
from ..schedules.spec import Schedule
from ..store.batches import BatchState
from ..store.envelope import decode_envelope
from ..store.facade import Store
from ..store.flow import KeyState
from ..store.jobs import JobRecord
from ..store.stored_forms import loaded_form
from .jobs import CANCELLED, DELIVERING, MOVED, DelayQ

__all__ = [
    "CANCEL_TEXT",
    "JOB_STATES",
    "GateReads",
    "PageReads",
    "batch_json",
    "batches_view",
    "bucket_ms",
    "cancel_result",
    "dead_page",
    "dead_view",
    "gated_by",
    "gated_reason",
    "iso",
    "job_detail",
    "job_view",
    "key_json",
    "keys_view",
    "local_text",
    "missing_text",
    "move_result",
    "point_refusal",
    "schedule_json",
    "shown",
]


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


def shown(text: str) -> str:
    """``text`` as it is, or its ``repr`` when it holds a control character: a job id stored by
    an older version (or any text from the store) with a newline or a tab would break the line
    it is printed on, and look like another id. The CLI prints it so, and the dashboard shows it
    so (its ``shown`` filter); the JSON views keep the text as it is.

    >>> print(shown("invoice-42"), shown("a\\nb"))
    invoice-42 'a\\nb'
    """
    if text.isprintable() or not any(unicodedata.category(c) == "Cc" for c in text):
        return text
    return repr(text)


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
            keyed=envelope.keyed if envelope else None,
            envelope_error=error,
            dead=None,
        )
    elif error:
        out["task"] = "<corrupt envelope>"
    return out


class GateReads(Protocol):
    """The reads :func:`gated_reason` makes: a :class:`Store`, or :class:`PageReads`."""

    def key_state(self, key: str) -> KeyState: ...

    def batch_state(self, batch_id: str) -> BatchState | None: ...


class PageReads:
    """A :class:`Store`'s key and batch reads, each key and batch read once: what the gated
    jobs of one listed page wait for costs a read per key or batch, not per job."""

    def __init__(self, store: Store) -> None:
        self.key_state = functools.cache(store.key_state)
        self.batch_state = functools.cache(store.batch_state)


def gated_by(reads: GateReads, record: JobRecord, now_ms: int) -> str | None:
    """What a listed gated job waits for (a key of :data:`GATED_BY`, or ``"released"``); None
    for a job that is not gated. Its headers are read from its stored message."""
    if record.state != "gated":
        return None
    try:
        envelope = decode_envelope(record.envelope)
    except ValueError:
        headers: dict[str, Any] = {}
    else:
        extra = envelope.route.get("headers")
        headers = {**envelope.headers, **(extra if isinstance(extra, dict) else {})}
    return gated_reason(reads, record, headers, now_ms)[0]


def gated_reason(store: GateReads, record: JobRecord, headers: Any, now_ms: int) -> tuple[str, str]:
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
    outcome = dq.cancel(job_id)
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
    outcome = dq.reschedule(job_id, due_ms / 1000.0)
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


def batch_state_text(sealed: bool, done: bool) -> str:
    """A batch's state in words: ``open (not sealed)``, ``done`` or ``-`` (sealed, running)."""
    return "open (not sealed)" if not sealed else ("done" if done else "-")


def batch_json(state: BatchState) -> dict[str, Any]:
    """The JSON of one batch (stable keys; ``sealed`` False: an open batch, members may be
    added, ``expires`` is when it is removed unless sealed by then)."""
    return {
        "id": state.batch_id,
        **state.progress(),
        "done": state.done,
        "sealed": state.sealed,
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
