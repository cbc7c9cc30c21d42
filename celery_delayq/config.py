"""Every ``delayq_*`` setting: its default, its meaning, and how it is read.

Settings live in the Celery app's configuration (``app.conf.delayq_url = ...``,
or ``CELERY_DELAYQ_URL`` with Django's ``CELERY`` namespace) and are read once
per app into a typed, validated :class:`DelayQConfig`, kept by the app's extension
(:func:`extension`, one :class:`DelayQApp` per app) and read again when the settings change.

>>> from celery import Celery
>>> app = Celery(broker="redis://127.0.0.1:6390/0")
>>> cfg = DelayQConfig.from_app(app)
>>> cfg.url, cfg.prefix, cfg.shards
('redis://127.0.0.1:6390/0', 'delayq', 16)
>>> extension(app).parts["config"] is cfg
True
>>> app.conf.delayq_prefix = "other"
>>> reconfigure(app) is extension(app), DelayQConfig.from_app(app).prefix
(True, 'other')
"""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from .exceptions import ConfigurationError
from .setting_values import address, batch_expires, flag, number, optional_seconds, port

__all__ = [
    "DEFAULTS",
    "RECHECK_EVERY",
    "WATCHED",
    "WORKER_STEPS",
    "DelayQApp",
    "DelayQConfig",
    "check_settings",
    "configured",
    "extension",
    "install",
    "installed",
    "intercept_line",
    "reconfigure",
    "redact_url",
    "setting_name",
    "unknown_settings",
]

logger = logging.getLogger(__name__)

#: Setting name -> (default, one-line meaning). ``docs/settings.md`` has one
#: section per entry and a test checks that its defaults are these.
DEFAULTS: dict[str, tuple[Any, str]] = {
    "delayq_url": (
        None,
        "Redis URL of the job store; None means the broker URL when that is redis:// or rediss://.",
    ),
    "delayq_prefix": ("delayq", "Prefix of every key; two apps with different prefixes never meet."),
    "delayq_shards": (16, "Number of shards; must be the same for every producer and beat."),
    "delayq_reclaim_ttl": (
        30.0,
        "Seconds a beat holds claimed jobs before another beat may claim them again.",
    ),
    "delayq_batch_size": (500, "Most jobs one claim takes from one shard."),
    "delayq_max_sleep": (
        20.0,
        "Longest a beat sleeps without looking at every shard (the safety poll), in seconds.",
    ),
    "delayq_intercept_eta": (
        False,
        "Route apply_async(eta=/countdown=) and retry(countdown=) of DelayedTask tasks via delayq.",
    ),
    "delayq_dead_letter_unknown": (
        True,
        "Dead-letter a due job whose task is not registered in the beat's app.",
    ),
    "delayq_max_payload": (
        1_048_576,
        "Largest stored envelope in bytes; a larger job is refused at apply_at.",
    ),
    "delayq_push": (
        True,
        "The push path: when the broker is the store's Redis server and database, push each "
        "message and remove its job in one script (no duplicate window); False: always publish "
        "through kombu.",
    ),
    "delayq_push_on_claim": (
        True,
        "On the push path, jobs whose message has a stored template are pushed by the script that "
        "claims them, with no round trip through the beat; False: the beat builds every message.",
    ),
    "delayq_cluster": (
        False,
        "delayq_url names a node of a Redis Cluster: the store uses a cluster client.",
    ),
    "delayq_wait_replicas": (
        0,
        "Replicas each producer write waits for (WAIT) before it returns; 0: do not wait.",
    ),
    "delayq_record_lateness": (
        False,
        "Workers record due -> start lateness of delayq messages in <prefix>:lateness:start.",
    ),
    "delayq_publish_eta": (
        False,
        "Publish each job with eta = its due time, so that Flower and task-received events show it.",
    ),
    "delayq_metrics_port": (
        None,
        "TCP port of the beat's Prometheus /metrics endpoint (1-65535); None: no endpoint.",
    ),
    "delayq_metrics_addr": ("127.0.0.1", "Address the beat's /metrics endpoint listens on."),
    "delayq_past_warning": (
        3600.0,
        "Log (once per process) a job given a due time more than this many seconds before the "
        "Redis server's now, a sign of a wrong producer clock; None: never.",
    ),
    "delayq_slot_ttl": (
        60.0,
        "Seconds a released gated job's slot lasts unless its worker renews it (every third of "
        "it); a job whose worker died runs again after this. Beats and workers must agree.",
    ),
    "delayq_start_ttl": (
        3600.0,
        "Seconds a released gated job may wait in the broker for a worker to start it before "
        "its slot comes back and it is delivered again (its worker takes the slot over at the "
        "start, and renews it every third of delayq_slot_ttl). Longer than any queue backlog. "
        "Also how long a worker remembers which delivery of a job started (delayq_start_check).",
    ),
    "delayq_start_check": (
        True,
        "Workers check, before running a message a beat published through kombu, that no other "
        "delivery of the same job started first (one Redis round trip per such start), and drop "
        "a stale copy; False: run every copy.",
    ),
    "delayq_batch_expires": (
        604_800.0,
        "Seconds a finished batch (and its gate key's record) is kept after its last member "
        "ended, for delayq batches and the dashboard; None: kept until deleted. An unfinished "
        "batch never expires.",
    ),
    "delayq_behind_warning": (
        10.0,
        "Seconds a due job or schedule point may wait to be published before the beat logs that "
        "it is behind (once per streak; gauge delayq_behind_seconds); None: never.",
    ),
    "delayq_strict_settings": (
        False,
        "A delayq_* name in the configuration that is not a setting (a misspelling) raises "
        "ConfigurationError where it is otherwise logged as a warning: at the first use in a "
        "producer, and at the start of a beat or a worker.",
    ),
}


