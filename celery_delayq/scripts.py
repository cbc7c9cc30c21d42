"""The Lua scripts in ``lua/``, loaded by listing the folder, called by SHA.

Each script is registered once per process (its SHA-1 computed locally) and
called with ``EVALSHA``; when the server answers ``NOSCRIPT`` (a restart, a
failover, ``SCRIPT FLUSH``) the script is loaded again and the call repeated.
A script that answered NOSCRIPT did not run, so repeating it is safe.

Pipelines send every ``EVALSHA`` in one round trip and repeat only the calls
that came back NOSCRIPT (redis-py's own pipeline would ask ``SCRIPT EXISTS``
before every execute, one more round trip each time).

>>> " ".join(sorted(SCRIPTS))
'ack bury cancel claim deliver enqueue fire get reschedule sched_del sched_put'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["SCRIPTS", "LuaScript", "ScriptCall", "run_pipelined"]


@dataclass(frozen=True)
class LuaScript:
    """One script: its name, source and SHA-1."""

    name: str
    source: str
    sha: str

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on ``client`` (a Redis or RedisCluster), loading it on NOSCRIPT."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


def _load_all() -> dict[str, LuaScript]:
    scripts: dict[str, LuaScript] = {}
    for entry in resources.files(__package__).joinpath("lua").iterdir():
        if entry.name.endswith(".lua"):
            source = entry.read_text(encoding="utf-8")
            name = entry.name[: -len(".lua")]
            scripts[name] = LuaScript(name, source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


#: Every script by name.
SCRIPTS: dict[str, LuaScript] = _load_all()


@dataclass(frozen=True)
class ScriptCall:
    script: LuaScript
    keys: Sequence[str]
    args: Sequence[Any]


def run_pipelined(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run ``calls`` in one pipeline (no MULTI); return their results in order.

    A call answered with NOSCRIPT is repeated after loading its script; any
    other error is raised after the whole pipeline has been read.
    """
    if not calls:
        return []
    results = _send(client, calls)
    missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
    if missing:
        for script in {calls[i].script for i in missing}:
            client.script_load(script.source)
        again = _send(client, [calls[i] for i in missing])
        for i, result in zip(missing, again, strict=True):
            results[i] = result
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def _send(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    with client.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        return list(pipe.execute(raise_on_error=False))
