"""The docs say what the code does: settings defaults match, and every python block runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from celery_delayq.config import DEFAULTS

DOCS = Path(__file__).resolve().parent.parent / "docs"
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
