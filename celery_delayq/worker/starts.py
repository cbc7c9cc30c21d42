"""The fence where the work happens: a worker drops a stale copy of a job before it runs.

The beat's fence (:mod:`..beat.fence`) stops a beat that lost its lease *before* it publishes; what
a beat paused *inside* its publish had already sent when it resumes cannot be called back. So
every message a beat publishes from a lease through kombu (kombu's batch on Redis, RabbitMQ,
compressed or exchange-routed messages, schedule points; not released gated jobs, which
flow control delivers again on purpose after a worker died mid-task) carries its
claim in the :data:`CLAIM_HEADER` header (:func:`claim_header`): the job's id, its stored due
time and the creation time of its envelope (which stored instance of the id it is), and the
claim itself, ``"<tries>|<beat token>"`` (a lease entry's, unique per claim). Messages pushed by
``lua/push_claimed.lua`` or ``lua/push.lua`` (publish and removal in one script) carry none: they
cannot have a stale copy.

A worker whose app has ``delayq_start_check`` on (the default) runs :class:`StartCheck`, a
consumer bootstep added by the app's delayq worker step (:class:`.lateness.DelayQWorker`, so it
is the app the worker runs that decides). It wraps the task strategies of the consumer: before a message
with the header becomes a task request, one ``lua/start.lua`` call (:meth:`.Store.start`)
asks whether another claim of the same job instance started already (first start wins, its
record kept ``delayq_start_ttl``). The same claim starts again (a Celery ``retry`` and an
``acks_late`` redelivery carry the headers of the message they repeat). A stale copy is acked
and dropped before it becomes a request: not run, not retried, no task signal sent, one
warning logged, and counted in the shard's ``starts:dropped`` key (the beat's
``delayq_stale_starts_dropped_total`` metric). This is in the consumer, the worker's main
process, so it is the same for every pool and every task (a ``DelayedTask`` or not).

When the store cannot be asked (unreachable, full, a script error), the message is run: at
least once is the base promise; a warning is logged once per failing streak. The check has a
client of its own whose connect and reply wait at most :data:`CHECK_TIMEOUT` seconds (a
``socket_timeout`` in ``delayq_url`` wins), and after a failure the consumer runs such
messages unchecked for :data:`RETRY_AFTER` seconds before it asks again: a store that hangs
(a paused or overloaded Redis) costs the consumer one wait per :data:`RETRY_AFTER`, not one per
message, and never stops the plain tasks it receives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from ..config import DelayQConfig
from ..store.envelope import CLAIM_HEADER
from ..store.facade import ClaimedJob, Store, error_text

__all__ = [
    "CHECK_TIMEOUT",
    "CLAIM_HEADER",
    "RETRY_AFTER",
    "Claim",
    "StartCheck",
    "claim_header",
    "install",
    "read_claim",
]

#: Seconds the start check waits for the store (to connect, and for its reply).
CHECK_TIMEOUT = 2.0

#: Seconds a consumer runs claimed messages unchecked after the store could not be asked.
RETRY_AFTER = 10.0

logger = logging.getLogger(__name__)


class Claim:
    """A delivery's claim as read from its header."""

    __slots__ = ("claim", "created_ms", "due_ms", "job_id")

    def __init__(self, job_id: str, due_ms: int, created_ms: int, claim: str) -> None:
        self.job_id = job_id
        self.due_ms = due_ms
        self.created_ms = created_ms
        self.claim = claim


def claim_header(job: ClaimedJob, created_ms: int, token: str) -> str:
    """The :data:`CLAIM_HEADER` value of a message published for ``job`` under the lease
    ``token`` holds: ``"<tries>|<token>|<due ms>|<created ms>|<job id>"`` (a token has no
    ``|``; the id, last, may).

    >>> claim_header(ClaimedJob("a|b", "", 1000, 2), 7, "host:1:ab")
    '2|host:1:ab|1000|7|a|b'
    """
    return f"{job.tries}|{token}|{job.due_ms}|{created_ms}|{job.id}"


