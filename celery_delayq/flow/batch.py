"""Batches: many signatures stored at once as the members of one gate key, with progress,
a completion callback fired once, and a handle that any process can get back by its id.

``DelayQ(app).batch(signatures, ...)`` (:func:`store_batch`) builds every member's message
first (nothing is stored when one is refused), then opens the batch in Redis
(``Store.open_batch``: its counters and its parked completion job) and stores the members
in one pipeline. Member number ``i`` is stored under ``{batch:<id>}:<i>``
(:func:`~.gate.member_id`), with the gate header of key ``batch:<id>``: the beat releases
at most ``concurrency_limit`` of them at once, and the worker counts each one that ends.

Members are grouped by task and options, so the message of a group is planned once and
each member only adds its id and arguments (:func:`~..producer.build.build_envelopes`).

>>> check_batch_id("b-2026-11-24"), member_id("b-2026-11-24", 0)
('b-2026-11-24', '{batch:b-2026-11-24}:0')
"""

from __future__ import annotations

import time
import unicodedata
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery.canvas import Signature, _chain, _chord, group

from ..config import DelayQConfig
from ..due import due_ms_from_eta
from ..exceptions import (
    BatchExists,
    BatchNotFound,
    BatchSealed,
    DelayQError,
    InvalidBatch,
    InvalidOptions,
    StoreFull,
    UnknownTask,
)
from ..producer.build import build_envelopes
from ..producer.options import short_repr
from ..producer.plans import app_state, frozen_options
from ..store.envelope import decode_envelope
from ..store.facade import get_store
from .gate import (
    BATCH_DONE_HEADER,
    BATCH_PREFIX,
    GATE_HEADER,
    GATE_OPTIONS,
    MAX_KEY_LENGTH,
    Gate,
    batch_key,
    check_limit,
    check_priority,
    completion_id,
    member_id,
)

if TYPE_CHECKING:
    from ..store.batches import BatchState

__all__ = ["OPEN_BATCH_EXPIRES", "BatchResult", "OpenBatch", "check_batch_id", "open_batch", "store_batch"]

#: Seconds an open batch (:func:`open_batch`) is kept unsealed after its open or its last add:
#: past that, the beats' sweep deletes it (its waiting members cancelled; its on_complete never
#: runs). One day by default.
OPEN_BATCH_EXPIRES = 86_400.0


class BatchResult:
    """The handle of a stored batch: ``DelayQ(app).batch(...)`` returns it, and
    :meth:`restore` (or ``DelayQ(app).batch_result(id)``) gets it back from its id in any
    process.

    * :meth:`progress`: ``{"total", "waiting", "running", "succeeded", "failed", "cancelled"}``;
    * :meth:`join`: wait until every member ended (woken by the batch's notification);
    * :meth:`cancel`: remove the members that have not been released yet.
    """

    def __init__(self, id: str, app: Any) -> None:
        self.id = id
        self.app = app

    @classmethod
    def restore(cls, batch_id: str, app: Any) -> BatchResult | None:
        """The handle of the stored batch ``batch_id``; None when there is no such batch. An
        open batch not sealed yet gets an :class:`OpenBatch` (members can be added, and it
        can be sealed, from any process)."""
        state = get_store(app).batch_state(batch_id)
        if state is None:
            return None
        return cls(batch_id, app) if state.sealed else OpenBatch(batch_id, app)

    def state(self) -> BatchState:
        """The batch's counters as they are in Redis now; :class:`BatchNotFound` (a ``LookupError``)
        when it is gone."""
        state = get_store(self.app).batch_state(self.id)
        if state is None:
            raise BatchNotFound(f"batch {self.id!r} is not stored (never made, deleted, or expired)")
        return state

    def progress(self) -> dict[str, int]:
        """How many members are waiting (not released yet: due later, parked, or in the
        broker's hands before the gate), running, succeeded, failed and cancelled, of ``total``."""
        return self.state().progress()

    @property
    def done(self) -> bool:
        """True once every member ended (succeeded, failed or cancelled)."""
        return self.state().done

    def join(self, timeout: float | None = None) -> dict[str, int]:
        """Block until every member ended; return :meth:`progress` then.

        Subscribes to the batch channel first and reads the batch then, so a completion
        between the two is not missed; then sleeps until the completion notification
        (``"<id>|<counts>"``), not by polling. ``TimeoutError`` after ``timeout`` seconds.
        """
        store = get_store(self.app)
        deadline = None if timeout is None else time.monotonic() + timeout
        subscription = store.batch_subscription()
        opening = f"{self.id}|"
        try:
            state = self.state()
            while not state.done:
                remaining = 60.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"batch {self.id!r} not complete after {timeout} s: {state.progress()}"
                    )
                message = subscription.get_message(timeout=min(remaining, 60.0))
                if message is None:
                    # a minute without news (or a lost connection's message): look again
                    state = self.state()
                    continue
                data = message.get("data")
                if isinstance(data, bytes):
                    data = data.decode("utf-8", "replace")
                if isinstance(data, str) and data.startswith(opening):
                    state = self.state()
        finally:
            subscription.close()
        return state.progress()

    def cancel(self) -> int:
        """Remove every member not released yet (waiting, parked or deferred); how many.
        Members running or being published are left to end; the batch completes once they
        have (the cancelled ones count as ``cancelled``)."""
        return get_store(self.app).cancel_batch(self.id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.id}>"


