"""The layers of the package: only the store talks to Redis, no module imports itself through
others, and no test module imports another.

An AST walk over every module of ``celery_delayq`` (imports inside functions included) fails
when a module other than the store (``store``, ``connection``) and the script loader
(``scripts``) imports ``redis``, imports the script table (``SCRIPTS``, ``ScriptCall``,
``run_pipelined``, ``run_replicated``, or the ``scripts`` module itself), reads the ``.client``
of a store, or takes a raw client as a parameter named ``client``. Everything above the store
goes through :class:`celery_delayq.store.Store`'s methods.

The same walk builds the package's import graph and fails on any cycle in it, lazy imports
included, and on an import across the rule of a sub-package (:data:`SUBPACKAGES`: what each may
import, and who may import it); a walk over ``tests`` fails when a test module imports another
test module (shared helpers and fixtures belong in ``tests/support``).
"""

from __future__ import annotations

import ast
import pkgutil
from dataclasses import dataclass
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


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``from <module> import ...`` names, a relative one
    resolved against ``package`` (the package of the importing module)."""
    name = node.module or ""
    if not node.level:
        return name
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, name] if name else base)


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
            name = imported_from(node, package)
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


BAD_EXAMPLE = """import redis.cluster
from .scripts import LuaScript, SCRIPTS
from . import scripts

def count(store):
    from redis import Redis
    return store.client.zcard("due")

def flush(client, key):
    client.delete(key)
"""

GOOD_EXAMPLE = """from celery.backends.redis import RedisBackend
from .scripts import LuaScript
from .store import Store

def count(store: Store) -> int:
    return store.count()
