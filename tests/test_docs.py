"""The docs say what the code does: settings defaults match, every python block runs, and the
site builds with ``mkdocs build --strict`` (no broken link or anchor, no page left out of the nav)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from celery_delayq.config import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_every_setting_has_a_section_with_the_codes_default() -> None:
    text = (DOCS / "settings.md").read_text()
    sections = dict(re.findall(r"^## (delayq_\w+)\nDefault: `(.*?)`$", text, flags=re.M))
    headed = re.findall(r"^## (delayq_\w+)", text, flags=re.M)
    assert sorted(headed) == sorted(DEFAULTS), "one section per setting, no more, no less"
    assert sorted(sections) == sorted(DEFAULTS), "each section starts with its Default: line"
    for name, (default, _) in DEFAULTS.items():
        assert ast.literal_eval(sections[name]) == default, name


@pytest.mark.parametrize("page", [p for p in PAGES if "```python" in p.read_text()], ids=lambda p: p.name)
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
