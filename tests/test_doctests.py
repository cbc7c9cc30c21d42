"""Run the doctests of every ``celery_delayq`` module; each example must really execute and pass."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from types import ModuleType

import pytest

import celery_delayq

#: Examples in the package today: the suite fails if they silently stop being found.
MIN_EXAMPLES = 26

MODULES = sorted(info.name for info in pkgutil.walk_packages(celery_delayq.__path__, "celery_delayq."))
RESULTS: dict[str, doctest.TestResults] = {}
#: Modules that import an extra at their top: their doctests skip where it is not installed
#: (the fast half on a machine without the spark extra).
NEEDS = {"celery_delayq.spark.source": "pyspark"}


def has_extra(name: str) -> bool:
    """Whether the extra ``name`` needs (if any) is importable here."""
    return name not in NEEDS or importlib.util.find_spec(NEEDS[name]) is not None


def run_doctests(module: ModuleType) -> doctest.TestResults:
    """Run (once per session: examples register tasks) every doctest in ``module``."""
    if module.__name__ not in RESULTS:
        finder = doctest.DocTestFinder(exclude_empty=True)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(module, module.__name__):
            runner.run(test)
        RESULTS[module.__name__] = runner.summarize(verbose=False)
    return RESULTS[module.__name__]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(name: str) -> None:
    if not has_extra(name):
        pytest.skip(f"{name} needs {NEEDS[name]} (the spark extra)")
    results = run_doctests(importlib.import_module(name))
    assert results.failed == 0, f"{results.failed} of {results.attempted} doctest examples failed"


def test_doctests_actually_ran() -> None:
    assert {"celery_delayq.store.keys", "celery_delayq.store.envelope", "celery_delayq.producer.task"} <= set(
        MODULES
    )
    total = sum(run_doctests(importlib.import_module(name)).attempted for name in MODULES if has_extra(name))
    assert total >= MIN_EXAMPLES
