"""The Lua scripts in ``lua/``, loaded by listing the folder, called by SHA.

Each script is registered once per process (its SHA-1 computed locally) and
called with ``EVALSHA``; when the server answers ``NOSCRIPT`` (a restart, a
failover, ``SCRIPT FLUSH``) the script is loaded again and the call repeated.
A script that answered NOSCRIPT did not run, so repeating it is safe.

Every script is sent with :data:`PRELUDE` in front of it, on the same line as the script's
opening comment (so the line numbers in a script's errors are those of its file): the limit
:data:`LUA_UNPACK_MAX`, as the Lua local ``UNPACK_MAX``.

Shared helpers live in ``lua/includes/<name>.lua`` (as bullmq's ``includes/``), one concept a
file: ``lease`` (the lease entry's format and the holder check), ``job`` (removing a job),
``wake`` (the wake marker and the wake message), ``args`` (``int_arg``), ``sliced``
(``call_sliced``: one command over more values than one ``unpack`` takes), ``claiming`` (taking
a shard's due jobs and leasing them to a beat: claim and push) and ``gate`` (flow control's keys,
the limit in force, promotion, batch completion). A script names each helper file it uses on a
line of its own, after its header comment::

    --!include lease

and the loader replaces that line with the file's code joined onto that one line, its
comment lines dropped, so every other line of the script keeps its number (an error in a
helper reports the ``--!include`` line). Being a Lua comment, the line leaves the file
valid Lua as it is. An include file is a list of ``local`` definitions documented by ``--``
comment lines; a code line in it holds no comment and no long bracket (the loader refuses
them, as it refuses an unknown or repeated include). Includes include nothing themselves: a
script names all it uses, in order. The formats the helpers define (the lease entry, the
wake message) have one Python mirror, :mod:`celery_delayq.leases`.

A script whose file opens with ``#!lua flags=allow-oom`` frees memory (claim, ack, cancel,
bury, fire; not push_claimed: see ``lua/push_claimed.lua``): Redis 7+ and Valkey run it when Redis is
over ``maxmemory``, so a full store drains. Redis 6.2 has no script flags (the line is a Lua
syntax error there): a script is sent there without it (:attr:`LuaScript.legacy_source`),
and each such script's first write is a command that Redis never refuses for memory
(``HDEL``, ``ZREM``): Redis 6.2 (and 7 for a script without flags) refuses only a
script's *first* write when it was over ``maxmemory`` at the script's start, and lets a
script that has written go on. Which form a server takes is learnt once per client: the
flagged one is tried first and a server that cannot compile it gets the other from then on.

Pipelines send every ``EVALSHA`` in one round trip and repeat only the calls
that came back NOSCRIPT (redis-py's own pipeline would ask ``SCRIPT EXISTS``
before every execute, one more round trip each time). On a Redis Cluster
(``redis.cluster.RedisCluster``) each call goes to the primary of its first
key's slot (every key of a call shares one hash tag), all nodes in one round
trip, and ``SCRIPT LOAD`` loads a script on every primary.

>>> " ".join(sorted(SCRIPTS))  # doctest: +NORMALIZE_WHITESPACE
'ack batch_cancel batch_delete batch_grow batch_open batch_seal bury cancel claim due_counts enqueue fire
gate gate_admin get hold keyed overlap push push_claimed release renew requeue reschedule sched_del
sched_put shapes_sweep
slot_renew start stats'
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ConnectionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

__all__ = [
    "ALLOW_OOM",
    "INCLUDES",
    "LUA_UNPACK_MAX",
    "PRELUDE",
    "SCRIPTS",
    "WAIT_TIMEOUT_MS",
    "LuaScript",
    "ScriptCall",
    "expand",
    "run_pipelined",
    "run_replicated",
    "script_from_text",
]

logger = logging.getLogger(__name__)

#: How long (ms) a write made with ``delayq_wait_replicas`` waits for its replicas (``WAIT``).
WAIT_TIMEOUT_MS = 1000


#: Most values a script passes to one Lua ``unpack`` (one ``redis.call``). Lua's C stack in Redis
#: and Valkey (``LUAI_MAXCSTACK``, 8000 slots) fails an ``unpack`` of about 8000 values with
#: ``too many results to unpack``; a longer table goes in slices of this size (``call_sliced``).
LUA_UNPACK_MAX = 1000

#: Lua put in front of every script, on its first line (see the module's docstring): the
#: limit that ``call_sliced`` (``lua/includes/sliced.lua``) slices by.
PRELUDE = f"local UNPACK_MAX = {LUA_UNPACK_MAX} "

#: A line of a script that names a helper file of ``lua/includes/`` (see the module's docstring).
_INCLUDE = re.compile(r"--!include ([a-z_]+)[ \t]*")


def _flatten(name: str, text: str) -> str:
    """An include file's code on one line: its comment and blank lines dropped."""
    code: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("--"):
            continue
        if "--" in line or "[[" in line or "[=" in line:
            raise ValueError(f"lua/includes/{name}.lua: a comment or long bracket in code: {line!r}")
        code.append(line)
    return " ".join(code) + " "