class OpenBatch(BatchResult):
    """The handle of an open batch (``DelayQ(app).open_batch(...)``, or
    ``DelayQ(app).open_batch_result(id)`` in another process): :meth:`add` members over time,
    from any number of processes, then :meth:`seal` it once. It completes (on_complete runs,
    once) only after the seal, when every member added ended.

    ``DelayQ(app).batch_result(id)`` returns one for a batch not sealed yet.
    """

    def add(self, signatures: Any, eta: Any = None) -> list[str]:
        """Store ``signatures`` as more members of the batch, due at ``eta`` (None: now); their
        job ids. Each message is built and checked first (nothing stored when one is refused);
        then their numbers are reserved in one script (``lua/batch_grow.lua``: the total grows
        by as many; two processes adding at once get disjoint numbers) and they are stored.
        :class:`BatchSealed` once the batch is sealed, :class:`BatchNotFound` when it is gone
        (deleted, or expired unsealed): nothing stored then. A ``StoreFull`` after the numbers
        were reserved (or a crash between) leaves the batch with members that never end: it
        never completes; delete it (``delete --force``)."""
        members = _member_list(signatures)
        store = get_store(self.app)
        relative = eta is None
        due_ms = store.server_now_ms() if relative else due_ms_from_eta(eta, self.app)
        # built first as members 0..n-1 without the batch's limit and priority (a bad member
        # raises before a number is reserved), then under the numbers reserved, with them
        checked = _member_envelopes(self.app, self.id, 0, members, due_ms, None, None)
        status, first, meta = store.grow_batch(self.id, len(members))
        if status == "missing":
            raise BatchNotFound(
                f"batch {self.id!r} is not stored (deleted, or expired unsealed): no member added"
            )
        if status == "sealed":
            raise BatchSealed(
                f"batch {self.id!r} is sealed: no member can be added to it (open another batch)"
            )
        limit, prio = meta.get("limit"), meta.get("priority")
        envelopes = checked
        if first != 0 or limit is not None or prio is not None:  # (else: as checked)
            envelopes = _member_envelopes(self.app, self.id, first, members, due_ms, limit, prio)
        ids = [member_id(self.id, first + i) for i in range(len(members))]
        _store_members(store, ids, envelopes, due_ms, relative)
        return ids

    def seal(self) -> bool:
        """Seal the batch (``lua/batch_seal.lua``): no member is added after, and it completes
        when every member added ended (at once, in this call, when they all have). True when
        this call sealed it, False when it was sealed already; :class:`BatchNotFound` when it
        is gone (deleted, or expired unsealed)."""
        status, _ = get_store(self.app).seal_batch(self.id)
        if status == "missing":
            raise BatchNotFound(f"batch {self.id!r} is not stored (deleted, or expired unsealed): not sealed")
        return status == "sealed"


