"""The job every row schedules, and its arguments by index.

The default is a real job: ``bench.job(user_id, text, locale=...)``, as users schedule them,
with an int user id, a text of 32-39 characters that differs per job, and one keyword argument
that differs per job too. Two other shapes are measured beside it where they tell something:
no arguments at all (the bench's old job) and a real job with a 2 KB keyword argument.

:func:`job_call` gives the ``(args, kwargs)`` of job ``i``; every row that schedules
``bench.job`` (and the Celery baselines beside it) takes its arguments from there.
"""

from __future__ import annotations

from typing import Any

#: A real job: an int user id, a 32-39 character text, ``locale=`` (all differ per job).
REAL = "real job"
#: ``bench.job()`` with no arguments.
BARE = "no arguments"
#: A real job with a ``payload=`` of :data:`PAYLOAD_BYTES` characters (differs per job).
PAYLOAD = "2 KB payload"
SHAPES = (REAL, BARE, PAYLOAD)

PAYLOAD_BYTES = 2048
#: All as long (the envelope's repr of a 2 KB payload job is cut at a length: see :func:`markers`).
LOCALES = ("en-US", "fr-FR", "de-DE", "es-ES", "pt-BR")

Call = tuple[tuple[Any, ...], dict[str, Any]]


def fields(i: int, shape: str = REAL) -> dict[str, Any]:
    """The values of job ``i`` that differ per job, by name (none for :data:`BARE`)."""
    if shape == BARE:
        return {}
    out: dict[str, Any] = {
        "user_id": 100_000 + i,
        "text": f"Order #{i} has shipped, thank you!",
        "locale": LOCALES[i % len(LOCALES)],
    }
    if shape == PAYLOAD:
        out["payload_tag"] = f"{i:012d}"  # the payload's first 12 characters, the rest all "x"
    elif shape != REAL:
        raise ValueError(f"unknown job shape {shape!r}; shapes: {', '.join(SHAPES)}")
    return out


def call_of(values: dict[str, Any]) -> Call:
    """``(args, kwargs)`` of a job with these :func:`fields`."""
    if not values:
        return (), {}
    kwargs = {"locale": values["locale"]}
    if "payload_tag" in values:
        kwargs["payload"] = str(values["payload_tag"]).ljust(PAYLOAD_BYTES, "x")
    return (values["user_id"], values["text"]), kwargs


def job_call(i: int, shape: str = REAL) -> Call:
    """``(args, kwargs)`` of job ``i``: ``bench.job(*args, **kwargs)``.

    >>> job_call(7)
    ((100007, 'Order #7 has shipped, thank you!'), {'locale': 'de-DE'})
    >>> job_call(7, BARE)
    ((), {})
    >>> args, kwargs = job_call(7, PAYLOAD)
    >>> len(kwargs["payload"]), kwargs["payload"][:14]
    (2048, '000000000007xx')
    """
    return call_of(fields(i, shape))


def markers(shape: str = REAL) -> dict[str, Any]:
    """Stand-ins for :func:`fields`, each found once in a stored envelope and replaced by a job's
    value there (see ``bench.harness.envelope_template``). Every value, marker or real, is plain
    ASCII with no quote or backslash: it reads the same in the envelope's JSON and in its reprs."""
    out: dict[str, Any] = {}
    for name, value in fields(0, shape).items():
        out[name] = 31_415_926_535_897_932 if isinstance(value, int) else f"bench0{name}0marker"
    if "payload_tag" in out:
        # As long as the real values: the envelope's repr of the kwargs is cut at a length, and
        # the template's must be cut where a job's is.
        out["locale"] = "zz-ZZ"
        out["payload_tag"] = "bench0paymk0"
    return out
