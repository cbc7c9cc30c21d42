"""Flow control at release time: what a gated job carries, and the names every part agrees on.

A job given ``concurrency_key``/``concurrency_limit`` or ``rate_limit_key``/``rate_limit``
(or a member of a batch) is *gated*: when it falls due, the beat asks the gate
(``lua/gate.lua``) before publishing it. The gate may release it (a slot of its key is
taken), park it (its key is full or paused: it waits in Redis, not in the broker) or defer it
(its key's rate is spent: it is due again when the rate allows). A released capped job stays
stored in a *running* state until the worker says its task finished (``lua/release.lua``).

Everything of one key lives on the key's shard: a gated job's id carries the key's hash tag
(``{<key>}...``, see :func:`gated_id`), so one script sees the job, its key's slots and its
waiting jobs at once, also on a Redis Cluster.

The gate options travel in one message header, :data:`GATE_HEADER`, which the beat reads
before publishing and the worker reads when the task ends:

>>> gate = Gate("tenant:42", limit=3, rate=parse_rate("100/s"), priority=5)
>>> gate.header()
{'key': 'tenant:42', 'limit': 3, 'rate': [100, 1000], 'priority': 5}
>>> Gate.from_header(gate.header()) == gate
True
>>> gated_id("tenant:42", None).startswith("{tenant:42}")
True
>>> member_id("b1", 7), completion_id("b1"), batch_of("{batch:b1}:7")
('{batch:b1}:7', '{batch:b1}:complete', 'b1')
"""

from __future__ import annotations

import re
import reprlib
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidOptions

__all__ = [
    "BATCH_DONE_HEADER",
    "BATCH_PREFIX",
    "GATE_HEADER",
    "GATE_OPTIONS",
    "GATE_TOKEN",
    "MAX_KEY_LENGTH",
    "PARK_MS",
    "PRIORITY_MAX",
    "RUN_TOKEN",
    "Gate",
    "Rate",
    "batch_key",
    "batch_of",
    "check_key",
    "check_limit",
    "check_priority",
    "completion_id",
    "gated_id",
    "key_tag",
    "member_id",
    "parse_rate",
    "pop_gate",
]

#: Message header holding a gated job's :meth:`Gate.header`.
GATE_HEADER = "delayq_gate"
#: Header of a batch's completion job: the batch id. The beat appends ``(batch id, counts)``
#: to its arguments when it publishes it.
BATCH_DONE_HEADER = "delayq_batch_done"
#: The ``apply_at``/``apply_in``/``apply_at_many``/``apply_async`` options that make a job gated.
GATE_OPTIONS = ("concurrency_key", "concurrency_limit", "rate_limit_key", "rate_limit")
#: Longest key, in characters.
MAX_KEY_LENGTH = 200
#: Lease token of a job the gate holds back (parked, or deferred by its rate): no beat has it.
GATE_TOKEN = "gate"
#: Lease token of a released capped job whose task runs: its worker renews it.
RUN_TOKEN = "run"
#: Due score of a parked job (waiting for a slot or a resume): never claimed by time.
PARK_MS = 9_000_000_000_000_000
#: Highest priority (AMQP's range, 0-255); a higher number is released first.
PRIORITY_MAX = 255
#: Key of a batch's members: ``batch:<batch id>``.
BATCH_PREFIX = "batch:"

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PERIOD_MS = {
    "s": 1000,
    "sec": 1000,
    "second": 1000,
    "m": 60_000,
    "min": 60_000,
    "minute": 60_000,
    "h": 3_600_000,
    "hour": 3_600_000,
}


@dataclass(frozen=True)
class Rate:
    """At most ``count`` releases per ``period_ms``, spaced evenly (``period_ms / count`` apart)."""

    count: int
    period_ms: int

    @property
    def interval_ms(self) -> float:
        return self.period_ms / self.count

    def __str__(self) -> str:
        unit = {1000: "s", 60_000: "m", 3_600_000: "h"}.get(self.period_ms)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.period_ms}ms"


