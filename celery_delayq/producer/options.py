"""``apply_async``'s option handling, written once: what a caller may give a delayed job
(options, task id, args, kwargs, ``apply_at_many`` items), checked as Celery checks it
(or refused where a stored job cannot carry it). The route and Celery message those options
make are :mod:`.message`'s.

:mod:`.build` calls these for one job at a time and for a plan shared by many jobs alike.
"""

from __future__ import annotations

import math
import numbers
import unicodedata
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import kombu.compression
from celery.utils.saferepr import saferepr
from kombu.entity import DELIVERY_MODES, Queue

from ..due import due_ms_from_eta
from ..exceptions import InvalidArguments, InvalidOptions, InvalidTaskId
from ..flow.gate import check_key
from ..store.envelope import CLAIM_HEADER, DUE_HEADER

__all__ = [
    "MAX_TASK_ID_LENGTH",
    "TRANSPORT_OPTIONS",
    "check_kwargs_keys",
    "check_options",
    "check_signature",
    "check_task_id",
    "clean_options",
    "due_item",
    "job_args",
    "job_kwargs",
    "job_label",
    "short_repr",
    "unique_window_ms",
]

#: ``apply_async`` options naming a transport object. apply_at refuses them; the intercepted
#: ``apply_async`` drops them (Celery's canvas passes its producer to every member).
TRANSPORT_OPTIONS = ("producer", "connection", "publisher")

# Options apply_async takes that make no sense for a stored job.
_REFUSED = {
    "producer": "a producer cannot be stored; the beat publishes with its own",
    "connection": "a connection cannot be stored; the beat publishes with its own",
    "publisher": "a producer cannot be stored; the beat publishes with its own",
    "router": "a router object cannot be stored; use task_routes or queue=",
    "content_type": "the content type is the serializer's; use serializer=",
    "content_encoding": "the content encoding is the serializer's; use serializer=",
}
# Options that only steer this call and are never part of the message.
_CALL_ONLY = ("add_to_parent", "result_cls")

#: The longest task id a producer may store, in characters. A Celery id is 36; a schedule
#: point's id is at most 220 (a name of at most 200, ``@`` and the point's time).
MAX_TASK_ID_LENGTH = 512


# -- options, ids and arguments ------------------------------------------------------------


