"""The layers of the package: only the store talks to Redis, no module imports itself through
others, and no test module imports another.

An AST walk over every module of ``celery_delayq`` (imports inside functions included) fails
when a module other than the store layer (``store.facade`` and the store's parts it is made of,
``store.connection``) and the
script loader (``store.scripts``) imports ``redis``, imports the script table (``SCRIPTS``, ``ScriptCall``,
``run_pipelined``, ``run_replicated``, or the ``scripts`` module itself), reads the ``.client``
of a store, or takes a raw client as a parameter named ``client``. Everything above the store
goes through :class:`celery_delayq.store.facade.Store`'s methods.

The same walk builds the package's import graph and fails on any cycle in it, lazy imports
included, and on an import across the rule of a sub-package (:data:`SUBPACKAGES`: what each may
import, and who may import it); a walk over ``tests`` fails when a test module imports another
test module (shared helpers and fixtures belong in ``tests/support``).
"""

from __future__ import annotations

import ast
import functools
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import celery_delayq

#: The modules that may talk to Redis.
STORE_LAYER = {
    f"celery_delayq.store.{name}"
    for name in (
        "facade",
        "base",
        "jobs",
        "delivery",
        "reads",
        "dead",
        "schedules",
        "flow",
        "batches",
        "beats",
        "streams",
        "connection",
        "scripts",
        "direct",
    )
} | {
    # StoreUnreachable is also redis-py's ConnectionError (docs/errors.md): it imports that class
    # for its base, and nothing else of redis.
    "celery_delayq.exceptions"
}

#: Dev and demo tools (``celery_delayq.devtools``): the demo starts its own Redis and watches
#: it with a client of its own (the runs recorded by its tasks). They are not on the runtime
#: import path: no runtime module imports them (``tests/test_cli.py``,
#: ``test_the_runtime_needs_neither_the_extras_nor_the_cli_nor_the_dev_tools``).
DEVTOOLS = "celery_delayq.devtools."


#: What only the store layer may import from ``celery_delayq.store.scripts``.
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
                if alias.name == "celery_delayq.store.scripts":
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            name = imported_from(node, package)
            if name == "redis" or name.startswith("redis."):
                found.append(f"line {node.lineno}: from {name} import ...")
            elif name == "celery_delayq.store.scripts":
                bad = sorted(a.name for a in node.names if a.name in SCRIPT_TABLE or a.name == "*")
                if bad:
                    found.append(f"line {node.lineno}: from {name} import {', '.join(bad)}")
            elif name == "celery_delayq.store" and any(a.name == "scripts" for a in node.names):
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
from .store.scripts import LuaScript, SCRIPTS
from .store import scripts

def count(store):
    from redis import Redis
    return store.client.zcard("due")

def flush(client, key):
    client.delete(key)
"""

GOOD_EXAMPLE = """from celery.backends.redis import RedisBackend
from .store.scripts import LuaScript
from .store import Store

def count(store: Store) -> int:
    return store.count()
"""


def test_the_check_finds_each_way_in() -> None:
    """The check itself: an example module that reaches Redis in every way it looks for."""
    found = violations(BAD_EXAMPLE, "celery_delayq.example")
    assert set(found) == {
        "line 1: import redis.cluster",
        "line 2: from celery_delayq.store.scripts import SCRIPTS",
        "line 3: from celery_delayq.store import scripts",
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


@functools.cache
def package_graph() -> dict[str, set[str]]:
    """The import graph of the whole package, built once a session."""
    return import_graph({key: path.read_text() for key, path in MODULES.items()})


def test_the_package_has_no_import_cycles() -> None:
    """No two modules of ``celery_delayq`` import each other, directly or through others, not
    even from inside a function (a lazy import that dodges a cycle is still a cycle)."""
    graph = package_graph()
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
    of the package it may import, and the modules outside it that may import it. A dotted name
    covers a package and everything under it; a name without a dot (the package root, e.g.
    ``celery_delayq``) covers that one module only; :data:`ANYONE` lets every module in."""

    may_import: frozenset[str]
    imported_by: frozenset[str] = frozenset()


#: ``imported_by`` of a sub-package every layer above may use (the store, flow control's names).
ANYONE = frozenset({"*"})


def _names(*names: str) -> frozenset[str]:
    return frozenset(name if name in ("*", "celery_delayq") else f"celery_delayq.{name}" for name in names)


#: What every sub-package may import: the root modules beneath everything.
BASE = ("config", "setting_values", "exceptions", "due")

