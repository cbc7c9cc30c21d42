"""The distributions a user gets from a package index: ``python -m build`` makes both from a
copy of this checkout (the sdist, then the wheel from the unpacked sdist, as a package index's
builders do), in this environment with no download (``--no-isolation``: setuptools, build and
twine come from the ``test`` extra). The wheel carries the licence text and the metadata a
package page shows (Project-URLs, the license expression); the sdist carries what its own tests
read, and a few of those tests run from the unpacked sdist; ``twine check --strict`` passes on
both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.message import Message
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: What a checkout holds that is not the project: never copied, never in a distribution.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "site", "*.egg-info", "__pycache__", "*.py[cod]",
    ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", "celerybeat-schedule*", "*.rdb",
)  # fmt: skip
#: Folders of the sdist that its tests read, each whole.
SDIST_TREES = ("tests", "docs", "examples", "bench")
SDIST_FILES = ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md", "README.md", "mkdocs.yml", ".ci/run")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout, so the build writes nothing (egg-info, build/) into it."""
    src = tmp_path_factory.mktemp("src") / "celery-delayq"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    return src


@pytest.fixture(scope="module")
def dists(source: Path) -> tuple[Path, Path]:
    """(wheel, sdist) as ``python -m build --no-isolation`` makes them."""
    setuptools = version("setuptools")
    assert int(setuptools.split(".")[0]) >= 77, (
        f"setuptools {setuptools} here: the build needs 77 or newer (PEP 639 license metadata); "
        "pip install -e '.[test]' brings it"
    )
    out = source.parent / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)], cwd=source)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def _files_under(root: Path, folder: str) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / folder).rglob("*") if p.is_file()}


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(whl.read(name).decode())


def test_the_wheel_carries_the_licence_and_the_package_pages_metadata(dists: tuple[Path, Path]) -> None:
    wheel, _ = dists
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        licences = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(licences) == 1, names
        assert whl.read(licences[0]) == (ROOT / "LICENSE").read_bytes()
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    meta = _metadata(wheel)
    assert tuple(int(part) for part in meta["Metadata-Version"].split(".")) >= (2, 4)
    assert meta["License-Expression"] == "BSD-3-Clause" == PYPROJECT["license"]
    assert meta.get_all("License-File") == ["LICENSE"]
    urls = dict(line.split(", ", 1) for line in meta.get_all("Project-URL") or [])
    assert urls == PYPROJECT["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Source", "Changelog", "Issues"}
    classifiers = meta.get_all("Classifier") or []
    assert "Development Status :: 4 - Beta" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], "PEP 639: the expression says it"
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert "](docs/" not in (meta.get_payload() or ""), "the page shows the README with absolute links"
    # Only the two packages, with their data files: no tests or docs installed into site-packages.
    assert {n.split("/", 1)[0] for n in names if not n.startswith("celery_delayq-")} == {
        "celery_delayq",
        "pyspark_delayq",
    }
    package = ROOT / "celery_delayq"
    data = {f"celery_delayq/{p}" for p in ("py.typed",)}
    for folder in ("store/lua", "web/templates", "web/static"):
        data |= {f"celery_delayq/{f}" for f in _files_under(package, folder)}
    assert data <= set(names), data - set(names)
    # Every module, sub-packages included (celery_delayq/spark/...): packages.find's pattern takes them.
    modules = {f"celery_delayq/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    assert "celery_delayq/spark/__init__.py" in modules
    assert modules <= set(names), sorted(modules - set(names))


def test_the_sdist_holds_what_its_tests_read(dists: tuple[Path, Path], source: Path) -> None:
    _, sdist = dists
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
        tar.extractall(sdist.parent, filter="data")
    for name in SDIST_FILES:
        assert name in names, name
    for folder in SDIST_TREES:
        missing = _files_under(source, folder) - names
        assert not missing, f"{folder}/ files not in the sdist: {sorted(missing)[:10]}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    # Tests that read the docs, the site config, the README, .ci/run and pyproject, run from the
    # unpacked sdist with its own code first on the path.
    unpacked = sdist.parent / top
    env = dict(os.environ, PYTHONPATH=str(unpacked))
    tests = [
        "tests/test_readme.py::test_ci_runs_the_readme_test_command",
        "tests/test_readme.py::test_the_readme_links_are_absolute_and_point_at_files_of_the_repository",
        "tests/test_readme.py::test_the_docs_site_and_pyproject_name_the_same_addresses",
        "tests/test_docs.py::test_the_docs_site_builds_strict",
        "tests/test_docs.py::test_the_module_map_names_every_module_once",
    ]
    probe = "import celery_delayq, tests; print(celery_delayq.__file__, tests.__file__)"
    assert _run([sys.executable, "-c", probe], cwd=unpacked, env=env).split() == [
        str(unpacked / "celery_delayq" / "__init__.py"),
        str(unpacked / "tests" / "__init__.py"),
    ]
    ran = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=unpacked, env=env
    )
    assert f"{len(tests)} passed" in ran, ran


def test_twine_check_passes_on_both(dists: tuple[Path, Path]) -> None:
    wheel, sdist = dists
    out = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], cwd=wheel.parent)
    assert out.count("PASSED") == 2, out