def read_claim(value: Any) -> Claim | None:
    """The claim of a header value (:func:`claim_header`), or None when it does not read.

    >>> c = read_claim('2|host:1:ab|1000|7|a|b')
    >>> c.job_id, c.due_ms, c.created_ms, c.claim
    ('a|b', 1000, 7, '2|host:1:ab')
    >>> read_claim("x"), read_claim(None), read_claim("1|t|due|7|a")
    (None, None, None)
    """
    if not isinstance(value, str):
        return None
    parts = value.split("|", 4)
    if len(parts) != 5 or not parts[1] or not parts[4]:
        return None
    tries, token, due, created, job_id = parts
    try:
        return Claim(job_id, int(due), int(created), f"{int(tries)}|{token}")
    except ValueError:
        return None


class StartCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: wrap each task strategy so that a message carrying a stale claim is
    dropped before it becomes a task request (see the module docstring)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.failing = False
        self.clock: Callable[[], float] = time.monotonic  # (Celery passes the worker's options)
        self.ask_after = 0.0  # monotonic time before which the store is not asked (failing)
        self.store: Store | None = None

    def start(self, c: Any) -> None:
        """Wrap the strategies ``Tasks`` just made (again after a connection restart)."""
        config = DelayQConfig.from_app(c.app)
        if self.store is None:
            self.store = Store(config, connect_timeout=CHECK_TIMEOUT, socket_timeout=CHECK_TIMEOUT)
        ttl_ms = max(1, int(config.start_ttl * 1000))
        for name, strategy in list(c.strategies.items()):
            if not getattr(strategy, "delayq_checked", False):
                c.strategies[name] = self.wrap(c.app, strategy, ttl_ms)

    def wrap(self, app: Any, strategy: Any, ttl_ms: int) -> Any:
        def checked(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any) -> Any:
            headers = getattr(message, "headers", None)
            if not isinstance(headers, dict):
                headers = {}  # (a protocol 1 message: never published with a claim)
            value = headers.get(CLAIM_HEADER)
            if value is not None and not self.may_start(app, headers, value, ttl_ms):
                message.ack()
                return None
            return strategy(message, body, ack, reject, callbacks, **kwargs)

        checked.delayq_checked = True  # type: ignore[attr-defined]
        return checked

    def may_start(self, app: Any, headers: dict[str, Any], value: Any, ttl_ms: int) -> bool:
        """Whether the message may run: False only when the store says another claim of its
        job started first. Never raises."""
        claim = read_claim(value)
        if claim is None:
            logger.warning(
                "delayq: task %s carries a %s header that does not read (%.100r); it is run unchecked",
                headers.get("id"),
                CLAIM_HEADER,
                value,
            )
            return True
        if self.failing and self.clock() < self.ask_after:
            return True  # the store failed a moment ago: run it unchecked (see RETRY_AFTER)
        try:
            assert self.store is not None, "StartCheck.start makes the store"
            first = self.store.start(claim.job_id, claim.due_ms, claim.created_ms, claim.claim, ttl_ms)
        except Exception as exc:  # Redis unreachable, full, a script error: run it (at least once)
            if not self.failing:
                logger.warning(
                    "delayq: cannot check in Redis whether another delivery of a job started (%s); "
                    "such tasks run unchecked (at least once) until it answers (asked again "
                    "every %.0f s)",
                    error_text(exc),
                    RETRY_AFTER,
                )
            self.failing = True
            self.ask_after = self.clock() + RETRY_AFTER
            return True
        if self.failing:
            logger.warning("delayq: checking task starts in Redis works again")
            self.failing = False
        if not first:
            logger.warning(
                "delayq: dropped a stale copy of job %s (task %s, id %s): another delivery of it "
                "started first (a beat published this one after losing its lease)",
                claim.job_id,
                headers.get("task"),
                headers.get("id"),
            )
        return first


def install(app: Any) -> None:
    """Check task starts in the workers ``app`` runs (whatever ``delayq_start_check`` says):
    adds :class:`StartCheck` to the app's consumer steps. Call before the worker is built (the
    app's delayq worker step does it when the setting is on)."""
    app.steps["consumer"].add(StartCheck)