def open_batch(
    app: Any,
    *,
    concurrency_limit: Any = None,
    priority: Any = None,
    on_complete: Any = None,
    batch_id: Any = None,
    expires: Any = OPEN_BATCH_EXPIRES,
) -> OpenBatch:
    """``DelayQ(app).open_batch``: see :meth:`celery_delayq.DelayQ.open_batch`."""
    limit = None if concurrency_limit is None else check_limit(concurrency_limit)
    prio = None if priority is None else check_priority(priority)
    bid = str(uuid.uuid4()) if batch_id is None else check_batch_id(batch_id)
    if isinstance(expires, bool) or not isinstance(expires, int | float) or not 0.001 <= expires < 2**40:
        raise InvalidBatch(
            f"expires={short_repr(expires)}: an open batch's expiry is a number of seconds >= 0.001"
        )
    store = get_store(app)
    completion = _completion(app, bid, on_complete, store.server_now_ms())
    meta = {"limit": limit, "priority": prio}
    if not store.open_batch(bid, 0, completion, meta, open_ms=max(int(expires * 1000), 1)):
        raise BatchExists(f"batch {bid!r} is stored already: give another batch_id (or leave it out)")
    return OpenBatch(bid, app)


def check_batch_id(batch_id: Any) -> str:
    """``batch_id`` when a batch can be stored under it: a non-empty string without ``{``,
    ``}``, ``|`` or a control character (it is part of its jobs' ids), short enough for its key
    ``batch:<id>`` to be a gate key."""
    most = MAX_KEY_LENGTH - len(BATCH_PREFIX)
    if (
        isinstance(batch_id, str)
        and 0 < len(batch_id) <= most
        and not any(c in batch_id for c in "{}|")
        and (batch_id.isprintable() or not any(unicodedata.category(c) == "Cc" for c in batch_id))
    ):
        return batch_id
    raise InvalidBatch(
        f"batch_id={short_repr(batch_id)}: a batch id is a non-empty string of at most {most} "
        "characters without '{', '}', '|' or a control character (or leave it out and one is made)"
    )


def _task_signature(sig: Any, what: str) -> Any:
    """The task of ``sig`` when it is one task's signature; else :class:`InvalidBatch`."""
    if not isinstance(sig, Signature) or isinstance(sig, _chain | group | _chord):
        kind = type(sig).__name__
        raise InvalidBatch(
            f"{what} is a {kind} ({short_repr(sig)}): give one task's signature, task.s(...) or "
            "task.si(...) (a chain, group or chord is not a batch member or callback)"
        )
    for name in GATE_OPTIONS:
        if sig.options.get(name) is not None:
            raise InvalidBatch(
                f"{what} sets {name}: a batch's members count against the batch's own key; give "
                "the cap as DelayQ(app).batch(..., concurrency_limit=n)"
            )
    if sig.options.get("task_id") is not None:
        raise InvalidBatch(
            f"{what} sets task_id={short_repr(sig.options['task_id'])}: the ids of a batch's jobs are "
            "made by the batch ({batch:<id>}:<n>, {batch:<id>}:complete); leave task_id out"
        )
    try:
        return sig.type
    except KeyError:
        raise UnknownTask(
            f"{what}: task {sig.task!r} is not registered in the app: import the module that defines it",
            sig.task,
        ) from None