"""


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


# -- no import cycles -------------------------------------------------------------------------


def module_name(key: str) -> str:
    """``celery_delayq.cli.__init__`` -> ``celery_delayq.cli``; other names unchanged."""
    return key.removesuffix(".__init__")


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Which modules of ``sources`` each one imports (imports inside functions included).

    ``sources`` maps a module (a package's own module named ``<package>.__init__``, as in
    :data:`MODULES`) to its text. ``from . import x`` and ``from pkg import x`` lead to the
    submodule ``pkg.x`` when there is one, else to ``pkg``; imports of modules outside
    ``sources`` are left out."""
    known = {module_name(key) for key in sources}
    graph: dict[str, set[str]] = {module_name(key): set() for key in sources}
    for key, source in sources.items():
        module = module_name(key)
        package = key.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                name = imported_from(node, package)
                for alias in node.names:
                    submodule = f"{name}.{alias.name}"
                    targets.add(submodule if submodule in known else name)
        graph[module] = {target for target in targets if target in known and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles() -> None:
    """No two modules of ``celery_delayq`` import each other, directly or through others, not
    even from inside a function (a lazy import that dodges a cycle is still a cycle)."""
    graph = import_graph({key: path.read_text() for key, path in MODULES.items()})
    assert len(graph) == len(MODULES)
    found = cycles(graph)
    edges = [sorted(f"{a} -> {b}" for a in sorted(c) for b in sorted(graph[a] & c)) for c in found]
    assert not found, f"import cycles: {edges}"


CYCLE_EXAMPLE = {
    "pkg.__init__": "from .a import thing\n",
    "pkg.a": "from . import b\nthing = 1\n",
    "pkg.b": "def later():\n    from .c import other\n    return other\n",
    "pkg.c": "import os\nimport pkg.a\nother = 2\n",
    "pkg.d": "from pkg import a, b\nfrom .sub import leaf\n",
    "pkg.sub.__init__": "from ..d import nothing\n",
    "pkg.sub.leaf": "from .. import d\n",
}


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself: a lazy import closes a cycle a -> b -> c -> a; ``from . import b``
    leads to the submodule ``pkg.b``, not to the package (else ``pkg`` <-> ``pkg.a`` would be
    a cycle too); ``pkg.sub.leaf`` -> ``pkg.d`` -> ``pkg.sub.leaf`` is the other cycle."""
    graph = import_graph(CYCLE_EXAMPLE)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.a", "pkg.b", "pkg.sub.leaf"},
        "pkg.sub": {"pkg.d"},
        "pkg.sub.leaf": {"pkg.d"},
    }
    assert sorted(map(sorted, cycles(graph))) == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.d", "pkg.sub.leaf"],
    ]
    del graph["pkg.c"]
    graph["pkg.b"] = set()
    graph["pkg.sub.leaf"] = set()
    assert cycles(graph) == []


# -- sub-packages: who may import whom ----------------------------------------------------------


@dataclass(frozen=True)
class SubPackage:
    """The import rule of one sub-package (as its docstring states it): the modules of the rest
    of the package it may import (a name covers a package and everything under it), and the
    modules outside it that may import it."""

    may_import: frozenset[str]
    imported_by: frozenset[str] = frozenset()


SUBPACKAGES = {
    #: Spark: rows in through the store's enqueue, the schedule out through its reads. Nothing
    #: else in the package needs it (``pyspark_delayq``, outside the package, loads its source).
    "celery_delayq.spark": SubPackage(
        may_import=frozenset(
            f"celery_delayq.{name}"
            for name in ("build", "config", "due", "envelope", "exceptions", "gate", "store")
        ),
    ),
}


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def subpackage_violations(graph: dict[str, set[str]], package: str, rule: SubPackage) -> list[str]:
    """Each import in ``graph`` (from :func:`import_graph`) that breaks ``package``'s ``rule``,
    as ``"a imports b"``."""
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if inside(module, package) and not inside(target, package):
                if not any(inside(target, allowed) for allowed in rule.may_import):
                    found.append(f"{module} imports {target}")
            elif inside(target, package) and not inside(module, package) and module not in rule.imported_by:
                found.append(f"{module} imports {target}")
    return found


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_each_subpackage_keeps_its_import_rule(package: str) -> None:
    rule = SUBPACKAGES[package]
    known = {module_name(key) for key in MODULES}
    assert package in known and rule.may_import <= known and rule.imported_by <= known
    graph = import_graph({key: path.read_text() for key, path in MODULES.items()})
    found = subpackage_violations(graph, package, rule)
    assert not found, f"{package}: imports its docstring does not allow: {found}"


SUBPACKAGE_EXAMPLE = {
    "pkg.__init__": "",
    "pkg.store": "",
    "pkg.dispatch": "from .spark.writer import JobWriter\n",
    "pkg.cli": "def later():\n    import pkg.spark\n",
    "pkg.web": "from pkg import spark\n",
    "pkg.spark.__init__": "from .writer import JobWriter\nfrom . import reader\n",
    "pkg.spark.writer": "from ..store import Store\nfrom .. import dispatch\n",
    "pkg.spark.reader": "def rows():\n    from pkg.web import page\n    from ..store import Store\n",
}


def test_the_subpackage_check_finds_each_import_out_of_bounds() -> None:
    """The check itself: imports into ``pkg.spark`` from outside it (one lazy), and out of it to
    a module its rule does not name, are found; the allowed ones (the store, within the package,
    from ``pkg.cli`` once the rule names it) are not."""
    graph = import_graph(SUBPACKAGE_EXAMPLE)
    rule = SubPackage(may_import=frozenset({"pkg.store"}))
    assert subpackage_violations(graph, "pkg.spark", rule) == [
        "pkg.cli imports pkg.spark",
        "pkg.dispatch imports pkg.spark.writer",
        "pkg.spark.reader imports pkg.web",
        "pkg.spark.writer imports pkg.dispatch",
        "pkg.web imports pkg.spark",
    ]
    allowing = SubPackage(
        may_import=frozenset({"pkg.store", "pkg.dispatch", "pkg.web"}),
        imported_by=frozenset({"pkg.cli", "pkg.web"}),
    )
    assert subpackage_violations(graph, "pkg.spark", allowing) == ["pkg.dispatch imports pkg.spark.writer"]


# -- test modules import helpers from tests/support, never from each other -----------------------

TESTS = Path(__file__).resolve().parent

#: Test modules that import another test module on purpose, with why: ``test_cluster.py`` runs
#: the store and API tests of these two modules again, unchanged, with its own fixtures pointed
#: at a Redis Cluster (it takes their test functions, not helpers).
REUSED_TESTS = {("tests.test_cluster", "tests.test_api"), ("tests.test_cluster", "tests.test_scripts")}


def imported_test_modules(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, test module)`` for each import of a test module (``tests.test_*``) in ``source``,
    the text of ``module`` (``tests.x`` or ``tests.support.x``)."""
    package = module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = imported_from(node, package)
            names = [name, *(f"{name}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            if len(parts) >= 2 and parts[0] == "tests" and parts[1].startswith("test_"):
                found.append((node.lineno, ".".join(parts[:2])))
    return sorted(set(found))


def test_no_test_module_imports_another() -> None:
    """Shared helpers and fixtures live in ``tests/support``; a test module importing another
    would run (and collect) the other's module code and tie the two together."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))
        for line, imported in imported_test_modules(path.read_text(), module):
            if (module, imported) not in REUSED_TESTS:
                found.append(f"{path.relative_to(TESTS.parent)}:{line}: imports {imported}")
    assert not found, "\n".join(found)


IMPORTING_EXAMPLE = """from tests.test_e2e import Producer
import tests.test_dispatch
from tests import test_api, support
from . import test_scripts
from .test_model import thing
from tests.support.stack import start_stack
import tests.support.apps

def later():
    from tests.test_cli import bury
"""


def test_the_check_finds_each_test_module_import() -> None:
    assert imported_test_modules(IMPORTING_EXAMPLE, "tests.test_example") == [
        (1, "tests.test_e2e"),
        (2, "tests.test_dispatch"),
        (3, "tests.test_api"),
        (4, "tests.test_scripts"),
        (5, "tests.test_model"),
        (10, "tests.test_cli"),
    ]
