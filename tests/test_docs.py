"""The docs say what the code does: settings defaults match, every python block runs, and the
site builds with ``mkdocs build --strict`` (no broken link or anchor, no page left out of the nav)."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from celery_delayq import DelayQ, Schedules
from celery_delayq.config import DEFAULTS
from tests.support.apps import make_app
from tests.support.polling import wait_for
from tests.support.processes import stop_processes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: Run as a user would, in its own test: proj.py as a file, the shell, a worker and a beat.
QUICKSTART = DOCS / "quickstart.md"


def test_every_setting_has_a_section_with_the_codes_default() -> None:
    text = (DOCS / "settings.md").read_text()
    sections = dict(re.findall(r"^## (delayq_\w+)\nDefault: `(.*?)`$", text, flags=re.M))
    headed = re.findall(r"^## (delayq_\w+)", text, flags=re.M)
    assert sorted(headed) == sorted(DEFAULTS), "one section per setting, no more, no less"
    assert sorted(sections) == sorted(DEFAULTS), "each section starts with its Default: line"
    for name, (default, _) in DEFAULTS.items():
        assert ast.literal_eval(sections[name]) == default, name


@pytest.mark.parametrize(
    "page", [p for p in PAGES if "```python" in p.read_text() and p != QUICKSTART], ids=lambda p: p.name
)
def test_python_blocks_of_the_page_run(page: Path, redis_url: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(blocks):
        code = block.replace("redis://127.0.0.1:6379/0", redis_url)
        assert "6379" not in code, f"{page.name} block {i} would touch the machine's Redis"
        exec(compile(code, f"{page.name}:block{i}", "exec"), namespace)
    app = namespace.get("app")
    if app is not None:
        app.close()


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.e2e
def test_the_quickstart_runs_as_written(tmp_path: Path, redis_url: str) -> None:
    """proj.py as a file, the shell block in a fresh interpreter next to it, then the page's
    own worker and beat commands: the job runs and leaves the store. The store already holds a
    schedule's point, as an app with a schedule does: the page's checks must hold there too (a
    ``count() == 2`` did not)."""
    text = QUICKSTART.read_text()

    def local(code: str) -> str:
        code = code.replace("redis://127.0.0.1:6379/0", redis_url)
        assert "6379" not in code, "the quickstart would touch the machine's Redis"
        return code

    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    proj = [b for b in blocks if b.startswith("# proj.py\n")]
    shell = re.findall(r"```python\n(.*?)```", _section(text, "Schedule a first job"), flags=re.S)
    assert len(proj) == 1 and len(shell) == 1
    (tmp_path / "proj.py").write_text(local(proj[0]))
    for i, block in enumerate(b for b in blocks if b not in proj + shell):  # the Configure examples
        namespace: dict[str, Any] = {"__name__": f"quickstart_{i}"}
        exec(compile(local(block), f"quickstart.md:configure{i}", "exec"), namespace)
        namespace["app"].close()
    other = make_app(redis_url)
    try:
        Schedules(other).add("yearly", "proj.yearly", "0 0 1 1 *", check_task=False)
    finally:
        other.close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ran = subprocess.run(
        [sys.executable, "-c", local(shell[0])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr
    job_id, due = ran.stdout.split()[:2]
    app = make_app(redis_url)
    try:
        assert DelayQ(app).count() == 2  # the job and the schedule's point; the cancelled one is gone
        commands = re.findall(r"```sh\n(.*?)```", _section(text, "Run a worker and a beat"), flags=re.S)
        lines = [line for line in commands[0].splitlines() if line.startswith("celery ")]
        assert [line.split()[3] for line in lines] == ["worker", "beat"]
        procs = []
        for n, line in enumerate(lines):
            log = open(tmp_path / f"{n}.log", "wb")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", *shlex.split(line)]
            procs.append(
                (subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT), log)
            )
        try:
            worker_log = tmp_path / "0.log"
            assert wait_for(
                lambda: "remind 42: your first job" in worker_log.read_text(errors="replace"), 90
            ), worker_log.read_text(errors="replace")[-3000:] + (tmp_path / "1.log").read_text(
                errors="replace"
            )
            assert wait_for(lambda: DelayQ(app).get(job_id) is None, 10)
            assert DelayQ(app).count() == 1  # the schedule's point, due next 1 January
            assert job_id in worker_log.read_text(errors="replace")
            assert due.startswith(str(time.gmtime().tm_year))
        finally:
            stop_processes(proc for proc, _ in procs)
            for _, log in procs:
                log.close()
    finally:
        app.close()


def _nav_pages(nav: Any) -> Iterator[str]:
    """The ``.md`` paths of an mkdocs ``nav`` (strings, ``{title: page}`` and nested sections)."""
    if isinstance(nav, str):
        if nav.endswith(".md"):
            yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from _nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from _nav_pages(value)


def _html_of(page: str) -> PurePosixPath:
    """Where mkdocs (``use_directory_urls``, the default) writes ``page``: ``a.md`` -> ``a/index.html``."""
    path = PurePosixPath(page)
    if path.stem in ("index", "README"):
        return path.parent / "index.html"
    return path.with_suffix("") / "index.html"


@pytest.mark.slow
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = list(_nav_pages(config["nav"]))
    assert "index.md" in pages and "quickstart.md" in pages
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    missing = [page for page in pages if not (site / _html_of(page)).is_file()]
    assert not missing, f"nav pages without a built page: {missing}"


def test_the_module_map_names_every_module_once() -> None:
    """docs/how-it-works.md's module map has one row per root module and sub-package
    (``producer/``), and every module of a sub-package has a row of its own
    (``producer/task``) or is named in its package's row; no row names a module or folder that
    is gone."""
    import pkgutil

    import celery_delayq

    package_dir = Path(celery_delayq.__file__).parent
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text.split("## The module map", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (?:\*\*)?`([\w./]+)`(?:\*\*)? \| (.*) \|$", section, flags=re.M))
    modules = {info.name for info in pkgutil.iter_modules(celery_delayq.__path__) if not info.ispkg}
    packages = {info.name for info in pkgutil.iter_modules(celery_delayq.__path__) if info.ispkg}
    top = {name for name in rows if "/" not in name or (name.endswith("/") and name.count("/") == 1)}
    assert top == modules | {"__init__"} | {f"{name}/" for name in packages}
    for name in rows:
        assert (package_dir / name).exists() or (package_dir / f"{name}.py").exists(), f"{name} is gone"
    for package in sorted(packages):
        sub_package = __import__(f"celery_delayq.{package}", fromlist=["_"])
        for sub in pkgutil.iter_modules(sub_package.__path__):
            named = f"{package}/{sub.name}" in rows or f"`{sub.name}`" in rows[f"{package}/"]
            assert named, f"{package}.{sub.name} is not in the map"