def _first_failing(build: Callable[[Sequence[Any]], Any], jobs: Sequence[Any]) -> int:
    """The position of the first job ``build`` refuses (given that it refuses ``jobs``):
    halves are built, the failing half looked into; about ``len(jobs)`` builds in all."""
    start, end = 0, len(jobs)
    while end - start > 1:
        middle = (start + end) // 2
        try:
            build(jobs[start:middle])
        except Exception:
            end = middle
        else:
            start = middle
    return start


def _member_error(exc: Exception, what: str) -> Exception:
    """``exc`` of the same class, its message opening with ``what`` (the member)."""
    try:
        return type(exc)(f"{what}: {exc}")
    except Exception:  # a class that takes other arguments: as it was
        return exc


def store_batch(
    app: Any,
    signatures: Any,
    eta: Any = None,
    *,
    concurrency_limit: Any = None,
    priority: Any = None,
    on_complete: Any = None,
    batch_id: Any = None,
) -> BatchResult:
    """``DelayQ(app).batch``: see :meth:`celery_delayq.DelayQ.batch`."""
    members = _member_list(signatures)
    limit = None if concurrency_limit is None else check_limit(concurrency_limit)
    prio = None if priority is None else check_priority(priority)
    bid = str(uuid.uuid4()) if batch_id is None else check_batch_id(batch_id)
    store = get_store(app)
    # eta None: now on the server's clock, stored as a delay of 0 (added to the script's TIME)
    relative = eta is None
    due_ms = store.server_now_ms() if relative else due_ms_from_eta(eta, app)
    envelopes = _member_envelopes(app, bid, 0, members, due_ms, limit, prio)
    completion = _completion(app, bid, on_complete, due_ms)
    opening = member_id(bid, 0)[:-1]  # member i: opening + str(i)
    ids = [f"{opening}{i}" for i in range(len(members))]
    meta = {"limit": limit, "priority": prio, "eta": due_ms}
    try:
        opened = store.open_batch(bid, len(members), completion, meta)
    except StoreFull as exc:  # nothing of the batch is stored: every member is named
        refused = f"batch {bid!r} not opened, none of its {len(ids)} member(s) stored"
        raise StoreFull([], ids, list(range(len(ids))), refused) from exc.__cause__
    if not opened:
        raise BatchExists(f"batch {bid!r} is stored already: give another batch_id (or leave it out)")
    _store_members(store, ids, envelopes, due_ms, relative)
    return BatchResult(bid, app)


def _store_members(store: Any, ids: list[str], envelopes: list[str], due_ms: int, relative: bool) -> None:
    """Store the members ``ids`` with their ``envelopes``, due at ``due_ms`` (``relative``: now
    on the server's clock, stored as a delay of 0)."""
    shift = due_ms if relative else 0
    store.enqueue(
        [(job_id, due_ms - shift, envelope) for job_id, envelope in zip(ids, envelopes, strict=True)],
        relative=relative,
    )


def _member_list(signatures: Any) -> list[Any]:
    """``signatures`` as a list of at least one; else :class:`InvalidBatch`."""
    if isinstance(signatures, str | bytes | Mapping) or not hasattr(signatures, "__iter__"):
        raise InvalidBatch(
            f"the members of a batch are a list of signatures, got {type(signatures).__name__}: "
            f"{short_repr(signatures)}"
        )
    members = list(signatures)
    if not members:
        raise InvalidBatch("a batch needs at least one member: give a list of signatures, [task.s(...), ...]")
    return members


