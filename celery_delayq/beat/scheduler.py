"""The beat scheduler: ``celery -A proj beat -S celery_delayq.Scheduler`` (or ``-S delayq``).

A thin :class:`celery.beat.Scheduler` subclass. At start it stores the
``beat_schedule`` entries as recurring schedules in Redis (see
:func:`celery_delayq.beat.upkeep.sync_config`), so any number of beats fire each
point once. Each tick runs the parent's tick (for entries that cannot be
stored, kept in memory), then one dispatcher pass (claim, publish,
ack), then sleeps on the wake subscription until the next due job, the next
``beat_schedule`` entry or ``delayq_max_sleep``, whichever comes first. Any
number of beats may run at once. A ``beat_schedule`` entry may give its schedule
as a cron string (``"30 2 * * *"``), which Celery's own entries cannot hold: it goes
to Redis only.

A ``delayq_*`` name that is not a setting (a misspelling) is logged as the beat starts, with
the closest setting (``delayq_strict_settings``: it stops the beat as below); with
``delayq_intercept_eta`` on, one line says how many tasks it covers. A bad ``delayq_*``
setting, or a malformed cron string, DST choice or overlap policy in ``beat_schedule``,
stops the beat as it starts with one line, ``Error: delayq: ...``
(:class:`BeatConfigurationError`), naming the setting as the configuration spells it
(``CELERY_DELAYQ_URL`` under Django's ``CELERY`` namespace).

When Redis is unreachable the tick logs one line and backs off (0.5 s,
doubling to 10 s) instead of crashing the beat; claimed jobs it could not ack
are delivered again after their lease. The line says which kind of Redis error it was
(unreachable, out of memory, a script or command error, NOSCRIPT; see
:func:`..store.facade.redis_error_kind`), and ``delayq_redis_errors_total{kind=...}`` counts them.

With ``delayq_metrics_port`` set, the beat serves Prometheus metrics on
``http://<delayq_metrics_addr>:<port>/metrics`` (see :mod:`.metrics`); a port that cannot
be bound is logged as an error and the beat delivers without it. On a clean shutdown the
beat removes its heartbeat from ``<prefix>:beats``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click
from celery import beat
from kombu.exceptions import OperationalError

from ..config import DelayQConfig, check_settings, intercept_line, setting_name
from ..exceptions import ConfigurationError, InvalidSchedule, ScheduleError, StoreFull
from ..schedules.api import Schedules
from ..schedules.rules import CronRule, Rule, check_dst, parse_rule
from ..schedules.spec import check_overlap
from ..store.connection import REDIS_ERRORS, error_text, redis_error_kind
from ..store.facade import get_store
from .backoff import Backoff
from .dispatch import Dispatcher
from .upkeep import sync_config

if TYPE_CHECKING:
    from .metrics import MetricsServer

__all__ = ["BeatConfigurationError", "Scheduler", "serve_metrics"]

logger = logging.getLogger(__name__)

_BACKOFF_START = 0.5
_BACKOFF_MAX = 10.0

#: What storing ``beat_schedule`` may meet and retry later: Redis unreachable, or full.
_SYNC_ERRORS: tuple[type[Exception], ...] = (*REDIS_ERRORS, StoreFull)

#: The log line of a tick that failed with a Redis error, by :func:`redis_error_kind`
#: (each also counted in ``delayq_redis_errors_total{kind=...}``; see docs/errors.md).
_REDIS_ERROR_LINES = {
    "unreachable": "delayq: Redis unavailable (%s); retrying in %.1f s",
    "oom": "delayq: Redis is out of memory (maxmemory reached) and refused a write (%s); retrying in %.1f s",
    "noscript": "delayq: Redis answered NOSCRIPT even after the script was loaded again (%s): "
    "something keeps flushing its script cache; retrying in %.1f s",
    "script": "delayq: a Redis script or command failed (%s): Redis is reachable, this is a bug "
    "or data it cannot read; retrying in %.1f s",
    "other": "delayq: Redis error (%s); retrying in %.1f s",
}


class BeatConfigurationError(ConfigurationError, click.ClickException):
    """A bad ``delayq_*`` setting found as the beat starts.

    Also a :class:`click.ClickException`, so ``celery beat`` (a click program) ends with
    one line, ``Error: delayq: <the problem>``, and exit code 1, instead of a traceback.
    """

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


#: The keys of a ``beat_schedule`` entry that only delayq reads (Celery's ``ScheduleEntry``
#: cannot hold them): the DST rule and the overlap policy.
_DELAYQ_KEYS = ("dst_gap", "dst_fold", "overlap")


def _rule_entries(entries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` entries whose schedule is a cron string or a delayq rule, or that
    choose a DST rule or an overlap policy (:data:`_DELAYQ_KEYS`)."""
    return {
        name: dict(entry)
        for name, entry in entries.items()
        if isinstance(entry, Mapping)
        and (isinstance(entry.get("schedule"), str | Rule) or any(key in entry for key in _DELAYQ_KEYS))
    }