def _read_includes() -> dict[str, str]:
    includes: dict[str, str] = {}
    for entry in resources.files(__package__).joinpath("lua", "includes").iterdir():
        if entry.name.endswith(".lua"):
            name = entry.name[: -len(".lua")]
            includes[name] = _flatten(name, entry.read_text(encoding="utf-8"))
    return includes


#: Every helper file of ``lua/includes/`` by name: its code, flattened onto one line.
INCLUDES: dict[str, str] = _read_includes()


def expand(text: str) -> tuple[str, tuple[str, ...]]:
    """``text`` with each ``--!include name`` line replaced by that include's code on that
    line; and the names included, in order. An unknown or repeated name is refused."""
    lines = text.split("\n")
    names: list[str] = []
    for number, line in enumerate(lines):
        found = _INCLUDE.fullmatch(line)
        if found is None:
            if line.lstrip().startswith("--!include"):
                raise ValueError(f"line {number + 1}: a malformed include: {line!r}")
            continue
        name = found.group(1)
        if name not in INCLUDES:
            raise ValueError(f"line {number + 1}: no lua/includes/{name}.lua")
        if name in names:
            raise ValueError(f"line {number + 1}: {name} is included twice")
        names.append(name)
        lines[number] = INCLUDES[name]
    return "\n".join(lines), tuple(names)


#: The first line of a script that frees memory (see the module's docstring).
ALLOW_OOM = "#!lua flags=allow-oom"

#: Clients (Redis, RedisCluster) whose server cannot compile script flags (Redis 6.2).
_NO_FLAGS: weakref.WeakSet[Any] = weakref.WeakSet()


def _no_flags(exc: ResponseError) -> bool:
    """Is this the answer of a server without script flags to a script that declares some?"""
    text = str(exc)
    return "Error compiling script" in text or "Unknown lua shebang" in text


