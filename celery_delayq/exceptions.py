"""Every error celery-delayq raises on purpose.

The tree::

    DelayQError                      base of everything below
    ├── ConfigurationError           a delayq_* setting is invalid or missing
    ├── ScheduleError                a scheduling or schedule-management call is invalid
    │   ├── InvalidDueTime           naive/NaN/inf/negative/out-of-range due time
    │   ├── InvalidOptions           an option that cannot be stored or routed
    │   │   └── InvalidTaskId        a task id that is not a string, too long, or not UTF-8
    │   ├── InvalidArguments         args that are not a list/tuple, kwargs not a mapping
    │   ├── PayloadTooLarge          the stored job would exceed delayq_max_payload
    │   ├── ReservedTaskId           a task id of the form of a schedule's point, {name}@<time>
    │   ├── SerializationError       args/kwargs the app's serializer cannot encode
    │   ├── InvalidSchedule          malformed cron, unknown timezone, bad rule, args or policy
    │   │   └── ScheduleNotFound     no schedule has that name (also LookupError)
    │   ├── UnknownTask              a schedule names a task the app does not have
    │   ├── ScheduleExists           Schedules.add() of a name that is taken
    │   ├── InvalidBatch             DelayQ.batch() with no members or a non-signature
    │   ├── BatchSealed              OpenBatch.add() of a batch that is sealed
    │   └── BatchExists              DelayQ.batch() with the batch_id of a stored batch
    ├── UnknownKey                   pause/resume/limit of a key never seen, or of a schedule's name
    └── StoreError                   the store cannot be used, or answered in a way it cannot use
        ├── StoreUnreachable         no connection, or a Cluster failing over (also redis.ConnectionError)
        │   └── StoreTimeout         no answer in time (also redis.TimeoutError)
        ├── StoreRefused             the server refused the login: a wrong password, user or database
        ├── UnsupportedServer        Redis older than 6.2 (scripts need it)
        ├── CorruptData              a stored entry that does not read (also ValueError)
        └── StoreFull                Redis is over maxmemory and refused a write

Every ScheduleError is raised at the moment of the call, before anything is
written to Redis: a job that fails validation is never stored, and jobs already
stored are never touched by a failing call. ``SerializationError`` and
``InvalidDueTime`` are also ``ValueError``/``TypeError`` subclasses as fits, so
code that catches the builtin error keeps working.

``StoreUnreachable`` and ``StoreRefused`` are raised by every public call that talks to the
store (``apply_at``, ``DelayQ``, ``Schedules``, the CLI) when it cannot: their message names the
store's URL (password redacted) and the setting, and redis-py's error is their ``__cause__``.
``StoreUnreachable`` is also a ``redis.ConnectionError`` (and ``StoreTimeout`` a
``redis.TimeoutError``), so code written to retry on those keeps working; ``StoreRefused`` is
not one: retrying does not fix a wrong password or database.

``StoreFull`` is raised after the call reached Redis, for every write of a producer or an
operator that Redis refuses for memory: its ``stored`` and ``not_stored`` list exactly which
jobs of the call were written (each script call is refused whole, before its first write, or
runs whole), and ``refused`` says what was not written.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "BatchExists",
    "BatchNotFound",
    "BatchSealed",
    "ConfigurationError",
    "CorruptData",
    "DelayQError",
    "InvalidArguments",
    "InvalidBatch",
    "InvalidDueTime",
    "InvalidInput",
    "InvalidOptions",
    "InvalidSchedule",
    "InvalidTaskId",
    "PayloadTooLarge",
    "ReservedTaskId",
    "ScheduleError",
    "ScheduleExists",
    "ScheduleNotFound",
    "SerializationError",
    "StoreError",
    "StoreFull",
    "StoreRefused",
    "StoreTimeout",
    "StoreUnreachable",
    "UnknownKey",
    "UnknownTask",
    "UnsupportedServer",
]


class DelayQError(Exception):
    """Base class of every error raised by celery-delayq."""


class ConfigurationError(DelayQError, ValueError):
    """A ``delayq_*`` setting has a value that cannot work."""


class ScheduleError(DelayQError):
    """A scheduling call was given something it cannot store."""


class InvalidDueTime(ScheduleError, ValueError):
    """The due time is naive (where that is refused), NaN, infinite, negative or out of range."""


class InvalidOptions(ScheduleError, TypeError):
    """An ``apply_async`` option cannot be stored with the job or routed."""


class InvalidTaskId(InvalidOptions, ValueError):
    """A ``task_id`` that cannot be stored: not a string, empty, too long, or not UTF-8 text."""


class InvalidArguments(ScheduleError, TypeError):
    """A job's ``args`` are not a list or tuple, its ``kwargs`` not a mapping, or an
    ``apply_at_many`` item is not an ``(eta, args, kwargs)`` triple."""


class SerializationError(ScheduleError, TypeError):
    """The task's serializer cannot encode the arguments."""


class StoreError(DelayQError):
    """The store cannot be used (:class:`StoreUnreachable`, :class:`StoreRefused`), or Redis
    returned something the store does not understand."""


class StoreUnreachable(StoreError, RedisConnectionError):
    """The store's Redis (or every node of its Cluster) cannot be reached or did not answer in
    time: refused, timed out, or a Cluster failing over (``ClusterDownError``,
    ``RedisClusterUnreachableError``, ``SlotNotCoveredError``, ...). Its message names the URL
    (password redacted) and the setting; redis-py's error is its ``__cause__``. Also a
    ``redis.ConnectionError``: code that retries on that keeps working. Retry the call (with your
    own ``task_id``, a retry cannot store a job twice)."""