def setting_name(app: Any, name: str) -> str:
    """``name`` (``delayq_url``) as the user of ``app`` spells it in the configuration.

    An app configured with ``config_from_object(..., namespace="CELERY")`` (Django's usual
    way) reads ``CELERY_DELAYQ_URL``; Celery keeps that namespace in ``app.namespace``
    and matches the key's case to the namespace's, as this does.

    >>> from celery import Celery
    >>> setting_name(Celery(), "delayq_url")
    'delayq_url'
    >>> django = Celery()
    >>> django.config_from_object("examples.django_settings.settings", namespace="CELERY")
    >>> setting_name(django, "delayq_url")
    'CELERY_DELAYQ_URL'
    """
    namespace = getattr(app, "namespace", None)
    if not isinstance(namespace, str) or not namespace:
        return name
    key = namespace.rstrip("_") + "_" + name
    return key.upper() if namespace.isupper() else key.lower()


def unknown_settings(app: Any) -> list[str]:
    """One line for each ``delayq_*`` name in ``app``'s configuration that is not a setting
    (:data:`DEFAULTS`), spelled as the configuration spells it, with the closest setting.

    >>> from celery import Celery
    >>> app = Celery(set_as_current=False)
    >>> app.conf.update(delayq_urll="redis://", delayq_shards=4, delayq_zzz=1)
    >>> unknown_settings(app)
    ['unknown setting delayq_urll (did you mean delayq_url?)', 'unknown setting delayq_zzz']
    >>> django = Celery(set_as_current=False)
    >>> django.config_from_object({"CELERY_DELAYQ_SHARD": 4}, namespace="CELERY")
    >>> unknown_settings(django)
    ['unknown setting CELERY_DELAYQ_SHARD (did you mean CELERY_DELAYQ_SHARDS?)']
    """
    namespace = getattr(app, "namespace", None)
    head = namespace.rstrip("_").lower() + "_" if isinstance(namespace, str) and namespace else ""
    lines = []
    for key in app.conf:  # (every key: Celery's defaults, the app's own, the namespace's)
        if not isinstance(key, str):
            continue
        name = key.lower()
        if head:
            if not name.startswith(head):
                continue  # a name without the namespace: Celery does not read it either
            name = name[len(head) :]
        if not name.startswith("delayq_") or name in DEFAULTS:
            continue
        # (compared without the prefix every name shares, which would make any name close)
        close = difflib.get_close_matches(name[7:], [known[7:] for known in DEFAULTS], n=1)
        hint = f" (did you mean {setting_name(app, 'delayq_' + close[0])}?)" if close else ""
        lines.append(f"unknown setting {key}{hint}")
    return sorted(lines)


