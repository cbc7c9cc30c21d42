"""Flow control's keys and slots: the gate (``lua/gate.lua``), hold, start, slot renewal and
release, the run-time key admin (limit, pause) and key reads; what they answer
(:class:`GateDecision`, :class:`GateResult`, :class:`ReleaseResult`, :class:`KeyState`). The
gate options' forms are :mod:`celery_delayq.flow.gate`'s; batches are :mod:`.batches`.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidInput, StoreError
from ..flow.gate import Gate
from .base import StoreBase, _int_or
from .connection import is_oom
from .keys import start_record
from .lua_formats import parse_key_entry
from .reads import glob_escape
from .scripts import SCRIPTS, ScriptCall, run_pipelined

logger = logging.getLogger(__name__)


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


_GATE_DECISIONS = {d.value: d for d in GateDecision}

#: Jobs per gate/hold/slot_renew call (each call's ARGV holds a few short strings a job).
GATE_CHUNK = 1000

#: The outcomes :meth:`Store.release` takes.
RELEASE_OUTCOMES = ("succeeded", "failed", "retry")

#: What each ``lua/gate_admin.lua`` operation changes, for :class:`StoreFull`'s message.
_GATE_ADMIN_WORDS = {"unlimit": "limit", "clear": "limit", "resume": "pause"}


class FlowPart(StoreBase):
    """Flow control's keys and slots (a part of :class:`~celery_delayq.store.facade.Store`)."""

    def gate(
        self, token: str, jobs_by_shard: dict[int, list[tuple[str, Gate]]], slot_ttl_ms: int
    ) -> dict[str, GateResult]:
        """Ask the gate (``lua/gate.lua``) about claimed gated jobs ``token`` holds, ``(id,
        gate)`` by shard, in one pipeline; ``{id: GateResult}``.

        A call Redis refuses because it is over ``maxmemory`` wrote nothing: its jobs are
        answered ``NOT_HELD`` (skip them: they keep this beat's lease and are claimed and
        gated again once it expires), and a warning is logged. Any other error is raised.
        """
        channel = self.keys.wake_channel

        def gate_args(shard: int, chunk: Sequence[tuple[str, Gate]]) -> list[Any]:
            args: list[Any] = [token, int(slot_ttl_ms), channel, shard]
            for job_id, gate in chunk:
                args.append(job_id)
                args.extend(gate.script_args())
            return args

        out: dict[str, GateResult] = {}
        for chunk, result in self._per_shard(
            "gate", jobs_by_shard, GATE_CHUNK, gate_args, raise_errors=False
        ):
            chunk_ids = [job_id for job_id, _ in chunk]
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

        def pair_args(_: int, chunk: Sequence[tuple[str, str]]) -> list[Any]:
            return [*head, *(value for pair in chunk for value in pair)]

        out: dict[str, bool] = {}
        for chunk, result in self._per_shard(script, pairs_by_shard, GATE_CHUNK, pair_args):
            out.update((job_id, bool(r)) for (job_id, _), r in zip(chunk, result, strict=True))
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
        of another claim (counted in the shard's dropped count). The record is a field of the
        shard's hash for the time bucket (:func:`.keys.start_record`, about 20 bytes); a record
        of the one-key-a-job form of earlier versions (:meth:`.ShardKeys.started`) is still
        recognised."""
        shard = self.keys.for_job(job_id)
        keys = [shard.started(job_id, due_ms, created_ms), shard.dropped]
        part, field, mark = start_record(job_id, due_ms, created_ms, claim)
        return bool(SCRIPTS["start"](self.client, keys, [claim, int(ttl_ms), part, field, mark]))

    def renew_slots(self, jobs: Sequence[tuple[str, str]], slot_ttl_ms: int) -> dict[str, bool]:
        """Extend to now + ``slot_ttl_ms`` the slots of running gated jobs ``(id, key)``
        (``lua/slot_renew.lua``, one pipeline); ``{id: still has its slot}``."""
        return self._pairs_by_call("slot_renew", [int(slot_ttl_ms)], self._by_key_shard(jobs))

    def _by_key_shard(self, pairs: Sequence[tuple[str, str]]) -> dict[int, list[tuple[str, str]]]:
        """``(id, gate key)`` pairs grouped by the shard of their key (where a gated job's slot is)."""
        by_shard: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for job_id, key in pairs:
            by_shard[self.keys.shard_of(key)].append((job_id, key))
        return by_shard

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
        calls, chunks = self._shard_calls(
            "slot_renew",
            self._by_key_shard(takes),
            GATE_CHUNK,
            lambda _, pairs: [int(slot_ttl_ms), *itertools.chain(*pairs)],
        )
        takes_calls = len(calls)
        for job_id, key, outcome, batch_id in releases:
            shard = self.keys.shard_of(key)
            args = self._release_args(job_id, key, outcome, batch_id, shard)
            calls.append(ScriptCall(SCRIPTS["release"], self.keys.shard(shard).core, args))
        raws = run_pipelined(self.client, calls, raise_errors=False)
        taken: dict[str, bool] = {}
        for chunk, raw in zip(chunks, raws[:takes_calls], strict=True):
            if isinstance(raw, Exception):
                raise raw
            taken.update((job_id, bool(r)) for (job_id, _), r in zip(chunk, raw, strict=True))
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
        _, raw, _ = parse_key_entry(self.client.hget(self.keys.for_key(key).gate_keys, key))
        if raw is None:
            return False, None
        return True, (None if raw == "none" else _int_or(raw))

    def key_seen(self, key: str, page: int = 1000) -> bool:
        """Whether gate key ``key`` has been seen: it has an entry in its shard's ``gate:keys``
        (a job of the key was gated, or an operator set its limit or paused it), or a job of
        the key is stored (an id beginning with its tag ``{<key>}``, found by ``HSCAN`` of its
        shard's jobs, ``page`` entries a round trip; only when there is no entry). A schedule's
        jobs (its points, run-now and retries: ``{<name>}@...``) are not jobs of a key."""
        names = self.keys.for_key(key)
        if self.client.hexists(names.gate_keys, key):
            return True
        tag = "{" + key + "}"
        pattern = glob_escape(tag) + "*"
        cursor = 0
        while True:
            cursor, found = self.client.hscan(names.jobs, cursor, match=pattern, count=page)
            if any(not job_id.startswith(tag + "@") for job_id in found):
                return True
            if int(cursor) == 0:
                return False

    def key_state(self, key: str) -> KeyState:
        """``key``'s limit in force, override, running and parked counts, and paused flag."""
        return self._key_states(self.keys.shard_of(key), [key])[0]

    def _key_states(self, shard: int, keys: Sequence[str]) -> list[KeyState]:
        names = self.keys.shard(shard)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(names.gate_keys, key)
                pipe.zcard(names.running(key))
                pipe.zcard(names.waiting(key))
            replies = iter(pipe.execute())
        out: list[KeyState] = []
        for key in keys:
            entry, running, waiting = (next(replies) for _ in range(3))
            own, override, paused = parse_key_entry(entry)
            # As includes/gate.lua's limit_from: an override that does not read is ignored.
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