class StoreTimeout(StoreUnreachable, RedisTimeoutError):
    """The store's Redis did not answer in time (a connection or a reply past its timeout: a
    paused, overloaded or far server). Also a ``redis.TimeoutError``, as redis-py's was. The
    call may have run on the server: retry it with the same ``task_id``."""


class StoreRefused(StoreError):
    """The store's Redis answered but refused the connection's login: a wrong or missing
    password or user (``WRONGPASS``, ``NOAUTH``), or a database it does not have (``/99`` on a
    server with 16: ``ERR DB index is out of range``). Fix ``delayq_url``: retrying does not help,
    so it is not a ``redis.ConnectionError``. redis-py's error is its ``__cause__``."""


class UnsupportedServer(StoreError):
    """The Redis server is too old for the scripts (6.2 or newer is needed)."""


class CorruptData(StoreError, ValueError):
    """A stored entry (an envelope, a lease, a schedule definition or run state, a heartbeat)
    that does not read: not JSON, the wrong type, nested too deeply or too large. The beat
    dead-letters such a job, or stops such a schedule, with this as the reason."""


class StoreFull(StoreError):
    """Redis is over its ``maxmemory`` and refused a write (``OOM command not allowed``).

    Every write of a producer or an operator that Redis refuses for memory raises it: jobs
    (``apply_at``, ``apply_at_many``, batches), schedules, run-time limits and pauses, moves
    and requeues. ``refused`` says what was not written. ``stored`` lists the task ids of the
    call that were stored (a bulk call is sent as one script call per shard and chunk; each is
    refused whole or runs whole), ``not_stored`` those that were not, both in the order of the
    call; both are empty for a write that stores no job (a schedule, a limit). Nothing stored
    before is lost: the beat goes on delivering (which frees memory), so retrying later works.
    """

    def __init__(
        self,
        stored: list[str],
        not_stored: list[str],
        not_stored_positions: list[int] | None = None,
        refused: str = "",
    ) -> None:
        self.stored = stored
        self.not_stored = not_stored
        #: Where each ``not_stored`` job was in the call's items (``apply_at_many``), to retry them.
        self.not_stored_positions = not_stored_positions if not_stored_positions is not None else []
        #: What Redis refused to write, in words.
        self.refused = refused or f"{len(not_stored)} job(s) not stored, {len(stored)} stored"
        retry = "Retry the ones in .not_stored" if not_stored else "Retry"
        super().__init__(
            f"Redis is full (used memory over its maxmemory, policy noeviction): {self.refused}; "
            f"nothing stored was lost. "
            f"{retry} once the beats have drained due jobs, or raise maxmemory "
            f"(CONFIG SET maxmemory) or free memory; see docs/errors.md"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stored, self.not_stored, self.not_stored_positions, self.refused))


class PayloadTooLarge(ScheduleError, ValueError):
    """The stored job would exceed ``delayq_max_payload`` bytes."""


class ReservedTaskId(ScheduleError, ValueError):
    """The task id has the form of a recurring schedule's execution point, ``{<name>}@<time>``:
    such ids belong to the schedules (a job stored under one would stop its schedule)."""


class InvalidSchedule(ScheduleError, ValueError):
    """A recurring schedule's rule, timezone, name or missed-run policy is invalid."""


class UnknownTask(ScheduleError, KeyError):
    """A schedule names a task that is not registered in the app (``task``: its name, when known)."""

    def __init__(self, message: str, task: str | None = None) -> None:
        super().__init__(message)
        self.task = task

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.task))


class ScheduleExists(ScheduleError, KeyError):
    """``Schedules.add`` was given a name that already exists (use ``upsert``); ``name`` is it."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.name))


class ScheduleNotFound(InvalidSchedule, LookupError):
    """No schedule has that name."""


class InvalidBatch(ScheduleError, ValueError):
    """``DelayQ.batch`` was given no members, a member that is not a signature, or an
    ``on_complete`` that is not a signature (or cannot be sent as JSON)."""


class InvalidInput(DelayQError, ValueError):
    """An operator's input that does not read: a duration (``30s``), a time (``+10m``), a
    listing's cursor, a lateness kind or window, a release outcome. The message says what reads."""


class BatchNotFound(DelayQError, LookupError):
    """``BatchResult.state()`` of a batch that is not stored (never made, deleted, or expired)."""


class BatchSealed(ScheduleError):
    """``OpenBatch.add`` of a batch that is sealed (``seal()`` was called, or it was made by
    ``DelayQ.batch``): no member is added after the seal."""


class BatchExists(ScheduleError, KeyError):
    """``DelayQ.batch`` was given the ``batch_id`` of a batch that is stored already."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownKey(DelayQError, LookupError):
    """``DelayQ.pause``, ``resume``, ``set_limit`` or ``clear_limit`` of a gate key that has never
    been seen (no entry in ``gate:keys`` and no job of the key stored: a misspelling, most
    often), or of a name that is a schedule's and no key's (``Schedules.pause`` pauses a
    schedule). ``new=True`` changes such a key anyway. ``key``: the name; ``action``: ``pause``,
    ``resume`` or ``limit``; ``schedule``: the name is a schedule's."""

    def __init__(self, message: str, key: str = "", action: str = "pause", schedule: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.action = action
        self.schedule = schedule

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.key, self.action, self.schedule))