#: The largest limit or rate count: the scripts read numbers exactly up to 2**53 (``int_arg``);
#: one above that would be stored and then refused by the gate at every claim.
MAX_WHOLE = 2**53 - 1


def parse_rate(value: Any) -> Rate:
    """A rate as Celery writes ``rate_limit``: ``"100/s"``, ``"10/m"``, ``"5/h"``, or a whole
    number per second.

    >>> parse_rate("100/s"), parse_rate(20), str(parse_rate("10/m"))
    (Rate(count=100, period_ms=1000), Rate(count=20, period_ms=1000), '10/m')
    >>> parse_rate("fast")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidOptions: rate_limit='fast': give "<n>/s", "<n>/m" or "<n>/h" ...
    """
    if isinstance(value, bool):
        count, period = 0, 1000
    elif isinstance(value, int):
        count, period = value, 1000
    elif isinstance(value, str) and (m := _RATE.match(value)):
        count, period = int(m.group(1)), _PERIOD_MS[m.group(2)]
    else:
        count, period = 0, 1000
    if not 1 <= count <= MAX_WHOLE:
        raise InvalidOptions(
            f'rate_limit={reprlib.repr(value)}: give "<n>/s", "<n>/m" or "<n>/h" with a whole n '
            f"from 1 to {MAX_WHOLE}, or a whole number per second"
        )
    return Rate(count, period)


def check_key(key: Any, what: str = "concurrency_key") -> str:
    """``key`` when it can name a gate key: a non-empty string of at most MAX_KEY_LENGTH
    characters without ``{``, ``}`` or ``|``."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or any(c in key for c in "{}|"):
        raise InvalidOptions(
            f"{what}={key!r}: a key is a non-empty string of at most {MAX_KEY_LENGTH} characters "
            "without '{', '}' or '|'"
        )
    return key


def check_limit(limit: Any, what: str = "concurrency_limit") -> int:
    """``limit`` when it is a whole number from 1 to :data:`MAX_WHOLE` (not a bool, not a float)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidOptions(f"{what}={reprlib.repr(limit)}: a concurrency limit is a whole number >= 1")
    if limit > MAX_WHOLE:
        raise InvalidOptions(f"{what}={reprlib.repr(limit)}: a concurrency limit is at most {MAX_WHOLE}")
    return limit


def check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= PRIORITY_MAX:
        raise InvalidOptions(f"priority={priority!r}: a priority is a whole number from 0 to {PRIORITY_MAX}")
    return priority


def key_tag(key: str) -> str:
    """The hash tag that puts a job on ``key``'s shard: ``{<key>}``."""
    return "{" + key + "}"


def gated_id(key: str, job_id: Any) -> str:
    """The id a job of ``key`` is stored under: a new ``{<key>}<uuid>`` when ``job_id`` is None;
    a given id must begin with the key's tag (so it is stored on the key's shard)."""
    tag = key_tag(key)
    if job_id is None:
        return tag + str(uuid.uuid4())
    if not isinstance(job_id, str) or not job_id.startswith(tag):
        raise InvalidOptions(
            f"task_id={job_id!r}: a job with concurrency_key/rate_limit_key {key!r} is stored with its "
            f"key, so its id must begin with {tag!r} (for instance {tag + str(job_id)!r}); or leave "
            "task_id out and one is made"
        )
    return job_id


def batch_key(batch_id: str) -> str:
    return BATCH_PREFIX + batch_id


def member_id(batch_id: str, index: int) -> str:
    """The id of a batch's member number ``index`` (from 0)."""
    return key_tag(batch_key(batch_id)) + f":{index}"


def completion_id(batch_id: str) -> str:
    """The id of a batch's completion job (its ``on_complete``)."""
    return key_tag(batch_key(batch_id)) + ":complete"


def batch_of(job_id: Any) -> str | None:
    """The batch id of a member's (or completion job's) id, else None."""
    opening = "{" + BATCH_PREFIX
    if not isinstance(job_id, str) or not job_id.startswith(opening):
        return None
    end = job_id.find("}")
    return job_id[len(opening) : end] if end > len(opening) else None


