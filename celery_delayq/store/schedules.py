"""Recurring schedules as stored: put and delete (``lua/sched_put.lua``, ``lua/sched_del.lua``),
reads of definitions and run states, the registry of ``beat_schedule`` names, and firing a
point (``lua/fire.lua``, :class:`FireOutcome`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import StoreError
from .base import _DONE, StoreBase, _decode, refused_when_full
from .scripts import SCRIPTS, ScriptCall, run_pipelined


class FireOutcome(enum.StrEnum):
    """What acking a schedule's point did (``lua/fire.lua``)."""

    STALE = "stale"  # the point was no longer leased to this beat: nothing done
    FIRED = "fired"  # acked, and the schedule moved to its next point
    STOPPED = "stopped"  # acked, not advanced: the schedule was deleted, paused or replaced
    HISTORY_RESET = "history-reset"  # fired, but the run state did not read and was reset


@dataclass(frozen=True)
class OverlapAnswer:
    """What ``lua/overlap.lua`` said about a due point of a schedule with an overlap policy."""

    #: "run" (a slot is taken: publish it), "skip" (a run is in flight: fire it unpublished),
    #: "cancel" (a slot is taken: revoke ``running``, publish it), "wait" (it waits for the
    #: run in flight to end: due again at ``until_ms``), "not-held" (this beat no longer holds it)
    decision: str
    #: ids of the runs in flight (their slots), for "skip", "cancel" and "wait"
    running: tuple[str, ...] = ()
    #: the point had waited for a run to end (buffer_one), for "run" and "cancel"
    waited: bool = False
    until_ms: int | None = None


_FIRE = (FireOutcome.STALE, FireOutcome.FIRED, FireOutcome.STOPPED, FireOutcome.HISTORY_RESET)

_PUT = (False, True, False)  # sched_put: 0 refused (exists), 1 stored, 2 not stalled


class SchedulesPart(StoreBase):
    """Stored schedules (a part of :class:`~celery_delayq.store.facade.Store`)."""

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
        keys = self.keys.shard(self.keys.shard_of("{" + name + "}"))
        return self._write_outcome(
            "sched_del", _DONE, [*keys.core, keys.gate_overlap], [name], f"schedule {name!r} not deleted"
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

    def overlap(
        self, token: str, shard: int, job_id: str, key: str, policy: str, start_ttl_ms: int, poll_ms: int
    ) -> OverlapAnswer:
        """May due point ``job_id`` (held by ``token``) of a schedule with overlap ``policy`` run
        now (``lua/overlap.lua``, one round trip)? ``key``: the schedule's slot key. Redis
        errors (a full Redis among them: nothing written) are raised."""
        args = [token, job_id, key, policy, int(start_ttl_ms), int(poll_ms), self.keys.wake_channel, shard]
        reply = SCRIPTS["overlap"](self.client, self.keys.shard(shard).core, args)
        code = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        rest = [item.decode() if isinstance(item, bytes) else str(item) for item in reply[1:]]
        if code == "run":
            return OverlapAnswer("run", waited=rest[0] == "1")
        if code == "cancel":
            return OverlapAnswer("cancel", tuple(rest[1:]), waited=rest[0] == "1")
        if code == "skip":
            return OverlapAnswer("skip", tuple(rest))
        if code == "wait":
            return OverlapAnswer("wait", tuple(rest[1:]), until_ms=int(rest[0]))
        if code == "not-held":
            return OverlapAnswer("not-held")
        raise StoreError(f"delayq overlap: unexpected reply {code!r}")