def check_settings(app: Any, warn: bool = True) -> list[str]:
    """Name each ``delayq_*`` name of ``app``'s configuration that is not a setting
    (:func:`unknown_settings`): with ``delayq_strict_settings`` on, raise
    :class:`ConfigurationError` naming them all; otherwise, with ``warn``, log a warning for
    each one not yet named for this app (once per app, whatever the number of calls).
    Returns the lines that were not named before (with ``warn``: named now).

    Called at the first read of the app's settings (:meth:`DelayQConfig.from_app`: a
    producer's first call), and as a beat or a worker of the app starts.
    """
    lines = unknown_settings(app)
    if not lines:
        return []
    if flag(setting_name(app, "delayq_strict_settings"), _conf_get(app, "delayq_strict_settings")):
        raise ConfigurationError("; ".join(lines) + f" ({setting_name(app, 'delayq_strict_settings')} is on)")
    ext = extension(app)
    new = [line for line in lines if line not in ext.warned]
    if warn:
        for line in new:
            logger.warning("delayq: %s", line)
        ext.warned.update(new)
    return new


def configured(app: Any) -> bool:
    """Whether ``app`` has a store: ``delayq_url`` set, or a ``redis://``/``rediss://`` broker
    (its default). An app without one is plain Celery: delayq's worker steps turn themselves
    off in its workers, and its tasks' ``apply_async`` is Celery's (docs/errors.md).

    >>> from celery import Celery
    >>> configured(Celery(broker="redis://127.0.0.1:6390/0", set_as_current=False))
    True
    >>> configured(Celery(broker="memory://", set_as_current=False))
    False
    """
    return extension(app).part("configured", lambda: _has_store(app))


def intercept_line(app: Any) -> str | None:
    """With ``delayq_intercept_eta`` on, the line a beat and a worker log as they start: how
    many of ``app``'s registered tasks it covers (their class has the mixin,
    ``DelayQTaskMixin``) and how many of the app's own plain tasks (``celery.*`` builtins
    aside) keep Celery's ETA path, with the fix; None when the setting is off.

    An app with one ``DelayedTask`` and one plain task logs::

        delayq_intercept_eta is on: it covers 1 task; 1 plain task keeps Celery's ETA path
        (eta/countdown wait in a worker): proj.report; give it base=DelayedTask or a base with
        DelayQTaskMixin (docs/one-off.md)

    (one line). Shared tasks (``@shared_task``) bind to every app of the process, so they are
    counted in each (``tests/test_settings_check.py`` checks the line).
    """
    if not DelayQConfig.from_app(app).intercept_eta:
        return None
    covered, plain = [], []
    for name, task in sorted(app.tasks.items()):
        if hasattr(type(task), "_delayq_intercept"):  # (the mixin's method, read by name:
            covered.append(name)  # this module imports nothing of the producer)
        elif not name.startswith("celery."):
            plain.append(name)
    setting = setting_name(app, "delayq_intercept_eta")
    line = f"{setting} is on: it covers {len(covered)} task{'' if len(covered) == 1 else 's'}"
    if not plain:
        return line + "; no plain task keeps Celery's ETA path"
    shown = ", ".join(plain[:5]) + (f", ... ({len(plain) - 5} more)" if len(plain) > 5 else "")
    one = len(plain) == 1
    return (
        f"{line}; {len(plain)} plain task{' keeps' if one else 's keep'} Celery's ETA path "
        f"(eta/countdown wait in a worker): {shown}; give {'it' if one else 'them'} "
        "base=DelayedTask or a base with DelayQTaskMixin (docs/one-off.md)"
    )


def _has_store(app: Any) -> bool:
    if _conf_get(app, "delayq_url"):
        return True
    broker = app.conf.broker_write_url or app.conf.broker_url or ""
    return isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss")


def _conf_get(app: Any, name: str) -> Any:
    conf = app.conf
    try:
        return conf[name]
    except KeyError:
        return DEFAULTS[name][0]