@dataclass(frozen=True)
class Gate:
    """What the gate needs of one job: its key, its own limit, the key's rate, its priority
    and (for a batch member) its batch id."""

    key: str
    limit: int | None = None
    rate: Rate | None = None
    priority: int = 0
    batch: str | None = None

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key}
        if self.limit is not None:
            out["limit"] = self.limit
        if self.rate is not None:
            out["rate"] = [self.rate.count, self.rate.period_ms]
        if self.priority:
            out["priority"] = self.priority
        if self.batch is not None:
            out["batch"] = self.batch
        return out

    @classmethod
    def from_header(cls, value: Any) -> Gate | None:
        """The gate of a message's :data:`GATE_HEADER` value; None when it does not read (the
        job is then released ungated, and the caller counts it as corrupt)."""
        if not isinstance(value, dict):
            return None
        try:
            key = check_key(value.get("key"))
            limit = value.get("limit")
            rate = value.get("rate")
            return cls(
                key,
                None if limit is None else check_limit(limit),
                None if rate is None else Rate(int(rate[0]), int(rate[1])),
                check_priority(value.get("priority", 0)),
                value.get("batch") if isinstance(value.get("batch"), str) else None,
            )
        except (InvalidOptions, TypeError, ValueError, IndexError):
            return None

    def script_args(self) -> list[Any]:
        """The five ARGV entries the gate scripts take per job, after its id: key, limit ("" for
        none), rate count and period ms ("" for none), priority."""
        return [
            self.key,
            "" if self.limit is None else self.limit,
            "" if self.rate is None else self.rate.count,
            "" if self.rate is None else self.rate.period_ms,
            self.priority,
        ]


def pop_gate(options: MutableMapping[str, Any], *, has_limit: bool | None = None) -> Gate | None:
    """Take the gate options out of ``options`` (they are not Celery's) and check them; None
    when the job is not gated. ``priority`` is left in ``options`` (it is the message's too)
    and read from there.

    ``rate_limit_key`` defaults to ``concurrency_key``; a job has one gate key, so both given
    must be equal. ``has_limit``: whether the key has a limit set at run time (checked by the
    caller in Redis); a ``concurrency_key`` with no ``concurrency_limit`` needs one.

    >>> pop_gate({"concurrency_key": "t", "concurrency_limit": 0})
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidOptions: concurrency_limit=0: a concurrency limit is a whole number >= 1
    """
    ckey = options.pop("concurrency_key", None)
    limit = options.pop("concurrency_limit", None)
    rkey = options.pop("rate_limit_key", None)
    rate = options.pop("rate_limit", None)
    if ckey is None and limit is None and rkey is None and rate is None:
        return None
    if ckey is not None:
        check_key(ckey)
    if rkey is not None:
        check_key(rkey, "rate_limit_key")
    if limit is not None:
        check_limit(limit)
        if ckey is None:
            raise InvalidOptions(f"concurrency_limit={limit!r} needs a concurrency_key to count against")
    if ckey is not None and rkey is not None and rkey != ckey:
        raise InvalidOptions(
            f"rate_limit_key={rkey!r} differs from concurrency_key={ckey!r}: a job has one gate key "
            "(leave rate_limit_key out to rate-limit its concurrency key)"
        )
    key = ckey if ckey is not None else rkey
    parsed = None if rate is None else parse_rate(rate)
    if rkey is not None and parsed is None:
        raise InvalidOptions(f'rate_limit_key={rkey!r} needs a rate_limit (for instance "100/s")')
    if key is None:
        raise InvalidOptions(f"rate_limit={rate!r} needs a rate_limit_key (or a concurrency_key)")
    if ckey is not None and limit is None and has_limit is False:
        raise InvalidOptions(
            f"concurrency_key={ckey!r} has no concurrency_limit and no limit is set for the key; "
            "give concurrency_limit=<n>, or set one with DelayQ(app).set_limit(key, n, new=True)"
        )
    priority = options.get("priority")
    prio = 0 if priority is None else check_priority(priority)
    return Gate(key, limit, parsed, prio)
