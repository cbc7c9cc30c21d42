"""Bounded reads of stored data: what the beat and the readers decode from Redis.

Everything in the store may have been written by someone other than this package: an
operator with write access to the prefix, a buggy migration, a half-applied restore. So
every decode of stored data (envelopes, leases, schedule definitions and run states,
heartbeats, dead-letter records) goes through :func:`load_json` (or, for a lease entry,
:func:`~.lua_formats.parse_lease`),
which refuse what does not read with :class:`~..exceptions.CorruptData` (a ``ValueError``)
and a reason, instead of letting a ``RecursionError``, a ``KeyError`` or an
``AttributeError`` end the beat.

Depth: Python's ``json`` has no nesting limit of its own. Its decoder counts its recursion,
so a very deep text raises ``RecursionError`` cleanly (caught here), but a text nested 900
deep decodes, and then whatever walks the result later (kombu, Celery, ``json.dumps``) may
raise it anywhere further down the beat's stack. So the result's depth is bounded too: when
the text has at most :data:`MAX_DEPTH` opening brackets (counted in C, ``str.count``) it cannot
be nested deeper and nothing more is done (the common case: an envelope's arguments are a
string in it, so their brackets count but do not nest); otherwise the decoded containers are
walked without recursion, which costs one step per container (a few for an envelope).
:func:`check_depth` does the same on text without decoding it (the strings blanked out, the
brackets counted in one pass): for the producer, which holds only the encoded envelope.

>>> load_json('{"a": [1, "[[[["]}', "envelope")
{'a': [1, '[[[[']}
>>> load_json("[" * 200 + "]" * 200, "envelope")
Traceback (most recent call last):
...
celery_delayq.exceptions.CorruptData: envelope is nested more than 100 levels deep
>>> load_json("[1]", "schedule definition")
Traceback (most recent call last):
...
celery_delayq.exceptions.CorruptData: schedule definition is a JSON array, not a JSON object
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..exceptions import CorruptData

__all__ = ["MAX_DEPTH", "MAX_SMALL", "check_depth", "load_json"]

#: Deepest nesting of arrays and objects accepted in stored JSON. Celery's own headers nest
#: three or four levels; the beat's stack must keep room for kombu and Celery below it.
MAX_DEPTH = 100

#: Largest run state, heartbeat or lease (bytes) read: these are small by construction.
MAX_SMALL = 65_536

# A JSON string, escapes included ("unrolled" so the regex engine does not backtrack).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")

_JSON_TYPES = {
    dict: "a JSON object",
    list: "a JSON array",
    str: "a JSON string",
    bool: "true or false",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def check_depth(text: str, what: str, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`CorruptData` when the JSON ``text`` nests deeper than ``limit``."""
    if text.count("[") + text.count("{") <= limit:
        return
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                raise CorruptData(f"{what} is nested more than {limit} levels deep")
        else:
            depth -= 1


def _depth_over(data: Any, limit: int) -> bool:
    """Whether decoded JSON nests arrays and objects deeper than ``limit`` (no recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)] if isinstance(data, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def load_json(raw: Any, what: str, kind: type | None = dict, max_bytes: int | None = None) -> Any:
    """``raw`` (stored text) decoded, or :class:`CorruptData` saying why it cannot be:
    not text, over ``max_bytes``, nested deeper than :data:`MAX_DEPTH`, not JSON, or (with
    ``kind``) not of that type. ``what`` names the entry in the reason."""
    if isinstance(raw, bytes | bytearray):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptData(f"{what} is not UTF-8 text: {exc}") from None
    if not isinstance(raw, str):
        raise CorruptData(f"{what} is not text but {type(raw).__name__}")
    if max_bytes is not None and len(raw) > max_bytes:
        raise CorruptData(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CorruptData(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise CorruptData(f"{what} is not JSON: {exc}") from None
    if raw.count("[") + raw.count("{") > MAX_DEPTH and _depth_over(data, MAX_DEPTH):
        raise CorruptData(f"{what} is nested more than {MAX_DEPTH} levels deep")
    if kind is not None and not isinstance(data, kind):
        found = _JSON_TYPES.get(type(data), type(data).__name__)
        raise CorruptData(f"{what} is {found}, not {_JSON_TYPES.get(kind, kind.__name__)}")
    return data