def clean_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` less what never reaches the message; raise on what is refused."""
    if not options:
        return {}
    options = dict(options)
    for name, why in _REFUSED.items():
        if options.get(name) is not None:
            raise InvalidOptions(f"option {name!r} is not supported by apply_at: {why}")
        options.pop(name, None)
    for name in ("eta", "countdown"):
        if options.get(name) is not None:
            raise InvalidOptions(f"option {name!r} conflicts with the due time given to apply_at")
        options.pop(name, None)
    for name in _CALL_ONLY:
        options.pop(name, None)
    headers = options.get("headers")
    if isinstance(headers, Mapping) and (DUE_HEADER in headers or CLAIM_HEADER in headers):
        # A retry (``self.retry``) passes the request's headers on, with the due time and the
        # claim of the attempt that is running; the beat sets the new job's own at publish.
        options["headers"] = {k: v for k, v in headers.items() if k not in (DUE_HEADER, CLAIM_HEADER)}
    return options


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to a length an error message can carry, on one line (a string's
    control characters escaped, as ``repr`` does and Celery's ``saferepr`` does not)."""
    text: str = repr(value[:100]) if isinstance(value, str) else saferepr(value, 60)
    return text if len(text) <= 80 else text[:77] + "..."


def job_label(task_id: Any, name: str) -> str:
    return f"job {short_repr(task_id)} of {name!r}"


#: The longest ``unique_for``: 10 years (the enqueue script takes at most 12 digits of ms).
MAX_UNIQUE_FOR = 10 * 366 * 86_400


def unique_window_ms(unique_for: Any, task_id: Any, replace: bool, name: str) -> int:
    """``unique_for`` (seconds > 0, or a ``timedelta``) as whole ms (at least 1), checked with
    what it needs: the job's own ``task_id`` (a generated id is never given twice) and no
    ``replace`` (it would overwrite what the window keeps). Else :class:`InvalidOptions`.

    >>> unique_window_ms(3600, "invoice-42", False, "proj.remind")
    3600000
    >>> unique_window_ms(timedelta(days=1), "invoice-42", False, "proj.remind")
    86400000
    >>> unique_window_ms(60, None, False, "proj.remind")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidOptions: unique_for of 'proj.remind' needs the job's own task_id ...
    """
    ms = _duration_ms(unique_for, "unique_for", name, zero=False)
    if task_id is None:
        raise InvalidOptions(
            f"unique_for of {name!r} needs the job's own task_id (an id taken stays taken; a "
            "generated one is never given twice): apply_at(..., task_id='invoice-42', unique_for=...)"
        )
    if replace:
        raise InvalidOptions(
            f"unique_for and replace=True of {name!r} contradict: the window keeps the id's job, "
            "replace overwrites it"
        )
    return ms


def _duration_ms(value: Any, what: str, name: str, zero: bool) -> int:
    """Seconds (a number, not a bool) or a ``timedelta`` as whole ms: > 0 (``zero``: >= 0) and at
    most 10 years, else :class:`InvalidOptions` naming ``what`` of task ``name``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidOptions(
            f"{what} of {name!r} must be a number of seconds or a timedelta, got "
            f"{type(value).__name__}: {short_repr(value)}"
        )
    else:
        seconds = float(value)
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (low_ok and seconds <= MAX_UNIQUE_FOR):  # (NaN fails too)
        raise InvalidOptions(
            f"{what} of {name!r} must be {'0 or more' if zero else 'more than 0'} and at most "
            f"{MAX_UNIQUE_FOR} s (10 years), got {short_repr(value)}"
        )
    return round(seconds * 1000) if zero else max(1, round(seconds * 1000))


def keyed_option(options: dict[str, Any], name: str) -> tuple[str, str, int, int] | None:
    """Pop and check ``debounce=(key, wait)`` or ``(key, wait, max_wait)``, or
    ``throttle=(key, period)``, from ``options``: ``(mode, key, ms, ms)`` (the wait and the max
    wait, 0 for none; or 0 and the period), or None when neither is given.

    >>> keyed_option({"debounce": ("user:42", 30, 300)}, "proj.digest")
    ('debounce', 'user:42', 30000, 300000)
    >>> keyed_option({"throttle": ("user:42", 60)}, "proj.digest")
    ('throttle', 'user:42', 0, 60000)
    >>> both = {"debounce": ("user:42", 30), "throttle": ("user:42", 60)}
    >>> keyed_option(both, "proj.digest")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidOptions: debounce and throttle of 'proj.digest' exclude each other: ...
    """
    debounce, throttle = options.pop("debounce", None), options.pop("throttle", None)
    if debounce is None and throttle is None:
        return None
    if debounce is not None and throttle is not None:
        raise InvalidOptions(f"debounce and throttle of {name!r} exclude each other: give one")
    mode = "debounce" if debounce is not None else "throttle"
    value = debounce if debounce is not None else throttle
    shapes = "(key, wait) or (key, wait, max_wait)" if mode == "debounce" else "(key, period)"
    if not isinstance(value, tuple | list) or not 2 <= len(value) <= (3 if mode == "debounce" else 2):
        raise InvalidOptions(f"{mode} of {name!r} must be {shapes}, got {short_repr(value)}")
    key = check_key(value[0], f"the key of {mode}")
    if mode == "throttle":
        return mode, key, 0, _duration_ms(value[1], "the period of throttle", name, zero=False)
    wait = _duration_ms(value[1], "the wait of debounce", name, zero=True)
    most = 0
    if len(value) == 3 and value[2] is not None:
        most = _duration_ms(value[2], "the max_wait of debounce", name, zero=False)
        if most < wait:
            raise InvalidOptions(
                f"the max_wait of debounce of {name!r} ({short_repr(value[2])}) is shorter than its "
                f"wait ({short_repr(value[1])}): a job waits at most max_wait after the first call"
            )
    return mode, key, wait, most


def check_task_id(task_id: Any, name: str) -> str:
    """``task_id`` if a job of task ``name`` may be stored under it, else :class:`InvalidTaskId`:
    a non-empty string of at most :data:`MAX_TASK_ID_LENGTH` characters, UTF-8 encodable.

    >>> check_task_id("invoice-42", "proj.remind")
    'invoice-42'
    >>> check_task_id(42, "proj.remind")
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidTaskId: task_id of 'proj.remind' must be a string, got int: 42
    """
    if not isinstance(task_id, str):
        raise InvalidTaskId(
            f"task_id of {name!r} must be a string, got {type(task_id).__name__}: {short_repr(task_id)}"
        )
    if not task_id:
        raise InvalidTaskId(
            f"task_id of {name!r} must not be empty (leave task_id out, or None, for a generated one)"
        )
    if len(task_id) > MAX_TASK_ID_LENGTH:
        raise InvalidTaskId(
            f"task_id {short_repr(task_id)} of {name!r} is {len(task_id)} characters, over the limit "
            f"of {MAX_TASK_ID_LENGTH} (celery_delayq.producer.options.MAX_TASK_ID_LENGTH)"
        )
    if not task_id.isprintable():
        control = next((c for c in task_id if unicodedata.category(c) == "Cc"), None)
        if control is not None:
            raise InvalidTaskId(
                f"task_id {short_repr(task_id)} of {name!r} holds a control character ({control!r} "
                f"at position {task_id.index(control)}): ids are shown and typed in terminals, logs "
                "and URLs"
            )
    if not task_id.isascii():
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTaskId(
                f"task_id {short_repr(task_id)} of {name!r} is not UTF-8 text ({exc.reason}: "
                f"{task_id[exc.start]!r} at position {exc.start}); Redis cannot store it"
            ) from None
    return task_id


def job_args(args: Any, task_id: Any, name: str) -> tuple[Any, ...]:
    """A job's ``args`` as a tuple; as in Celery, anything false is none, and anything
    else must be a list or tuple (a string is not split into characters)."""
    if type(args) is tuple:
        return args
    if isinstance(args, list | tuple):
        return tuple(args)
    try:
        empty = args is None or not args
    except Exception:  # a value whose truth is an error: refused below
        empty = False
    if empty:
        return ()
    raise InvalidArguments(
        f"{job_label(task_id, name)}: args must be a list or tuple, got {type(args).__name__}: "
        f"{short_repr(args)}"
    )


def job_kwargs(kwargs: Any, task_id: Any, name: str) -> dict[str, Any]:
    """A job's ``kwargs`` as a dict; as in Celery, anything false is none, else a mapping whose
    keys are strings (:func:`check_kwargs_keys`)."""
    if type(kwargs) is dict or isinstance(kwargs, Mapping):  # (a dict without the ABC check)
        out: dict[str, Any] = dict(kwargs)
        check_kwargs_keys(out, task_id, name)
        return out
    try:
        empty = kwargs is None or not kwargs
    except Exception:  # (as above)
        empty = False
    if empty:
        return {}
    raise InvalidArguments(
        f"{job_label(task_id, name)}: kwargs must be a mapping (a dict), got {type(kwargs).__name__}: "
        f"{short_repr(kwargs)}"
    )


def check_kwargs_keys(kwargs: dict[Any, Any], task_id: Any, name: str) -> None:
    """Refuse, with :class:`InvalidArguments`, ``kwargs`` with a key that is not a string (a
    keyword argument's name): Python's ``f(**kwargs)`` would fail at the worker, and JSON
    would store the key as text.

    >>> check_kwargs_keys({1: 2}, "invoice-42", "proj.remind")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidArguments: job 'invoice-42' of 'proj.remind': kwargs keys must be ...
    """
    try:
        "".join(kwargs)  # (one C call over the keys: fails at the first that is not a string)
    except TypeError:
        bad = next(key for key in kwargs if not isinstance(key, str))
        raise InvalidArguments(
            f"{job_label(task_id, name)}: kwargs keys must be strings (argument names), got "
            f"{type(bad).__name__}: {short_repr(bad)}"
        ) from None


def _time_limit_ok(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int past float's range
        return False


def _compression_ok(value: Any) -> bool:
    try:
        kombu.compression.get_encoder(value)  # type: ignore[no-untyped-call]
    except (KeyError, TypeError):
        return False
    return True


#: Options Celery's ``apply_async`` refuses (or that cannot work at the worker) when of the
#: wrong kind, checked once per call: (option, test, what it must be). ``None`` always passes.
_OPTION_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("queue", lambda v: isinstance(v, str | Queue), "a queue name or a kombu Queue"),
    ("headers", lambda v: isinstance(v, Mapping), "a dict (a mapping)"),
    ("compression", _compression_ok,
     f"a compression kombu knows ({', '.join(sorted(kombu.compression._aliases))})"),
    # (Any other number: RabbitMQ closes the channel, PRECONDITION_FAILED delivery_mode_unknown.)
    ("delivery_mode",
     lambda v: (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v in (1, 2))
     or (isinstance(v, str) and v in DELIVERY_MODES),
     "1, 2, 'transient' or 'persistent'"),
    ("time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("soft_time_limit", _time_limit_ok, "a finite number of seconds >= 0"),
    ("stamped_headers", lambda v: isinstance(v, list | tuple) and all(type(h) is str for h in v),
     "a list of option names"),
)  # fmt: skip


def check_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse, with :class:`InvalidOptions`, an option (given to the call, or else a default of
    the task) that Celery's ``apply_async`` would refuse or that cannot work. Called where the
    route is made: once per call (or per distinct options, when the route is kept)."""
    for option, test, must in _OPTION_CHECKS:
        value = options[option] if option in options else defaults.get(option)
        if value is not None and not test(value):
            where = "" if option in options else " (the task's default)"
            raise InvalidOptions(
                f"option {option!r}{where} must be {must}, got {type(value).__name__}: {short_repr(value)}"
            )
    stamps = options.get("stamped_headers")
    if stamps:
        missing = [h for h in stamps if h not in options]
        if missing:
            raise InvalidOptions(f"option 'stamped_headers' names options not given: {missing}")


def check_signature(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if task.typing:
        header = getattr(task, "__header__", None)
        if header is not None:
            header(*args, **kwargs)


def due_item(item: Any, index: int, app: Any) -> tuple[int, Any, Any]:
    """``apply_at_many``'s item number ``index``, ``(eta, args, kwargs)`` (a tuple or a list),
    as ``(due ms, args, kwargs)``; :class:`InvalidArguments` for anything else.

    >>> from celery import Celery
    >>> due_item((1_700_000_000, (1,), None), 0, Celery())
    (1700000000000, (1,), None)
    >>> due_item((1_700_000_000, (1,)), 3, Celery())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    celery_delayq.exceptions.InvalidArguments: apply_at_many item 3 must be an (eta, args, kwargs) ...
    """
    if (type(item) is tuple or type(item) is list) and len(item) == 3:
        return due_ms_from_eta(item[0], app), item[1], item[2]
    kind = type(item).__name__ + (f" of {len(item)}" if isinstance(item, tuple | list) else "")
    raise InvalidArguments(
        f"apply_at_many item {index} must be an (eta, args, kwargs) tuple, got {kind}: {short_repr(item)} "
        "(an item may carry its task id fourth: (eta, args, kwargs, task_id))"
    )