@dataclass(frozen=True)
class DelayQConfig:
    """The validated ``delayq_*`` settings of one app."""

    url: str
    prefix: str
    shards: int
    reclaim_ttl: float
    batch_size: int
    max_sleep: float
    intercept_eta: bool
    dead_letter_unknown: bool
    max_payload: int
    push: bool = True
    push_on_claim: bool = True
    cluster: bool = False
    wait_replicas: int = 0
    record_lateness: bool = False
    publish_eta: bool = False
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    past_warning: float | None = 3600.0
    slot_ttl: float = 60.0
    start_ttl: float = 3600.0
    start_check: bool = True
    batch_expires: float | None = 604_800.0
    behind_warning: float | None = 10.0
    strict_settings: bool = False

    @classmethod
    def from_app(cls, app: Any, check: bool = True) -> DelayQConfig:
        """The validated settings of ``app``: its extension's (:func:`extension`), read once
        and again after a settings change. The first read checks the names too
        (:func:`check_settings`: a warning, or with ``delayq_strict_settings`` an error);
        ``check=False`` leaves the warning to the caller (a beat: once its log is set up)."""
        ext = extension(app)
        config: DelayQConfig | None = ext.parts.get("config")
        return config if config is not None else ext.part("config", lambda: cls._read(app, check))

    @classmethod
    def _read(cls, app: Any, check: bool = True) -> DelayQConfig:
        config = cls.from_mapping({name: _conf_get(app, name) for name in DEFAULTS}, app=app)
        check_settings(app, warn=check)
        return config

    @classmethod
    def from_mapping(cls, values: dict[str, Any], app: Any = None) -> DelayQConfig:
        """Build from ``{"delayq_url": ..., ...}``; missing names take their default."""
        get = {name: values.get(name, default) for name, (default, _) in DEFAULTS.items()}
        n = {name: setting_name(app, name) for name in DEFAULTS}  # each name as the user spells it
        url = get["delayq_url"]
        if not url and app is not None:
            broker = app.conf.broker_write_url or app.conf.broker_url or ""
            if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
                url = broker.split(";", 1)[0]
        if not url or not isinstance(url, str):
            where = (
                f"set app.conf.{n['delayq_url']} = 'redis://host:6379/0'"
                if n["delayq_url"] == "delayq_url"
                else f"set {n['delayq_url']} = 'redis://host:6379/0' in the settings the app reads"
            )
            raise ConfigurationError(f"{n['delayq_url']} is not set and the broker is not Redis: {where}")
        if url.split("://", 1)[0] not in ("redis", "rediss", "unix"):
            raise ConfigurationError(
                f"{n['delayq_url']} must be a redis://, rediss:// or unix:// URL, got {redact_url(url)!r}"
            )
        cluster = flag(n["delayq_cluster"], get["delayq_cluster"])
        if cluster and url.split("://", 1)[0] == "unix":
            raise ConfigurationError(
                f"{n['delayq_cluster']} needs a redis:// or rediss:// URL of a cluster node in "
                f"{n['delayq_url']}, got {redact_url(url)!r}"
            )
        if not cluster and "," in urlsplit(url).netloc.rpartition("@")[2]:
            raise ConfigurationError(
                f"{n['delayq_url']} names several nodes ({redact_url(url)!r}), which only a Redis "
                f"Cluster takes: set {n['delayq_cluster']} = True, or name one server"
            )
        prefix = get["delayq_prefix"]
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} "):
            raise ConfigurationError(
                f"{n['delayq_prefix']} must be a non-empty string without braces or spaces, got {prefix!r}"
            )
        batch = number(n["delayq_batch_size"], get["delayq_batch_size"], int, 1)
        if batch > 5000:
            raise ConfigurationError(f"{n['delayq_batch_size']} must be <= 5000, got {batch}")
        return cls(
            url=url,
            prefix=prefix,
            shards=number(n["delayq_shards"], get["delayq_shards"], int, 1),
            reclaim_ttl=number(n["delayq_reclaim_ttl"], get["delayq_reclaim_ttl"], float, 0.01),
            batch_size=batch,
            max_sleep=number(n["delayq_max_sleep"], get["delayq_max_sleep"], float, 0.01),
            intercept_eta=flag(n["delayq_intercept_eta"], get["delayq_intercept_eta"]),
            dead_letter_unknown=flag(n["delayq_dead_letter_unknown"], get["delayq_dead_letter_unknown"]),
            max_payload=number(n["delayq_max_payload"], get["delayq_max_payload"], int, 1024),
            push=flag(n["delayq_push"], get["delayq_push"]),
            push_on_claim=flag(n["delayq_push_on_claim"], get["delayq_push_on_claim"]),
            cluster=cluster,
            wait_replicas=number(n["delayq_wait_replicas"], get["delayq_wait_replicas"], int, 0),
            record_lateness=flag(n["delayq_record_lateness"], get["delayq_record_lateness"]),
            publish_eta=flag(n["delayq_publish_eta"], get["delayq_publish_eta"]),
            metrics_port=port(n["delayq_metrics_port"], get["delayq_metrics_port"]),
            metrics_addr=address(n["delayq_metrics_addr"], get["delayq_metrics_addr"]),
            past_warning=optional_seconds(n["delayq_past_warning"], get["delayq_past_warning"]),
            slot_ttl=number(n["delayq_slot_ttl"], get["delayq_slot_ttl"], float, 0.5),
            start_ttl=number(n["delayq_start_ttl"], get["delayq_start_ttl"], float, 0.5),
            start_check=flag(n["delayq_start_check"], get["delayq_start_check"]),
            batch_expires=batch_expires(n["delayq_batch_expires"], get["delayq_batch_expires"]),
            behind_warning=optional_seconds(n["delayq_behind_warning"], get["delayq_behind_warning"]),
            strict_settings=flag(n["delayq_strict_settings"], get["delayq_strict_settings"]),
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for error messages and listings).

    >>> redact_url("redis://user:secret@cache:6379/0")
    'redis://user:***@cache:6379/0'
    >>> redact_url("amqp://:secret@rabbit//")
    'amqp://:***@rabbit//'
    >>> redact_url("redis://cache:6379/0")
    'redis://cache:6379/0'
    """
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    except ValueError:
        return url


# -- the app's extension ----------------------------------------------------------------------
#
# One object per Celery app: what delayq keeps for it, rebuilt whole when its settings change.
#
# :func:`extension` returns the app's :class:`DelayQApp`, whose parts are the validated
# settings (:class:`DelayQConfig`, part ``"config"``), the store (``"store"``), the
# message plans (:mod:`.producer.plans`, ``"state"``) and the results cache (:mod:`.producer.result`,
# ``"results"``), each made on first use by the module that owns it (this module, beneath every
# other, imports none of them). They live and die together: when the app's
# configuration changes, the next :func:`extension` call returns a new object (whoever still
# holds the old store, a running beat say, keeps using it).
#
# A change is seen without reading anything private of Celery:
#
# - ``app.conf`` is another object (``config_from_object`` on a configured app, or the app
#   configured since the extension was made): seen at the next call;
# - a setting written in place (``app.conf.x = ...``, ``app.conf.update``): the extension keeps a
#   *fingerprint*, the values of the settings delayq depends on (:data:`WATCHED`, read through
#   the public ``app.conf`` mapping), and compares it again at most every :data:`RECHECK_EVERY`
#   seconds, so a change is seen within that time. Reading those settings costs about as much
#   as a whole ``apply_at`` call (measured: 25 settings, 138 µs), too much for every call.
#   :func:`reconfigure` rebuilds at once.
#
# The worker side (slots, lateness, the start check) is attached per app by :func:`install`:
# two worker bootsteps (:class:`~.flow.slots.SlotReceivers` and
# :class:`~.worker.lateness.DelayQWorker`, named by :data:`WORKER_STEPS`) in
# ``app.steps['worker']``. An app that
# uses ``DelayedTask`` (or the mixin) is installed when its task is bound to it; any other app
# calls ``celery_delayq.install(app)`` once, in the module the worker loads. An app never
# installed gets no delayq receiver and no step. An app installed without a store
# (:func:`configured`: no ``delayq_url`` and a broker that is not Redis; a shared task with the
# mixin binds to every app of the process) has the steps, which turn themselves off with one
# warning: its worker is plain Celery's.
#

T = TypeVar("T")

#: Seconds between two reads of an app's fingerprint (see above); 0: every call.
RECHECK_EVERY = 0.5

#: The worker bootsteps :func:`install` adds, by name (Celery loads them when a worker is
#: built): the slot receivers (flow control) and the lateness recorder and start check.
WORKER_STEPS = ("celery_delayq.flow.slots:SlotReceivers", "celery_delayq.worker.lateness:DelayQWorker")

#: The settings whose values make an app's fingerprint: every ``delayq_*`` setting, the broker
#: URLs (``delayq_url``'s default) and the Celery settings a stored message is built from.
WATCHED: tuple[str, ...] = (
    *DEFAULTS,
    "broker_url",
    "broker_write_url",
    "task_always_eager",
    "task_default_queue",
    "task_default_exchange",
    "task_default_exchange_type",
    "task_default_routing_key",
    "task_default_priority",
    "task_default_delivery_mode",
    "task_queues",
    "task_routes",
    "task_create_missing_queues",
    "task_queue_max_priority",
    "task_inherit_parent_priority",
    "task_serializer",
    "task_compression",
    "task_protocol",
    "task_time_limit",
    "task_soft_time_limit",
    "task_annotations",
    "task_repr_maxlevels",
)

_ATTRIBUTE = "delayq_extension"  # the one attribute delayq sets on an app
_lock = threading.Lock()


def _fingerprint(app: Any) -> tuple[Any, ...]:
    get = app.conf.get
    return (getattr(app, "namespace", None), *(get(name) for name in WATCHED))


class DelayQApp:
    """What delayq keeps for one app, valid while its settings are unchanged."""

    def __init__(self, app: Any) -> None:
        self.fingerprint = _fingerprint(app)  # (first: reading a setting may load the config)
        self.conf = app.conf  # the configuration object it was made from
        self.checked = time.monotonic()
        #: part name -> the part ("config", "configured", "store", "state", "results")
        self.parts: dict[str, Any] = {}
        #: the unknown-setting lines already logged for the app (:func:`check_settings`),
        #: passed on to the extension made after a settings change
        self.warned: set[str] = set()

    def part(self, name: str, make: Callable[[], T]) -> T:
        """The part ``name``, made by ``make()`` on first use (two threads may both make it:
        one is kept)."""
        try:
            found: T = self.parts[name]
            return found
        except KeyError:
            made: T = self.parts.setdefault(name, make())
            return made

    def current(self, app: Any) -> bool:
        """Whether this is still ``app``'s extension (see above)."""
        if app.conf is not self.conf:
            return False
        now = time.monotonic()
        if now - self.checked < RECHECK_EVERY:
            return True
        try:
            same = bool(_fingerprint(app) == self.fingerprint)
        except Exception:  # a value that cannot be compared: made anew
            same = False
        if same:
            self.checked = now
        return same