def _member_envelopes(
    app: Any, bid: str, first: int, members: Sequence[Any], due_ms: int, limit: int | None, prio: int | None
) -> list[str]:
    """The envelopes of ``members``, member ``first + i`` of batch ``bid`` each, due at ``due_ms``:
    a bad member raises (naming it) before anything is stored."""
    state = app_state(app)
    max_payload = DelayQConfig.from_app(app).max_payload
    # Members by task and options: one plan per group. (A Signature is a dict: its fields
    # are read as items, the common case of a plain signature without options at once.)
    groups: dict[Any, tuple[Any, dict[str, Any], list[int]]] = {}
    tasks: dict[Any, Any] = {}
    no_options = frozen_options({})
    for index, sig in enumerate(members):
        if type(sig) is Signature and not sig["options"]:
            made_with = sig._type or sig["task"]  # (what Signature.type reads)
            task = tasks.get(made_with)
            if task is None:
                task = tasks[made_with] = _task_signature(sig, f"batch member {index}")
            group_key: Any = (id(task), no_options)
            options = sig["options"]
        else:
            task = _task_signature(sig, f"batch member {index}")
            options = sig.options
            frozen = frozen_options(options)  # (an option that is an object: by identity)
            group_key = (id(task), ("id", id(options)) if frozen is None else frozen)
        entry = groups.get(group_key)
        if entry is None:
            groups[group_key] = (task, options, [index])
        else:
            entry[2].append(index)

    envelopes: list[str] = [""] * len(members)
    opening = member_id(bid, 0)[:-1]  # member i: opening + str(i)
    for task, sig_options, indices in groups.values():
        options = dict(sig_options)
        if prio is not None and options.get("priority") is None:
            options["priority"] = prio
        own = options.get("priority")
        try:
            gate = Gate(batch_key(bid), limit, None, 0 if own is None else check_priority(own), bid)
        except InvalidOptions as exc:
            raise _member_error(exc, f"batch member {indices[0]} ({task.name!r})") from exc
        headers = options.get("headers")
        if headers is None or isinstance(headers, Mapping):
            options["headers"] = {**(headers or {}), GATE_HEADER: gate.header()}
        jobs = [(f"{opening}{first + i}", due_ms, members[i]["args"], members[i]["kwargs"]) for i in indices]

        def build(part: Sequence[Any], task: Any = task, options: dict[str, Any] = options) -> list[str]:
            return build_envelopes(app, task, part, options, max_payload=max_payload, state=state)

        try:
            built = build(jobs)
        except (DelayQError, TypeError, ValueError) as exc:
            at = indices[_first_failing(build, jobs)] if len(jobs) > 1 else indices[0]
            raise _member_error(exc, f"batch member {at} ({task.name!r})") from exc
        for i, envelope in zip(indices, built, strict=True):
            envelopes[i] = envelope

    return envelopes


def _completion(app: Any, bid: str, on_complete: Any, due_ms: int) -> tuple[str, str] | None:
    """The completion job ``(id, envelope)`` of batch ``bid`` (None without ``on_complete``)."""
    if on_complete is not None and not isinstance(on_complete, Signature):
        raise InvalidBatch(
            f"on_complete must be a signature (task.s(...)), got {type(on_complete).__name__}: "
            f"{short_repr(on_complete)}"
        )
    completion_task = None if on_complete is None else _task_signature(on_complete, "on_complete")
    state = app_state(app)
    max_payload = DelayQConfig.from_app(app).max_payload
    completion: tuple[str, str] | None = None
    if completion_task is not None and on_complete is not None:
        options = dict(on_complete.options)
        headers = options.get("headers")
        if headers is None or isinstance(headers, Mapping):
            options["headers"] = {**(headers or {}), BATCH_DONE_HEADER: bid}
        job = (completion_id(bid), due_ms, on_complete.args, on_complete.kwargs)
        try:
            [envelope] = build_envelopes(
                app,
                completion_task,
                [job],
                options,
                max_payload=max_payload,
                state=state,
                appended=(bid, dict.fromkeys(("total", "succeeded", "failed", "cancelled"), 0)),
            )
        except (DelayQError, TypeError, ValueError) as exc:
            raise _member_error(exc, "on_complete") from exc
        decoded = decode_envelope(envelope)
        if not decoded.json_body:
            raise InvalidBatch(
                f"on_complete ({completion_task.name!r}) is sent as {decoded.content_type}: the batch "
                "id and counts are added to its JSON arguments when it is sent, so give it "
                ".set(serializer='json')"
            )
        completion = (completion_id(bid), envelope)

    return completion