@dataclass(frozen=True)
class LuaScript:
    """One script: its name, source and SHA-1.

    ``source``/``sha`` are what Redis 7+ and Valkey run; for a script with flags,
    ``legacy_source``/``legacy_sha`` are the same script without its flags line (Redis 6.2).
    A script without flags has one form: the legacy fields equal the others. ``includes``
    names the helper files it includes (see the module's docstring)."""

    name: str
    source: str
    sha: str
    legacy_source: str = ""
    legacy_sha: str = ""
    includes: tuple[str, ...] = ()  # the helper files of lua/includes/ it names, in order

    @property
    def flagged(self) -> bool:
        return self.sha != self.legacy_sha and bool(self.legacy_sha)

    def sha_for(self, client: Any) -> str:
        """The SHA of the form ``client``'s server runs."""
        return self.legacy_sha if self.flagged and client in _NO_FLAGS else self.sha

    def load(self, client: Any) -> None:
        """``SCRIPT LOAD`` the form ``client``'s server runs; a server that cannot compile
        the flags line is remembered (per client) and given the legacy form."""
        if self.flagged and client not in _NO_FLAGS:
            try:
                client.script_load(self.source)
                return
            except ResponseError as exc:
                if not _no_flags(exc):
                    raise
                _NO_FLAGS.add(client)
                logger.info(
                    "delayq: the Redis server has no script flags (6.2): the scripts that "
                    "free memory run in their legacy form"
                )
        client.script_load(self.legacy_source or self.source)

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on ``client`` (a Redis or RedisCluster), loading it on NOSCRIPT."""
        try:
            return client.evalsha(self.sha_for(client), len(keys), *keys, *args)
        except NoScriptError:
            self.load(client)
            return client.evalsha(self.sha_for(client), len(keys), *keys, *args)


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def script_from_text(name: str, text: str) -> LuaScript:
    """The script ``name`` from its file's text: includes expanded, :data:`PRELUDE` in front,
    and for a script with flags (``#!lua flags=...`` as its first line) the legacy form."""
    text, names = expand(text)
    if text.startswith("#!"):
        # The flags line stays line 1 (Redis needs it first); the legacy form has an
        # empty line 1, so line numbers in errors are the file's in both forms.
        shebang, _, body = text.partition("\n")
        source, legacy = shebang + "\n" + PRELUDE + body, "\n" + PRELUDE + body
    else:
        source = legacy = PRELUDE + text
    return LuaScript(name, source, _sha(source), legacy, _sha(legacy), names)


def _load_all() -> dict[str, LuaScript]:
    scripts: dict[str, LuaScript] = {}
    for entry in resources.files(__package__).joinpath("lua").iterdir():
        if entry.name.endswith(".lua"):
            name = entry.name[: -len(".lua")]
            scripts[name] = script_from_text(name, entry.read_text(encoding="utf-8"))
    return scripts


#: Every script by name.
SCRIPTS: dict[str, LuaScript] = _load_all()


@dataclass(frozen=True)
class ScriptCall:
    script: LuaScript
    keys: Sequence[str]
    args: Sequence[Any]


def run_pipelined(client: Any, calls: Sequence[ScriptCall], raise_errors: bool = True) -> list[Any]:
    """Run ``calls`` in one pipeline (no MULTI); return their results in order.

    A call answered with NOSCRIPT is repeated after loading its script; any
    other error is raised after the whole pipeline has been read. With
    ``raise_errors=False`` the errors are returned in place of their results
    instead, and on a cluster a node that cannot be reached (a primary failing
    over) fails only its own calls: the other nodes' calls still run.
    """
    if not calls:
        return []
    results = _send(client, calls, raise_errors)
    missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
    if missing:
        for script in {calls[i].script for i in missing}:
            script.load(client)
        again = _send(client, [calls[i] for i in missing], raise_errors)
        for i, result in zip(missing, again, strict=True):
            results[i] = result
    if raise_errors:
        for result in results:
            if isinstance(result, Exception):
                raise result
    return results


def _send_by_node(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    """:func:`_send` node by node: a node's error is the result of each of its calls."""
    groups: dict[str, list[int]] = defaultdict(list)
    results: list[Any] = [None] * len(calls)
    for i, call in enumerate(calls):
        try:
            groups[client.get_node_from_key(call.keys[0]).name].append(i)
        except RedisClusterException as exc:  # a slot no node serves
            results[i] = exc
    for positions in groups.values():
        try:
            replies = _pipeline(client, [calls[i] for i in positions])
        except (RedisError, RedisClusterException) as exc:
            replies = [exc] * len(positions)
        for i, reply in zip(positions, replies, strict=True):
            results[i] = reply
    return results


def _send(client: Any, calls: Sequence[ScriptCall], raise_errors: bool = True) -> list[Any]:
    """One pipeline of ``calls``; the replies, errors in place. A pipeline that fails as a
    whole raises, unless ``raise_errors`` is off on a cluster: then it is sent again node by
    node, and only the unreachable node's calls get the error."""
    try:
        return _pipeline(client, calls)
    except (RedisError, RedisClusterException):
        if raise_errors or not isinstance(client, RedisCluster):
            raise
        return _send_by_node(client, calls)


def _pipeline(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    cluster = isinstance(client, RedisCluster)
    with client.pipeline(transaction=False) as pipe:
        for call in calls:
            sha = call.script.sha_for(client)
            if cluster:
                # The node of the call's slot, named here: left to itself, redis-py's cluster
                # pipeline asks the server (COMMAND GETKEYS) where each EVALSHA goes, one more
                # round trip a call. A redirected call (MOVED, a failover) is re-routed by slot.
                node = client.get_node_from_key(call.keys[0])
                pipe.execute_command(
                    "EVALSHA", sha, len(call.keys), *call.keys, *call.args, target_nodes=node
                )
            else:
                pipe.execute_command("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
        return list(pipe.execute(raise_on_error=False))


#: Replies of a call that may not have run on the node it was sent to (repeated, unconfirmed).
_REROUTE = (AskError, TryAgainError, ConnectionError, TimeoutError)


def run_replicated(
    client: Any, calls: Sequence[ScriptCall], replicas: int, raise_errors: bool = True
) -> list[Any]:
    """As :func:`run_pipelined`, then ``WAIT replicas WAIT_TIMEOUT_MS`` on each connection that
    carried calls: it returns once that many replicas have every write (or the time is up).

    ``WAIT`` covers the writes of its own connection, so on a cluster the calls are grouped by
    node, each group and its ``WAIT`` in one pipeline on that node. Fewer replicas than asked
    (a slow or missing replica, a redirected call) is logged as a warning: the writes are
    stored on the primary, but a failover before they are replicated could lose them.
    With ``raise_errors=False`` a call's error is returned in place of its result.
    """
    if not calls:
        return []
    targets: list[tuple[Any, list[int]]] = [(client, list(range(len(calls))))]
    if isinstance(client, RedisCluster):
        cluster: Any = client
        groups: dict[str, list[int]] = defaultdict(list)
        nodes: dict[str, Any] = {}
        for i, call in enumerate(calls):
            node = cluster.get_node_from_key(call.keys[0])
            groups[node.name].append(i)
            nodes[node.name] = node
        targets = [(cluster.get_redis_connection(nodes[name]), idx) for name, idx in groups.items()]
    results: list[Any] = [None] * len(calls)
    confirmed = replicas
    for target, positions in targets:
        try:
            with target.pipeline(transaction=False) as pipe:
                for i in positions:
                    call = calls[i]
                    sha = call.script.sha_for(client)  # the form is learnt per client, not per node
                    pipe.execute_command("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
                pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
                replies = list(pipe.execute(raise_on_error=False))
        except (RedisError, RedisClusterException) as exc:
            replies = [exc] * (len(positions) + 1)
        for i, reply in zip(positions, replies, strict=False):
            results[i] = reply
        waited = replies[-1]
        confirmed = min(confirmed, waited if isinstance(waited, int) else 0)
    # Calls the node did not take (moved slot, lost connection): through the cluster client's
    # own routing and retries, unconfirmed. NOSCRIPT: loaded everywhere, repeated with WAIT.
    again = [i for i, r in enumerate(results) if isinstance(r, _REROUTE)]
    if again and isinstance(client, RedisCluster):
        confirmed = 0
        client.nodes_manager.initialize()
        for i, result in zip(again, _pipeline(client, [calls[i] for i in again]), strict=True):
            results[i] = result
    missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
    if missing:
        for script in {calls[i].script for i in missing}:
            script.load(client)
        repeated = run_replicated(client, [calls[i] for i in missing], replicas, raise_errors)
        for i, result in zip(missing, repeated, strict=True):
            results[i] = result
    if confirmed < replicas:
        logger.warning(
            "delayq: %d write(s) reached %d of the %d replica(s) asked (delayq_wait_replicas) "
            "within %d ms; they are stored on the primary but a failover now could lose them",
            len(calls),
            confirmed,
            replicas,
            WAIT_TIMEOUT_MS,
        )
    if raise_errors:
        for result in results:
            if isinstance(result, Exception):
                raise result
    return results
