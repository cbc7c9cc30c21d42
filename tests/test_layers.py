"""The layers of the package: only the store talks to Redis.

An AST walk over every module of ``celery_delayq`` (imports inside functions included) fails
when a module other than the store (``store``, ``connection``) and the script loader
(``scripts``) imports ``redis``, imports the script table (``SCRIPTS``, ``ScriptCall``,
``run_pipelined``, ``run_replicated``, or the ``scripts`` module itself), reads the ``.client``
of a store, or takes a raw client as a parameter named ``client``. Everything above the store
goes through :class:`celery_delayq.store.Store`'s methods.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

import celery_delayq

#: The modules that may talk to Redis.
STORE_LAYER = {"celery_delayq.store", "celery_delayq.connection", "celery_delayq.scripts"}

#: Dev and demo tools (``celery_delayq.devtools``): the demo starts its own Redis and watches
#: it with a client of its own (the runs recorded by its tasks). They are not on the runtime
#: import path: no runtime module imports them (``tests/test_cli.py``,
#: ``test_the_runtime_needs_neither_the_extras_nor_the_cli_nor_the_dev_tools``).
DEVTOOLS = "celery_delayq.devtools."


#: What only the store layer may import from ``celery_delayq.scripts``.
SCRIPT_TABLE = {"SCRIPTS", "ScriptCall", "run_pipelined", "run_replicated"}


def violations(source: str, module: str) -> list[str]:
    """Each way ``source`` (the text of ``module``) reaches Redis other than through the store,
    as ``"line N: what"``."""
    package = module.rsplit(".", 1)[0]  # a package's own module is named "<package>.__init__"
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "redis" or alias.name.startswith("redis."):
                    found.append(f"line {node.lineno}: import {alias.name}")
                if alias.name == "celery_delayq.scripts":
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, name] if name else base)
            if name == "redis" or name.startswith("redis."):
                found.append(f"line {node.lineno}: from {name} import ...")
            elif name == "celery_delayq.scripts":
                bad = sorted(a.name for a in node.names if a.name in SCRIPT_TABLE or a.name == "*")
                if bad:
                    found.append(f"line {node.lineno}: from {name} import {', '.join(bad)}")
            elif name == "celery_delayq" and any(a.name == "scripts" for a in node.names):
                found.append(f"line {node.lineno}: from {name} import scripts")
        elif isinstance(node, ast.Attribute) and node.attr == "client":
            found.append(f"line {node.lineno}: .client")
        elif isinstance(node, ast.arg) and node.arg == "client":
            found.append(f"line {node.lineno}: a raw client parameter")
    return found


def package_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {"celery_delayq.__init__": Path(celery_delayq.__file__)}
    for info in pkgutil.walk_packages(celery_delayq.__path__, "celery_delayq."):
        spec = info.module_finder.find_spec(info.name, None)
        assert spec is not None and spec.origin is not None, info.name
        path = Path(spec.origin)
        key = info.name + ".__init__" if info.ispkg else info.name
        modules[key] = path
    return modules


MODULES = package_modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_store_talks_to_redis(module: str) -> None:
    found = violations(MODULES[module].read_text(), module)
    if module in STORE_LAYER or module.startswith(DEVTOOLS):
        return
    assert not found, f"{module} reaches Redis outside the store: {found}"


def test_the_allow_lists_name_real_modules() -> None:
    assert set(MODULES) >= STORE_LAYER
    assert any(name.startswith(DEVTOOLS) for name in MODULES)


BAD_EXAMPLE = '''import redis.cluster
from .scripts import LuaScript, SCRIPTS
from . import scripts

def count(store):
    from redis import Redis
    return store.client.zcard("due")

def flush(client, key):
    client.delete(key)
'''

GOOD_EXAMPLE = '''from celery.backends.redis import RedisBackend
from .scripts import LuaScript
from .store import Store

def count(store: Store) -> int:
    return store.count()
'''


def test_the_check_finds_each_way_in() -> None:
    """The check itself: an example module that reaches Redis in every way it looks for."""
    found = violations(BAD_EXAMPLE, "celery_delayq.example")
    assert set(found) == {
        "line 1: import redis.cluster",
        "line 2: from celery_delayq.scripts import SCRIPTS",
        "line 3: from celery_delayq import scripts",
        "line 6: from redis import ...",
        "line 7: .client",
        "line 9: a raw client parameter",
    }
    assert violations(GOOD_EXAMPLE, "celery_delayq.example") == []
