"""The README's code runs, its two commands are the ones CI and users run, and its links work
where it is shown away from the repository (a package index): each is absolute, and each that
points into the project names a file of this checkout."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import yaml  # type: ignore[import-untyped]
from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
#: The repository and the docs site, as pyproject.toml's [project.urls] give them.
REPO = URLS["Source"].rstrip("/")
SITE = URLS["Documentation"].rstrip("/") + "/"
BLOB = REPO + "/blob/main/"
RAW = REPO.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _command_after(marker: str) -> str:
    after = README.split(f"<!-- {marker} -->", 1)[1]
    return re.search(r"```sh\n(.*?)\n```", after, flags=re.S).group(1)  # type: ignore[union-attr]


def test_readme_quickstart_runs_against_a_real_redis(redis_url: str) -> None:
    quickstart = README.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", quickstart, flags=re.S).group(1)  # type: ignore[union-attr]
    assert "redis://127.0.0.1:6379/0" in code
    code = code.replace("redis://127.0.0.1:6379/0", redis_url)
    namespace: dict[str, Any] = {"__name__": "readme_quickstart"}
    exec(compile(code, "README.md:quickstart", "exec"), namespace)
    dq = namespace["dq"]
    # apply_at (rescheduled) + apply_in (cancelled) + idempotent id + 1000 bulk + a group of 3
    assert dq.count() == 1 + 1000 + 1 + 3
    assert dq.get(namespace["later"].id) is None
    assert dq.get("reminder:7:2026-12-01") is not None
    # The opening snippet runs too, with the quickstart's task.
    intro = _blocks("python")[0]
    exec(
        "from datetime import datetime, timedelta\nfrom zoneinfo import ZoneInfo\nuser_id = 1\n" + intro,
        namespace,
    )
    assert dq.count() == 1005 + 2
    # The recurring-schedules snippet runs in the same namespace.
    recurring = README.split("Recurring schedules live in Redis", 1)[1]
    code = re.search(r"```python\n(.*?)```", recurring, flags=re.S).group(1)  # type: ignore[union-attr]
    exec(compile(code, "README.md:schedules", "exec"), namespace)
    schedules = namespace["schedules"]
    digest = schedules.get("weekday-digest")
    assert digest is not None and digest.tz == "Europe/Paris" and digest.next_run is not None
    assert digest.next_run.astimezone(ZoneInfo("Europe/Paris")).hour == 18
    heartbeat = schedules.get("heartbeat")
    assert heartbeat is not None and not heartbeat.enabled and heartbeat.next_run is None
    namespace["app"].close()


def test_ci_runs_the_readme_test_command() -> None:
    cmd = _command_after("test-command")
    assert "pip install -e '.[test,spark]'" in cmd and "-m pytest" in cmd
    script = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in script
    extracted = subprocess.run(
        [
            "awk",
            "/<!-- test-command -->/{f=1; next} f && /^```/{n++; next} f && n==1 {print; exit}",
            str(ROOT / "README.md"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == cmd


def test_readme_demo_command_is_the_demo() -> None:
    cmd = _command_after("demo-command")
    assert cmd.endswith("-m celery_delayq demo")
    assert "'.[embedded]'" in cmd


def _links() -> list[tuple[str, str]]:
    """Each ``[text](target)`` and ``![alt](target)`` of the README: ("!" or "", target)."""
    return re.findall(r"(!?)\[[^\]]*\]\(([^)\s]+)\)", README)


def _anchors(page: Path) -> set[str]:
    """The ids of a markdown page's headings, as mkdocs (Python-Markdown's toc) and GitHub make
    them: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slugify(h.replace("`", "").strip(), "-") for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _file_of(url: str, image: bool) -> Path | None:
    """The file of this checkout that a README link shows (None for a link that leaves the
    project): a docs page from its site address, a file from its blob (or, for an image, raw)
    address."""
    if image:
        assert url.startswith(RAW), f"the image {url} is not a raw file of the repository"
        return ROOT / url[len(RAW) :]
    if url.startswith(SITE):
        page = url[len(SITE) :].rstrip("/") or "index"
        return ROOT / "docs" / f"{page}.md"
    if url.startswith(BLOB):
        return ROOT / url[len(BLOB) :]
    assert not url.startswith(REPO), f"{url}: link files as {BLOB}PATH"
    return None


def test_the_readme_links_are_absolute_and_point_at_files_of_the_repository() -> None:
    links = _links()
    assert len(links) >= 30 and any(bang for bang, _ in links)
    for bang, target in links:
        assert target.startswith("https://"), f"{target}: a relative link breaks on a package index"
        url, _, anchor = target.partition("#")
        path = _file_of(url, image=bool(bang))
        if path is None:
            continue
        assert path.is_file(), f"{target} names {path.relative_to(ROOT)}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}"


def test_the_docs_site_and_pyproject_name_the_same_addresses() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert site["site_url"] == SITE
    assert site["repo_url"].rstrip("/") == REPO
    assert URLS["Homepage"].rstrip("/") == REPO
    assert URLS["Changelog"] == BLOB + "CHANGELOG.md" and (ROOT / "CHANGELOG.md").is_file()
    assert URLS["Issues"] == REPO + "/issues"