def extension(app: Any) -> DelayQApp:
    """The app's :class:`DelayQApp`, made on first use and anew after a settings change."""
    ext: DelayQApp | None = app.__dict__.get(_ATTRIBUTE)
    if ext is not None and (
        (app.conf is ext.conf and time.monotonic() - ext.checked < RECHECK_EVERY) or ext.current(app)
    ):
        return ext
    return _rebuild(app, ext)


def reconfigure(app: Any) -> DelayQApp:
    """Make the app's extension anew now (a setting changed and must be seen at once)."""
    return _rebuild(app, app.__dict__.get(_ATTRIBUTE))


def _rebuild(app: Any, old: DelayQApp | None) -> DelayQApp:
    with _lock:
        ext: DelayQApp | None = app.__dict__.get(_ATTRIBUTE)
        if ext is not old and ext is not None:  # another thread made it meanwhile
            return ext
        ext = DelayQApp(app)
        if old is not None:
            ext.warned = old.warned  # (each unknown name is named once per app)
        app.__dict__[_ATTRIBUTE] = ext
    return ext


def install(app: Any) -> Any:
    """Attach delayq's worker side to ``app``: the :data:`WORKER_STEPS` bootsteps, which, in a
    worker of this app, give gated tasks' slots back, record start lateness
    (``delayq_record_lateness``) and check task starts (``delayq_start_check``). Idempotent;
    returns the app. Call it before the worker is built (in the module the worker loads)."""
    steps = app.steps["worker"]
    for step in WORKER_STEPS:
        steps.add(step)
    return app


def installed(app: Any) -> bool:
    """Whether :func:`install` attached the worker side to ``app``."""
    return all(step in app.steps["worker"] for step in WORKER_STEPS)
