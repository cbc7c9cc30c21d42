"""The dashboard over HTTP: each page and its JSON twin answer, and the JSON API serves the
shapes ``celery delayq ... --json`` prints (one definition, :mod:`celery_delayq.admin.views`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from celery import Celery

from celery_delayq.config import DelayQConfig
from celery_delayq.devtools.embedded import free_port
from celery_delayq.web import create_app
from tests.support.cli import as_json, invoke
from tests.support.polling import wait_for
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

PAGES = ["/", "/jobs", "/schedules", "/dead", "/keys", "/batches"]


@pytest.fixture
def stored(app: Celery) -> list[str]:
    """Three jobs of the test app's ``t.add``, due in 1, 2 and 3 hours."""
    add = app.tasks["t.add"]
    return [add.apply_in(3600 * (i + 1), args=(i, i)).id for i in range(3)]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_answers_with_html_and_the_store_in_it(
    dashboard: Callable[..., Client], stored: list[str], path: str
) -> None:
    answer = dashboard().get(path)
    assert answer.status == 200, answer.text[:500]
    assert answer.headers["content-type"].startswith("text/html")
    assert "read-only" in answer.text
    assert "script-src 'self'" in answer.headers["content-security-policy"]


@pytest.mark.parametrize(
    ("path", "command"),
    [
        ("/api/jobs", ["ls", "--json"]),
        ("/api/schedules", ["schedules", "ls", "--json"]),
        ("/api/dead", ["dead", "ls", "--json"]),
        ("/api/keys", ["keys", "--json"]),
        ("/api/batches", ["batches", "--json"]),
    ],
)
def test_the_json_api_serves_what_the_cli_prints(
    app: Celery, dashboard: Callable[..., Client], stored: list[str], path: str, command: list[str]
) -> None:
    served = dashboard().get(path)
    assert served.status == 200 and served.headers["content-type"] == "application/json"
    assert served.json() == as_json(invoke(app, *command))


def test_api_status_is_the_cli_status_plus_the_next_24_hours(
    app: Celery, dashboard: Callable[..., Client], stored: list[str]
) -> None:
    served = dashboard().get("/api/status").json()
    printed = as_json(invoke(app, "status", "--json"))
    assert set(served) == set(printed) | {"due_24h", "lateness_last_hour"}
    assert served["totals"] | {"oldest_overdue_ms": None} == printed["totals"] | {"oldest_overdue_ms": None}
    assert sum(served["due_24h"]["counts"]) == 3
    assert served["due_24h"]["bucket_seconds"] == 3600 and len(served["due_24h"]["counts"]) == 24
    assert sum(served["due_24h"]["counts"][0:4]) == 3
    assert time.time() * 1000 - served["now_ms"] < 60_000


@pytest.mark.slow
def test_without_the_web_extra_the_command_says_how_to_install_it(app: Celery) -> None:
    code = """
import sys
sys.modules["flask"] = None
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from celery_delayq.cli import delayq
app = Celery("x", set_as_current=False)
app.conf.delayq_url = sys.argv[1]
result = CliRunner().invoke(delayq, ["web"], obj=CLIContext(app=app, no_color=True, workdir=None))
print(result.exit_code, result.output.strip())
"""
    url = DelayQConfig.from_app(app).url
    proc = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    hint = "Error: the dashboard needs the web extra: pip install 'celery-delayq[web]'"
    assert proc.stdout.strip() == f"1 {hint}"


@pytest.mark.slow
def test_python_m_web_serves_a_store_by_its_url(app: Celery, stored: list[str]) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_delayq", "web", "--url", DelayQConfig.from_app(app).url,
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        client = Client(f"http://127.0.0.1:{port}")
        assert wait_for(lambda: _answers(client), 30, 0.2), "the dashboard did not answer"
        served = client.get("/api/jobs").json()
        assert sorted(j["id"] for j in served["jobs"]) == sorted(stored)
        assert client.get("/").status == 200
    finally:
        proc.terminate()
        output = proc.communicate(timeout=15)[0]
    assert f"delayq dashboard (read-only) on http://127.0.0.1:{port}/" in output


def _answers(client: Client) -> bool:
    try:
        return client.get("/api/status").status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_an_unreachable_store_is_exit_3_before_serving() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "celery_delayq", "web", "--url", "redis://:pw123@127.0.0.1:1/0",
         "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in proc.stderr
    assert "pw123" not in proc.stderr + proc.stdout


def test_every_dashboard_of_a_process_reuses_the_compiled_templates(app: Celery) -> None:
    """A page compiled for one dashboard is not compiled again for the next one made in the
    process: the second finds its code in the shared cache (see ``web.app._CompiledTemplates``)."""
    first, second = create_app(app), create_app(app)
    cache = second.jinja_env.bytecode_cache
    assert cache is not None and cache is first.jinja_env.bytecode_cache
    loader = second.jinja_env.loader
    assert loader is not None
    source, filename, _ = loader.get_source(second.jinja_env, "job.html")
    first.jinja_env.get_template("job.html")  # compiled (or loaded), its code kept
    assert cache.get_bucket(second.jinja_env, "job.html", filename, source).code is not None