def _check_dst_entry(rule: Rule, entry: Mapping[str, Any]) -> None:
    """:class:`InvalidSchedule` when an entry's ``dst_gap``/``dst_fold`` is not a choice, or is
    given for a rule that is not a cron."""
    gap, fold = entry.get("dst_gap"), entry.get("dst_fold")
    check_dst(gap, fold)
    if {gap, fold} - {None, "cron"} and not isinstance(rule, CronRule):
        raise InvalidSchedule(f"dst_gap and dst_fold apply to cron rules only, not to {rule.kind} rules")


class Scheduler(beat.Scheduler):  # type: ignore[misc]
    """Celery beat scheduler that delivers delayq jobs (and still runs ``beat_schedule``)."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        try:  # before Celery prints its banner (which shows self.info) or sets up anything
            # (an unknown setting is logged in setup_schedule, once the beat's log is set up;
            # with delayq_strict_settings it raises here)
            config = DelayQConfig.from_app(app, check=False)
        except ConfigurationError as exc:
            raise BeatConfigurationError(f"delayq: {exc}") from None
        if config.metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
            raise BeatConfigurationError(
                f"delayq: {setting_name(app, 'delayq_metrics_port')} is set, which needs "
                "prometheus-client: pip install 'celery-delayq[metrics]'"
            )
        self._rule_entries = _rule_entries(app.conf.beat_schedule or {})
        for name, entry in self._rule_entries.items():
            try:
                rule = parse_rule(entry["schedule"], app.conf.timezone or "UTC")
                if "dst_gap" in entry or "dst_fold" in entry:
                    _check_dst_entry(rule, entry)
                if "overlap" in entry:
                    check_overlap(name, entry["overlap"])
            except ScheduleError as exc:
                raise BeatConfigurationError(f"delayq: beat_schedule entry {name!r}: {exc}") from None
        self.dispatcher: Dispatcher | None = None
        self._config_synced = False
        self._config_entries: dict[str, Any] | None = None
        #: back-off of the tick after a Redis or broker connection error
        self.backoff = Backoff(_BACKOFF_START, _BACKOFF_MAX)
        self.metrics: MetricsServer | None = None  # the endpoint, when delayq_metrics_port is set
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        super().setup_schedule()  # beat_schedule and Celery's default entries, in memory
        self._config_synced = False
        self._sync_config()
        store = get_store(self.app)
        if self.dispatcher is not None:  # set up again: the old one's endpoint must go
            self._stop_dispatcher()
        self.dispatcher = Dispatcher(self.app, store)
        try:
            for warning in store.check_server():
                logger.warning("delayq: %s", warning)
        except REDIS_ERRORS as exc:
            logger.warning("delayq: cannot reach Redis at start (%s); will keep trying", error_text(exc))
        logger.info(
            "delayq: beat %s delivering from %d shards (prefix %r, batch %d, reclaim TTL %.0f s)",
            self.dispatcher.token,
            store.config.shards,
            store.config.prefix,
            store.config.batch_size,
            store.config.reclaim_ttl,
        )
        check_settings(self.app)  # a warning for each unknown delayq_* name (see __init__)
        line = intercept_line(self.app)
        if line is not None:
            logger.info("delayq: %s", line)
        if store.config.metrics_port is not None:
            try:
                self.metrics = serve_metrics(self.dispatcher)
            except OSError as exc:
                logger.error(
                    "delayq: cannot serve metrics on %s:%d (%s); delivering without them",
                    store.config.metrics_addr,
                    store.config.metrics_port,
                    error_text(exc),
                )

    def merge_inplace(self, b: Any) -> None:
        """Celery's merge of ``beat_schedule``, without the entries only delayq can run.

        Celery's ``ScheduleEntry`` cannot hold a cron string (``"0 7 * * *"``) or a delayq
        rule; those entries go straight to the Redis schedule store in :meth:`_sync_config`.
        """
        self._rule_entries = _rule_entries(b)
        super().merge_inplace({name: entry for name, entry in b.items() if name not in self._rule_entries})

    def _sync_config(self) -> None:
        """Move ``beat_schedule`` entries into the Redis schedule store (once per beat start).

        Entries whose schedule cannot be stored (a ``solar`` schedule, a custom
        schedule class) stay in this beat's memory and fire from every beat, as
        with Celery's own scheduler; a warning says which.
        """
        if self._config_entries is None:
            self._config_entries = {**self.schedule, **self._rule_entries}
        storable: dict[str, Any] = {}
        in_memory: dict[str, Any] = {}
        for name, entry in self._config_entries.items():
            schedule = entry["schedule"] if isinstance(entry, dict) else entry.schedule
            try:
                parse_rule(schedule, self.app.conf.timezone or "UTC")
            except ScheduleError as exc:
                in_memory[name] = entry
                logger.warning(
                    "delayq: beat_schedule entry %r stays in memory (%s): every beat fires it", name, exc
                )
            else:
                storable[name] = entry
        # Storable entries fire only from Redis, never from this beat's memory (not even
        # while Redis is unreachable): N beats must not fire them N times.
        self.data = in_memory
        try:
            report = sync_config(Schedules(self.app), storable)
        except _SYNC_ERRORS as exc:  # a full Redis: stored once there is room
            logger.warning(
                "delayq: cannot store beat_schedule in Redis yet (%s); will retry", error_text(exc)
            )
            return
        self._config_synced = True
        logger.info(
            "delayq: beat_schedule in Redis: %d added, %d updated, %d removed, %d unchanged%s",
            len(report["added"]),
            len(report["updated"]),
            len(report["removed"]),
            len(storable) - len(report["added"]) - len(report["updated"]) - len(report["kept_by_api"]),
            f"; names kept by API schedules: {report['kept_by_api']}" if report["kept_by_api"] else "",
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._config_synced:
            self._sync_config()
        parent_wait = super().tick(*args, **kwargs)
        dispatcher = self.dispatcher
        if dispatcher is None:  # pragma: no cover - setup_schedule always runs first
            return float(parent_wait)
        try:
            wait = dispatcher.run_once()
            if parent_wait is not None:
                wait = min(wait, parent_wait)
            if wait > 0:
                dispatcher.wait(wait)
        except REDIS_ERRORS as exc:
            dispatcher.stats.errors += 1
            kind = redis_error_kind(exc)
            dispatcher.stats.redis_errors[kind] += 1
            delay = self.backoff.fail()
            logger.error(_REDIS_ERROR_LINES[kind], error_text(exc), delay)
            dispatcher.close()
            return delay
        except (OperationalError, OSError) as exc:
            # kombu could not even hand out a connection to the broker: nothing was published,
            # the claimed jobs keep their leases. Back off as for Redis; never end the beat.
            dispatcher.stats.errors += 1
            delay = self.backoff.fail()
            logger.error("delayq: broker unavailable (%s); retrying in %.1f s", error_text(exc), delay)
            return delay
        if self.backoff.reset():
            logger.info("delayq: Redis reachable again")
        return 0.0

    def _stop_dispatcher(self) -> None:
        """Stop the metrics endpoint and the dispatcher (its heartbeat, its subscription)."""
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.dispatcher is not None:
            self.dispatcher.stop()

    def close(self) -> None:
        self._stop_dispatcher()
        super().close()

    @property
    def info(self) -> str:
        config = get_store(self.app).config
        return f"    . delayq -> {config.prefix} x {config.shards} shards"


def serve_metrics(dispatcher: Dispatcher, port: int | None = None, addr: str | None = None) -> MetricsServer:
    """Start the Prometheus endpoint (``/metrics``) of ``dispatcher`` on ``port``/``addr``
    (default ``delayq_metrics_port``/``delayq_metrics_addr``); stop it with its ``stop()``.

    Raises OSError when the port cannot be bound. See :mod:`.metrics`."""
    # Imported here because prometheus-client is only needed with a metrics port (there is no
    # cycle: metrics imports neither this module nor the dispatcher).
    from .metrics import MetricsServer

    config = dispatcher.config
    port = config.metrics_port if port is None else port
    if port is None:
        raise ConfigurationError(f"no port: set {setting_name(dispatcher.app, 'delayq_metrics_port')}")
    return MetricsServer(dispatcher, port, addr or config.metrics_addr)
