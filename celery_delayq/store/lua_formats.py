"""The Python mirror of the text formats the Lua helpers define: the lease entry, the wake
message, and flow control's waiting order and batch message (``lua/includes/gate.lua``). Each is
defined once in Lua (``lua/includes/lease.lua``, ``wake.lua``, ``gate.lua``) and once here;
``tests/test_lua_formats.py`` runs the lease and wake helpers through the loader on a real server
and checks that both sides agree, entry by entry (``tests/test_gate_scripts.py`` the gate's).

Lease entry: the value of a job id in a shard's ``leases`` hash while a beat holds the job,
``"<due ms>|<tries>|<token>"``: the job's original due time (its score in ``due`` is then the
lease expiry), how many times it has been claimed, and the claimer's token (no ``|`` in it).
Only the scripts write it (``claim``); Python reads it (``Store.scan``, the Spark reader).
An entry that does not read is corrupt data: the scripts treat it as an expired lease of
unknown history and the readers as "leased, tries 0" (see ``lua/claim.lua``).

Wake message: ``"<shard index>:<due ms>"``, published on the wake channel when a write makes
a shard due earlier than its wake marker (``enqueue``, ``reschedule``, ``requeue``,
``sched_put``, ``fire``); a sleeping beat that reads it looks at that shard by then.

>>> lease_entry(1767225600000, 2, "beat-1")
'1767225600000|2|beat-1'
>>> parse_lease("1767225600000|2|beat-1"), parse_lease("garbage")
((1767225600000, 2), None)
>>> lease_holds("1767225600000|2|beat-1", "beat-1"), lease_holds("1|2|my-beat-1", "beat-1")
(True, False)
>>> wake_message(3, 1767225600000)
'3:1767225600000'
>>> parse_wake("3:1767225600000"), parse_wake("sentinel")
((3, 1767225600000.0), None)

Key entry: the value of a gate key in a shard's ``gate:keys`` hash (``includes/gate.lua``
key_read, key_entry): ``"<own>"`` (the last limit a job of the key carried, ``""`` for none)
while the key has no run-time override and is not paused, else ``"<own>|<override>|<paused>"``
(override ``"<n>"``, ``"none"`` (no cap) or ``""``; paused ``"1"`` or ``""``).

>>> parse_key_entry("2"), parse_key_entry("2|none|1"), parse_key_entry("|5|")
(('2', None, False), ('2', 'none', True), ('', '5', False))

Waiting order (``gate:wait:<key>``): a parked job's score, ``(255 - priority) * 1e13 + due ms``;
the lowest goes first (higher priority, then earlier due). Batch message: published on the
batch channel when a batch completes, ``"<batch id>|<counts JSON>"``.

>>> wait_score(5, 1767225600000) < wait_score(0, 1767225600000) < wait_score(0, 1767225600001)
True
>>> batch_message("b1", {"total": 2, "succeeded": 1, "failed": 1, "cancelled": 0})
'b1|{"total":2,"succeeded":1,"failed":1,"cancelled":0}'
>>> parse_batch_message('b1|{"total":2,"succeeded":1,"failed":1,"cancelled":0}')
('b1', {'total': 2, 'succeeded': 1, 'failed': 1, 'cancelled': 0})
"""

from __future__ import annotations

import json
import re
from typing import Any

from .bounded import MAX_SMALL

__all__ = [
    "BATCH_COUNTS",
    "batch_message",
    "lease_entry",
    "lease_holds",
    "parse_batch_message",
    "parse_key_entry",
    "parse_lease",
    "parse_wake",
    "wait_score",
    "wake_message",
]

#: The counts of a batch message, in the order the script writes them.
BATCH_COUNTS = ("total", "succeeded", "failed", "cancelled")

# As lease.lua's pattern '^(-?%d+)|(%d+)|' (ASCII digits, as Lua's %d), with bounds Lua has
# not: at most 17 digits of due time and 9 of tries. Nothing longer is ever written (due
# times stay within +-2**53, 16 digits); Lua would read it as an inexact float.
_LEASE = re.compile(r"(-?[0-9]{1,17})\|([0-9]{1,9})\|")


def lease_entry(due_ms: int, tries: int, token: str) -> str:
    """The lease entry of a job due at ``due_ms``, claimed ``tries`` times, held by ``token``."""
    return f"{int(due_ms)}|{int(tries)}|{token}"


def parse_lease(lease: Any) -> tuple[int, int] | None:
    """``(due ms, tries)`` of a lease entry ``"<due ms>|<tries>|<token>"``, or None when it does
    not read (the scripts then treat the job as held by no valid lease; see ``lua/claim.lua``)."""
    if not isinstance(lease, str) or len(lease) > MAX_SMALL:
        return None
    match = _LEASE.match(lease)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def lease_holds(lease: str, token: str) -> bool:
    """Does the lease entry end with ``"|<token>"`` (the whole token)? The scripts let only
    that caller renew, ack, bury, push (push_claimed) or fire the job; the rest of the entry is not read."""
    return lease.endswith("|" + token)


def wake_message(shard: int, due_ms: int) -> str:
    """The wake message telling a sleeping beat that ``shard`` is due at ``due_ms``."""
    return f"{int(shard)}:{int(due_ms)}"


def parse_wake(data: Any) -> tuple[int, float] | None:
    """``(shard index, due ms)`` of a wake message, or None for anything else on the channel."""
    try:
        shard, due = str(data).split(":", 1)
        return int(shard), float(due)
    except ValueError:
        return None


def wait_score(priority: int, due_ms: int) -> int:
    """The score of a parked job in its key's waiting list (``includes/gate.lua`` wait_score)."""
    return (255 - int(priority)) * 10**13 + int(due_ms)


def batch_message(batch_id: str, counts: dict[str, int]) -> str:
    """The batch channel's message for a completed batch (``includes/gate.lua`` batch_check)."""
    body = ",".join(f'"{name}":{int(counts[name])}' for name in BATCH_COUNTS)
    return f"{batch_id}|{{{body}}}"


def parse_batch_message(data: Any) -> tuple[str, dict[str, int]] | None:
    """``(batch id, counts)`` of a batch message, or None for anything else. The id is what
    comes before the last ``"|{"`` (a batch id has no ``{``)."""
    text = str(data)
    cut = text.rfind("|{")
    if cut < 0:
        return None
    try:
        counts = json.loads(text[cut + 1 :])
    except ValueError:
        return None
    if not isinstance(counts, dict) or any(type(counts.get(name)) is not int for name in BATCH_COUNTS):
        return None
    return text[:cut], {name: counts[name] for name in BATCH_COUNTS}


def parse_key_entry(entry: Any) -> tuple[str | None, str | None, bool]:
    """``(own limit text, override or None, paused)`` of a ``gate:keys`` entry, as
    ``includes/gate.lua`` key_read reads it: None (no entry) is ``(None, None, False)``; an
    entry that is not three fields is an own limit alone."""
    if entry is None:
        return None, None, False
    if isinstance(entry, bytes):
        entry = entry.decode()
    parts = str(entry).split("|")
    if len(parts) != 3:
        return str(entry), None, False
    own, override, paused = parts
    return own, (override or None), paused != ""
