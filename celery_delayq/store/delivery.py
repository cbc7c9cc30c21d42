"""The beat's side of delivery: claim and push on claim (``lua/claim.lua``, ``lua/push.lua``),
the message templates of the push path, ack, lease renewal, pushing claimed jobs' messages
(``lua/push_claimed.lua``) and bury; and what they answer (:class:`ClaimResult`,
:class:`PushResult`, :class:`ClaimedJob`, :class:`PushClaimedReply`).
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..flow.gate import BATCH_DONE_HEADER, GATE_HEADER
from .base import _DONE, StoreBase, _decode
from .scripts import SCRIPTS, ScriptCall, run_pipelined


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

_PUSH_CLAIMED = (_NOT_HELD, _PUSHED)  # an error text stands for REFUSED

#: Ids sent to one ack call at most.
ACK_CHUNK = 5000

#: Jobs per push_claimed script call (each carries its whole broker message).
PUSH_CLAIMED_CHUNK = 1000


def due_and_let_go(value: Any) -> tuple[int, int | None]:
    """A claimed job's due field as ``hand_over`` (``lua/includes/claiming.lua``) returns it:
    its due ms (a number), or ``"<due ms>:<score>"`` for a job flow control held back, whose
    score when claimed is when flow control let it go (a job's due score; a promoted one's is
    that time less its priority, which the beat adds back from its gate header).

    >>> due_and_let_go(1000), due_and_let_go("1000:61000")
    ((1000, None), (1000, 61000))
    """
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str) and ":" in value:
        due, let_go = value.split(":", 1)
        return int(due), int(float(let_go))
    return int(value), None


@dataclass(frozen=True)
class ClaimedJob:
    id: str
    envelope: str
    due_ms: int
    tries: int
    #: the gate key of a capped job the claim gave a slot itself (``lua/includes/gating.lua``):
    #: publish it and hold it, without asking the gate; None for any other job
    gate_key: str | None = None
    #: a job flow control held back (parked, paused, deferred by its rate): when it let it go
    #: (ms, the server's clock: its due score then, plus its priority for a promoted one; see
    #: :func:`due_and_let_go`); None for any other job
    let_go_ms: int | None = None


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

#: How long (ms) a shard's ``wire`` hash lives after the last template added to it. A job's shape
#: names its producer (origin, reply-to), so each producer process adds its own shapes; the hash
#: of a shard that takes no new shape for a day is dropped and refilled on demand, and a full one
#: is dropped a day after it filled.
TEMPLATES_TTL_MS = 86_400_000


def _gated_reply(raw: Sequence[Any]) -> tuple[int, dict[str, str]]:
    """``(parked, {id: key})`` of the gating part of a claim or push reply: ``{parked, id, key,
    ...}`` (``gate_claimed`` in ``lua/includes/gating.lua``)."""
    return int(raw[0]), {str(raw[i]): str(raw[i + 1]) for i in range(1, len(raw) - 1, 2)}


class DeliveryPart(StoreBase):
    """The beat's side of delivery (a part of :class:`~celery_delayq.store.facade.Store`)."""

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
        out: list[ClaimedJob] = []
        for i in range(start, len(raw), 4):
            due, let_go = due_and_let_go(raw[i + 2])
            envelope = self._loaded(raw[i], raw[i + 1])
            out.append(ClaimedJob(raw[i], envelope, due, int(raw[i + 3]), released.get(raw[i]), let_go))
        return out

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
        removed: dict[str, bool] = {}
        for chunk, result in self._per_shard("ack", ids_by_shard, ACK_CHUNK, lambda _, ids: [token, *ids]):
            removed.update(zip(chunk, map(bool, result), strict=True))
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
        held: dict[str, bool] = {}
        now_ms: int | None = None
        for chunk, result in self._per_shard(
            "renew", ids_by_shard, ACK_CHUNK, lambda _, ids: [token, ttl_ms, *ids]
        ):
            now_ms = int(result[0]) if now_ms is None else min(now_ms, int(result[0]))
            held.update(zip(chunk, map(bool, result[1:]), strict=True))
        return held, now_ms

    def push_claimed(
        self, token: str, items_by_shard: dict[int, list[tuple[str, str, str]]]
    ) -> dict[str, PushClaimedReply]:
        """Push ``(id, list key, message)`` into broker lists and remove the jobs, each only
        while ``token`` holds its lease (``lua/push_claimed.lua``; the broker must be this server).

        Returns ``{id: PushClaimedReply}``: pushed and removed, not held (nothing done), or refused
        with the error text of the push.
        """

        def push_args(_: int, chunk: Sequence[tuple[str, str, str]]) -> list[Any]:
            return [token, *(value for item in chunk for value in item)]

        out: dict[str, PushClaimedReply] = {}
        for chunk, result in self._per_shard("push_claimed", items_by_shard, PUSH_CLAIMED_CHUNK, push_args):
            for (job_id, _, _), reply in zip(chunk, result, strict=True):
                if isinstance(reply, str):
                    out[job_id] = PushClaimedReply(PushClaimedOutcome.REFUSED, reply)
                else:
                    out[job_id] = _decode("push_claimed", _PUSH_CLAIMED, reply)
        return out

    def bury(self, token: str, job_id: str, record: dict[str, Any]) -> bool:
        """Move a job this ``token`` holds to the dead-letter hash with ``record``."""
        keys = self.keys.for_job(job_id).core
        return _decode("bury", _DONE, SCRIPTS["bury"](self.client, keys, [token, job_id, json.dumps(record)]))