SUBPACKAGES = {
    #: The one door to Redis. Beneath everything but the root modules and the names a gated
    #: job carries (``flow.gate``, which imports nothing of ours but ``exceptions``).
    "celery_delayq.store": SubPackage(may_import=_names(*BASE, "flow.gate"), imported_by=ANYONE),
    #: The caller's side; ``producer.result`` moves or cancels its job through ``admin.jobs``.
    "celery_delayq.producer": SubPackage(
        may_import=_names(*BASE, "store", "flow.gate", "admin.jobs"),
        imported_by=_names("celery_delayq", "flow", "schedules", "spark", "devtools"),
    ),
    #: Flow control: its names (``gate``) are read by every layer; a batch builds envelopes.
    "celery_delayq.flow": SubPackage(may_import=_names(*BASE, "store", "producer"), imported_by=ANYONE),
    #: What runs in a worker; the beat arms the start check it runs.
    "celery_delayq.worker": SubPackage(
        may_import=_names(*BASE, "store"), imported_by=_names("celery_delayq", "beat")
    ),
    "celery_delayq.schedules": SubPackage(
        may_import=_names(*BASE, "store", "producer", "flow.gate"),
        imported_by=_names("celery_delayq", "beat", "admin", "cli", "web"),
    ),
    #: The beat: nothing but the package root (``Scheduler``) imports it.
    "celery_delayq.beat": SubPackage(
        may_import=_names(*BASE, "store", "flow.gate", "schedules", "worker.starts"),
        imported_by=_names("celery_delayq"),
    ),
    #: The operator's side, under the CLI and the dashboard.
    "celery_delayq.admin": SubPackage(
        may_import=_names(*BASE, "store", "flow", "schedules"),
        imported_by=_names("celery_delayq", "producer.result", "cli", "web"),
    ),
    "celery_delayq.cli": SubPackage(
        may_import=_names(*BASE, "store", "flow.gate", "schedules", "admin", "web", "devtools"),
        imported_by=_names("__main__"),
    ),
    "celery_delayq.web": SubPackage(
        may_import=_names(*BASE, "store", "flow.gate", "schedules", "admin"), imported_by=_names("cli")
    ),
    #: Spark: rows in through the store's enqueue, the schedule out through its reads. Nothing
    #: else in the package needs it (``pyspark_delayq``, outside the package, loads its source).
    "celery_delayq.spark": SubPackage(
        may_import=_names(*BASE, "store", "flow.gate", "producer.build", "producer.options")
    ),
    #: Dev tools: only the CLI's demo command reaches them.
    "celery_delayq.devtools": SubPackage(
        may_import=_names("config", "store", "producer"), imported_by=_names("cli.demo")
    ),
}


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def covers(name: str, module: str) -> bool:
    """Whether the rule entry ``name`` covers ``module`` (see :class:`SubPackage`)."""
    return name == "*" or (inside(module, name) if "." in name else module == name)


def subpackage_violations(graph: dict[str, set[str]], package: str, rule: SubPackage) -> list[str]:
    """Each import in ``graph`` (from :func:`import_graph`) that breaks ``package``'s ``rule``,
    as ``"a imports b"``."""
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if inside(module, package) and not inside(target, package):
                if not any(covers(allowed, target) for allowed in rule.may_import):
                    found.append(f"{module} imports {target}")
            elif (
                inside(target, package)
                and not inside(module, package)
                and not any(covers(allowed, module) for allowed in rule.imported_by)
            ):
                found.append(f"{module} imports {target}")
    return found


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_each_subpackage_keeps_its_import_rule(package: str) -> None:
    rule = SUBPACKAGES[package]
    known = {module_name(key) for key in MODULES}
    assert package in known
    assert rule.may_import <= known and rule.imported_by - ANYONE <= known | {"celery_delayq.__main__"}
    graph = package_graph()
    found = subpackage_violations(graph, package, rule)
    assert not found, f"{package}: imports its docstring does not allow: {found}"


def test_the_root_holds_about_a_dozen_entries() -> None:
    """The package shows the data flow: the root keeps the settings (and how their values are read),
    the errors and due times
    (beneath everything), the entry points, and one sub-package per concept."""
    root = Path(celery_delayq.__file__).parent
    entries = {p.name for p in root.iterdir() if p.name != "__pycache__"}
    packages = {name for name in entries if (root / name / "__init__.py").exists()}
    assert packages == {name.rsplit(".", 1)[1] for name in SUBPACKAGES}
    assert entries - packages == {
        "__init__.py",
        "__main__.py",
        "py.typed",
        "config.py",
        "setting_values.py",
        "exceptions.py",
        "due.py",
    }


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_each_rule_fails_on_an_import_it_does_not_allow(package: str) -> None:
    """The check itself, per rule: a module of ``package`` importing a sub-package its rule does
    not name, and (where the rule is not open to anyone) a sub-package it does not name importing
    ``package``, are both found."""
    rule = SUBPACKAGES[package]
    others = sorted(set(SUBPACKAGES) - {package})
    target = next(o for o in others if not any(covers(a, o) or inside(a, o) for a in rule.may_import))
    graph = {f"{package}.x": {f"{target}.y"}, f"{target}.y": set()}
    assert subpackage_violations(graph, package, rule) == [f"{package}.x imports {target}.y"]
    if rule.imported_by != ANYONE:
        importer = next(o for o in others if not any(covers(a, o) or inside(a, o) for a in rule.imported_by))
        graph = {f"{importer}.y": {f"{package}.x"}, f"{package}.x": set()}
        assert subpackage_violations(graph, package, rule) == [f"{importer}.y imports {package}.x"]


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


@pytest.mark.slow
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


def test_the_public_surface_is_what_a_caller_writes_or_catches() -> None:
    """``celery_delayq.__all__`` keeps about fifteen names, each one there; every other error is
    a :class:`DelayQError` importable from ``celery_delayq.exceptions``."""
    import inspect

    from celery_delayq import exceptions

    assert len(celery_delayq.__all__) <= 17  # (16, and install: what a worker of plain tasks calls)
    assert all(hasattr(celery_delayq, name) for name in celery_delayq.__all__)
    errors = [
        c for _, c in inspect.getmembers(exceptions, inspect.isclass) if c.__module__ == exceptions.__name__
    ]
    assert len(errors) > 15
    assert all(issubclass(error, celery_delayq.DelayQError) for error in errors)
