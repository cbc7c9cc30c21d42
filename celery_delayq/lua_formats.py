"""The Python mirror of the two text formats the Lua helpers define: the lease entry and the
wake message. Each is defined once in Lua (``lua/includes/lease.lua``, ``lua/includes/wake.lua``)
and once here; ``tests/test_lua_formats.py`` runs the Lua helpers through the loader on a real
server and checks that both sides agree, entry by entry.

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
"""

from __future__ import annotations

import re
from typing import Any

from .bounded import MAX_SMALL

__all__ = ["lease_entry", "lease_holds", "parse_lease", "parse_wake", "wake_message"]

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
    that caller renew, ack, bury, deliver or fire the job; the rest of the entry is not read."""
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
