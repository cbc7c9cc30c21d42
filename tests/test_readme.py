"""The README's code runs, and its two commands are the ones CI and users run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


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
        ["awk", '/<!-- test-command -->/{f=1; next} f && /^```/{n++; next} f && n==1 {print; exit}',
         str(ROOT / "README.md")],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert extracted == cmd


def test_readme_demo_command_is_the_demo() -> None:
    cmd = _command_after("demo-command")
    assert cmd.endswith("-m celery_delayq demo")
    assert "'.[embedded]'" in cmd
