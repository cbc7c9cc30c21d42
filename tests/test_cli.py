"""``celery -A proj delayq ...``: every command through click's CliRunner on the real test Redis,
and once as a real ``python -m celery`` subprocess."""

from __future__ import annotations

import json
import pickle
import pkgutil
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery
from click.testing import CliRunner, Result

import celery_delayq
from celery_delayq import DelayedTask, DelayQ, Schedules
from celery_delayq.cli import chart_lines, delayq, iter_commands, parse_when
from celery_delayq.cli.errors import cli_error, rule_for
from celery_delayq.exceptions import (
    ConfigurationError,
    CorruptData,
    InvalidDueTime,
    ScheduleExists,
    ScheduleNotFound,
    UnknownTask,
)
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.lateness import Histogram, key_for
from celery_delayq.store.stored_forms import stored_form
from tests.support.acl import documented_rule, server_kind
from tests.support.apps import add_task, make_app
from tests.support.cli import as_json, invoke
from tests.support.cluster import cluster_url, redis_cluster
from tests.support.processes import ROOT, subprocess_env
from tests.support.store import bury, ids_on_shard, server_ms

__all__ = ["cluster_url", "redis_cluster"]  # fixtures, used by name

Run = Callable[..., Result]
HOUR_MS = 3_600_000


@pytest.fixture
def run(app: Celery) -> Run:
    """``run("ls", "--json")``: the ``delayq`` group invoked as ``celery -A app`` would."""
    runner = CliRunner()

    def run(*args: str, input: str | None = None, target: Celery | None = None) -> Result:
        return invoke(target or app, *args, input=input, runner=runner)

    return run


def store_of(app: Celery) -> Store:
    return get_store(app)


def add_at(app: Celery, due_ms: int, *args: Any, **options: Any) -> str:
    return str(app.tasks["t.add"].apply_at(due_ms / 1000, args or (1, 2), **options).id)


def lease(app: Celery, job_id: str, token: str = "beat-test") -> None:
    store = store_of(app)
    [claimed] = store.claim([store.keys.shard_of(job_id)], token)
    assert job_id in [j.id for j in claimed.jobs]


# -- registration ---------------------------------------------------------------------------------


def test_registered_as_a_celery_command() -> None:
    [ep] = [ep for ep in entry_points(group="celery.commands") if ep.name == "delayq"]
    assert ep.value == "celery_delayq.cli:delayq"
    assert ep.load() is delayq


def test_every_command_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    commands = list(iter_commands())
    assert len(commands) == 28
    for command in commands:
        assert re.search(rf"^#+ `{re.escape(command)}", text, flags=re.M), (
            f"docs/cli.md: no section on {command}"
        )


#: Imports a module with rich and prometheus-client missing (as without the cli and metrics
#: extras), then prints the CLI's and the dev tools' modules that got imported.
WITHOUT_EXTRAS = """
import sys
sys.modules["rich"] = None
sys.modules["prometheus_client"] = None
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
print(sorted(m for m in sys.modules if m.startswith(("celery_delayq.cli", "celery_delayq.devtools"))))
"""

#: Every runtime module: all of the package but the CLI, the dev tools, ``python -m`` and the
#: Spark source, the metrics endpoint and the dashboard (they need pyspark, prometheus-client
#: and Flask, extras of their own).
RUNTIME = sorted(
    info.name
    for info in pkgutil.walk_packages(celery_delayq.__path__, "celery_delayq.")
    if not info.name.startswith(("celery_delayq.cli", "celery_delayq.devtools", "celery_delayq.web"))
    and info.name
    not in ("celery_delayq.__main__", "celery_delayq.spark.source", "celery_delayq.beat.metrics")
)


@pytest.mark.slow
def test_the_runtime_needs_neither_the_extras_nor_the_cli_nor_the_dev_tools() -> None:
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *RUNTIME],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_without_rich_every_command_says_how_to_install_it() -> None:
    code = (
        WITHOUT_EXTRAS
        + """
from click.testing import CliRunner
from celery_delayq.cli import delayq, demo
for command, args in ((delayq, ["status", "--json"]), (delayq, ["keys"]), (demo, [])):
    result = CliRunner().invoke(command, args)
    print(result.exit_code, result.output.strip())
helped = CliRunner().invoke(delayq, ["--help"])
print(helped.exit_code, "Not installed:" in helped.output, "status" in helped.output)
"""
    )
    proc = subprocess.run([sys.executable, "-c", code, "celery_delayq.cli"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    hint = "Error: the delayq commands need rich: pip install 'celery-delayq[cli]'"
    assert proc.stdout.splitlines()[1:] == [f"1 {hint}"] * 3 + ["0 True True"], proc.stdout


@pytest.mark.slow
def test_a_beat_with_a_metrics_port_but_no_prometheus_client_says_so_in_one_line() -> None:
    code = (
        WITHOUT_EXTRAS
        + """
from celery import Celery
from celery_delayq import Scheduler
app = Celery("t", broker="memory://", set_as_current=False)
app.conf.update(delayq_url="redis://127.0.0.1:1/0", delayq_metrics_port=19999)
try:
    Scheduler(app)
except Exception as exc:
    print(type(exc).__name__, exc)
"""
    )
    proc = subprocess.run([sys.executable, "-c", code, "celery_delayq.beat.scheduler"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        "BeatConfigurationError delayq: delayq_metrics_port is set, which needs prometheus-client: "
        "pip install 'celery-delayq[metrics]'"
    ], proc.stdout


def test_errors_are_mapped_by_exception_class() -> None:
    url = "redis://:***@cache:6379/0"
    cases = [
        (ScheduleNotFound("no schedule named 'x'"), 1, "no schedule named 'x'"),
        (ScheduleExists("any text", name="x"), 1,
         "a schedule named 'x' exists: change it with `schedules update`, or `schedules add --replace`"),
        (UnknownTask("any text", task="p.t"), 2,
         "task 'p.t' is not registered in this app; import its module first (or pass --no-check-task)"),
        (InvalidDueTime("bad due"), 2, "bad due"),
        (ConfigurationError("bad shards"), 3, "configuration: bad shards"),
        (redis.TimeoutError("Timeout"), 3, f"cannot reach Redis at {url}: Timeout"),
        (redis.AuthenticationError("no"), 3, f"cannot reach Redis at {url}: no"),
        (redis.ResponseError("NOPERM"), 3, f"Redis at {url} answered: NOPERM"),
        (CorruptData("torn"), 3, "torn"),
    ]  # fmt: skip
    for exc, code, message in cases:
        problem = cli_error(exc, url)
        assert (problem.exit_code, problem.message) == (code, message), exc
    no_app = cli_error(redis.ConnectionError("refused"), url, no_app="schedules ls")
    assert no_app.exit_code == 3 and "`celery -A proj delayq schedules ls`" in no_app.message
    assert cli_error(ScheduleNotFound("x"), url, no_app="ls").message == "x"  # not about the app
    assert rule_for(KeyError("x")) is None and rule_for(ValueError("x")) is None  # a bug: a traceback
    assert pickle.loads(pickle.dumps(ScheduleExists("m", name="x"))).name == "x"
    assert pickle.loads(pickle.dumps(UnknownTask("m", task="p.t"))).task == "p.t"


def test_demo_is_a_delayq_command_with_the_same_checks(run: Run) -> None:
    bad = run("demo", "--url", "http://127.0.0.1:1/0")
    assert bad.exit_code == 2 and bad.stdout == ""
    assert bad.stderr.startswith("Error: bad --url 'http://127.0.0.1:1/0'"), bad.stderr
    args = run("demo", "--jobs", "0")
    assert args.exit_code == 2 and "--jobs must be >= 1" in args.stderr


# -- status -----------------------------------------------------------------------------------------


def test_status_json_counts_every_shard(app: Celery, r: redis.Redis, run: Run) -> None:
    store = store_of(app)
    now = server_ms(r)
    shard = 3
    late, soon, later, held, dead = ids_on_shard(store.keys, shard, 5, stem="s3")
    add_at(app, now - 120_000, task_id=late)
    add_at(app, now - 60_000, task_id=held)
    add_at(app, now - 30_000, task_id=dead)
    add_at(app, now + 90_000, task_id=soon)  # second minute of the chart
    add_at(app, now + 150_000, task_id=later)  # third minute
    add_at(app, now + 10 * HOUR_MS, task_id=ids_on_shard(store.keys, 4, 1, stem="far")[0])  # past the chart
    bury(app, dead)  # the claim leased late, held and dead (all due); dead is buried, held stays leased
    assert store.cancel(late) == "delivering"  # late waits again, overdue
    add_at(app, now - 120_000, task_id=late)

    data = as_json(run("status", "--json"))
    assert data["prefix"] == "delayq" and data["url"].endswith("/0")
    assert len(data["shards"]) == 16
    row = data["shards"][shard]
    assert (row["waiting"], row["leased"], row["dead"], row["overdue"]) == (3, 1, 1, 1)
    assert row["oldest_overdue_id"] == late
    assert row["oldest_overdue"] == datetime.fromtimestamp((now - 120_000) / 1000, UTC).isoformat(
        timespec="milliseconds"
    ).replace("+00:00", "Z")
    assert row["next_due_id"] == soon  # the live lease (score: its expiry, soon) is skipped
    totals = data["totals"]
    assert (totals["waiting"], totals["leased"], totals["dead"], totals["overdue"]) == (4, 1, 1, 1)
    assert totals["next_due_id"] == soon and totals["oldest_overdue_id"] == late
    due = data["due"]
    assert due["bucket_seconds"] == 60 and len(due["counts"]) == 60
    # the leased job counts at its lease expiry (now + 30 s): minute 0
    assert due["counts"][:3] == [1, 1, 1] and sum(due["counts"]) == 3
    assert data["beats"] == []
    assert data["lateness"]["publish"]["count"] == 0 and data["lateness"]["publish"]["p50_ms"] is None


def test_status_shows_beats_lateness_and_the_chart(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    beat = {
        "token": "h1:10:aa",
        "host": "h1",
        "pid": 10,
        "started_ms": now - 3_600_000,
        "seen_ms": now - 2000,
        "passes": 1234,
        "published": 5678,
        "dead_lettered": 2,
        "errors": 1,
    }
    old = dict(beat, token="h2:20:bb", host="h2", pid=20, seen_ms=now - 120_000)
    r.hset("delayq:beats", mapping={"h1:10:aa": json.dumps(beat), "h2:20:bb": json.dumps(old), "h3": "junk"})
    publish, start = Histogram(), Histogram()
    for ms in [3] * 9 + [700]:
        publish.observe(ms)
    start.observe(400_000)
    publish.flush(get_store(app), key_for("delayq", "publish"))
    start.flush(get_store(app), key_for("delayq", "start"))
    for i in range(40):
        add_at(app, now + 60_000 * (i % 5) + 5000)

    data = as_json(run("status", "--json"))
    beats = {b["token"]: b for b in data["beats"]}
    assert beats["h1:10:aa"]["alive"] is True and beats["h1:10:aa"]["published"] == 5678
    assert beats["h2:20:bb"]["alive"] is False and beats["h3"]["alive"] is False
    assert data["beats"][0]["token"] == "h1:10:aa"  # alive first
    assert data["lateness"]["publish"] | {"buckets": None} == {
        "count": 10, "mean_ms": 72.7, "p50_ms": 5.0, "p99_ms": 1000.0, "buckets": None,
    }  # fmt: skip
    assert data["lateness"]["start"]["count"] == 1 and data["lateness"]["start"]["p50_ms"] is None
    assert data["due"]["counts"][:6] == [8, 8, 8, 8, 8, 0]

    out = run("status").stdout
    assert "Beats: 1 alive, 2 stale" in out
    assert re.search(r"h1:10:aa\s+alive\s+\d+s ago\s+1h\s+1,234\s+5,678\s+2\s+1", out)
    assert re.search(r"h2:20:bb\s+stale\s+2m ago", out)
    assert re.search(r"h3\s+unreadable", out)
    assert "due → publish  p50 ≤ 5 ms  p99 ≤ 1 s  mean 72.7 ms  (10 jobs)" in out
    assert "due → start    p50 > 300 s" in out
    assert "Jobs due per minute, next 1h: 40 (peak 8 per minute)" in out
    assert re.search(r"^\s+8 ┤█████\s*$", out, flags=re.M)  # five full columns, then nothing
    assert re.search(r"^total\s+40\s+0\s+0\s+0\s+0\s+0\s+-\s+", out, flags=re.M)


def test_status_without_beats_or_jobs(run: Run) -> None:
    out = run("status").stdout
    assert "Beats: no beat seen" in out
    assert "due → publish  none recorded" in out
    assert "Jobs due per minute, next 1h: 0" in out
    assert re.search(r"^total\s+0\s+0\s+0\s+0\s+0\s+0\s+-\s+-$", out, flags=re.M)


def test_status_window(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    add_at(app, now + 101 * 60_000)
    assert len(as_json(run("status", "--json", "--window", "30m"))["due"]["counts"]) == 30
    wide = as_json(run("status", "--json", "--window", "2h"))["due"]
    assert wide["bucket_seconds"] == 120 and len(wide["counts"]) == 60 and wide["counts"][50] == 1
    out = run("status", "--window", "2h").stdout
    assert "Jobs due per 2 minutes, next 2h: 1" in out
    assert "Jobs due" not in run("status", "--window", "0").stdout
    bad = run("status", "--window", "soon")
    assert bad.exit_code == 2 and "--window: bad duration 'soon'" in bad.stderr


def test_status_hides_empty_shards_past_32(r: redis.Redis, redis_url: str, run: Run) -> None:
    many = make_app(redis_url, delayq_shards=64, delayq_prefix="many")
    store = get_store(many)
    store.enqueue([("only-one", server_ms(r) + 60_000, "{}")])
    out = run("status", target=many).stdout
    assert "(63 empty shards not shown; --all-shards shows them)" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d+\s+\d", line)]
    assert len(rows) == 1 and rows[0].split()[0] == str(store.keys.shard_of("only-one"))
    assert len([ln for ln in run("status", "--all-shards", target=many).stdout.splitlines()
                if re.match(r"^\s+\d+\s+\d", ln)]) == 64  # fmt: skip
    many.close()


def test_shard_stats_walks_past_many_live_leases(app: Celery, r: redis.Redis) -> None:
    """250 live leases (scores just after now) stand before the next waiting job."""
    store = store_of(app)
    now = server_ms(r)
    ids = ids_on_shard(store.keys, 5, 251, stem="walk")
    store.enqueue([(i, now - 1000, "{}") for i in ids[:250]] + [(ids[250], now + 40_000, "{}")])
    store.claim([5], "beat-walk", batch=1000)
    st = store.shard_stats()[5]
    assert (st.stored, st.leased, st.waiting, st.overdue) == (251, 250, 1, 0)
    assert (st.next_id, st.next_due_ms, st.head_id) == (ids[250], now + 40_000, None)


# -- jobs ---------------------------------------------------------------------------------------------


def test_ls_lists_in_due_order_with_filters(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    a = add_at(app, now + 60_000, 1, 1, task_id="a")
    b = add_at(app, now + 120_000, 2, 2, task_id="b", queue="reports")
    c = str(app.tasks["t.noop"].apply_at((now + 180_000) / 1000, task_id="c").id)
    d = add_at(app, now - 1000, 4, 4, task_id="d")
    lease(app, d)

    data = as_json(run("ls", "--json"))
    assert [j["id"] for j in data["jobs"]] == [d, a, b, c]  # d: by its lease expiry (now + 30 s)
    assert data["count"] == 4 and data["next_cursor"] is None
    first = data["jobs"][1]
    assert first == {
        "id": "a", "state": "waiting", "task": "t.add", "shard": store_of(app).keys.shard_of("a"),
        "due": first["due"], "due_ms": now + 60_000, "queue": "celery", "args": [1, 1], "kwargs": {},
        "tries": 0, "lease_until": None, "schedule": None, "gated_by": None,
    }  # fmt: skip
    assert datetime.fromisoformat(first["due"]).timestamp() * 1000 == now + 60_000
    assert [j["id"] for j in as_json(run("ls", "--json", "--task", "t.noop"))["jobs"]] == [c]
    assert [j["id"] for j in as_json(run("ls", "--json", "--queue", "reports"))["jobs"]] == [b]
    leased = as_json(run("ls", "--json", "--state", "leased"))["jobs"]
    assert [(j["id"], j["state"], j["tries"]) for j in leased] == [(d, "leased", 1)]
    assert [j["id"] for j in as_json(run("ls", "--json", "--state", "waiting"))["jobs"]] == [a, b, c]
    window = as_json(run("ls", "--json", "--from", "+90s", "--until", "+150s"))["jobs"]
    assert [j["id"] for j in window] == [b]
    iso_until = datetime.fromtimestamp((now + 61_000) / 1000, UTC).isoformat()
    assert [j["id"] for j in as_json(run("ls", "--json", "--until", iso_until))["jobs"]] == [d, a]

    out = run("ls").stdout
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STATE", "DUE", "TASK", "QUEUE", "ARGS"]
    [line_a] = [line for line in lines if line.startswith("a ")]
    assert re.match(
        r"a\s+waiting\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\s+in (59s|1m)\s+t\.add\s+celery\s+\[1,1\]$", line_a
    )
    assert [line.split()[0] for line in lines[1:]] == ["d", "a", "b", "c"]
    assert "reports" in lines[3]
    assert run("ls", "--task", "nope").stdout.strip() == "no jobs match"


def test_ls_pages_with_offset_and_cursor(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    store = store_of(app)
    # equal due times across shards and within a shard: the cursor must not skip or repeat
    jobs = [(f"p{i}", now + 60_000 + (i // 7) * 1000, "{}") for i in range(40)]
    store.enqueue(jobs)
    everything = [j["id"] for j in as_json(run("ls", "--json", "--limit", "100"))["jobs"]]
    assert sorted(everything) == sorted(j[0] for j in jobs)

    seen: list[str] = []
    cursor: list[str] = []
    pages = 0
    while True:
        page = as_json(run("ls", "--json", "--limit", "6", *cursor))
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        if page["next_cursor"] is None:
            break
        cursor = ["--cursor", page["next_cursor"]]
    assert seen == everything and pages == 7
    assert [
        j["id"] for j in as_json(run("ls", "--json", "--limit", "5", "--offset", "12"))["jobs"]
    ] == everything[12:17]
    out = run("ls", "--limit", "3").stdout
    assert re.search(r"^3 shown; more with: --cursor '\d+:\d+:p\d+'$", out, flags=re.M)
    bad = run("ls", "--cursor", "nonsense")
    assert bad.exit_code == 2 and "bad --cursor" in bad.stderr
    assert run("ls", "--limit", "0").exit_code == 2  # click's own usage error


def test_an_id_with_a_control_character_is_shown_escaped(app: Celery, r: redis.Redis, run: Run) -> None:
    """An id with a newline or a tab (refused at the call now, InvalidTaskId; stored by an older
    version or written straight to the store) is printed as its repr by ``ls``, ``show`` and the
    per-id reports: one line, not two ids (was: printed raw). ``--json`` keeps the id as it is."""
    from celery_delayq.producer.build import build_envelopes

    due = server_ms(r) + 3_600_000
    store = store_of(app)
    for old_id in ("old\nid", "tab\tid"):
        [envelope] = build_envelopes(app, app.tasks["t.add"], [("placeholder", due, (1, 2), None)], {})
        store.enqueue([(old_id, due, envelope.replace('"placeholder"', json.dumps(old_id)))])
    listed = run("ls").stdout
    assert re.search(r"^'old\\nid'\s+waiting\s", listed, flags=re.M), listed
    assert re.search(r"^'tab\\tid'\s+waiting\s", listed, flags=re.M), listed
    assert "\t" not in listed and not re.search(r"^id\s", listed, flags=re.M)
    shown = run("show", "old\nid").stdout
    assert shown.splitlines()[0] == "job 'old\\nid'"
    assert re.search(r"^id\s+'old\\nid'$", shown, flags=re.M)
    assert as_json(run("ls", "--json"))["jobs"][0]["id"] in ("old\nid", "tab\tid")
    cancelled = run("cancel", "old\nid", "tab\tid")
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.splitlines() == ["'old\\nid': cancelled", "'tab\\tid': cancelled"]


def test_show_a_job(app: Celery, r: redis.Redis, run: Run) -> None:
    due = server_ms(r) + 3_600_000
    job_id = add_at(app, due, 3, 4, task_id="show-me", queue="q1", priority=5, headers={"tenant": "acme"})
    view = as_json(run("show", job_id, "--json"))
    assert (view["id"], view["state"], view["task"], view["queue"]) == ("show-me", "waiting", "t.add", "q1")
    assert (view["args"], view["kwargs"], view["due_ms"], view["tries"]) == ([3, 4], {}, due, 0)
    assert view["options"]["priority"] == 5 and view["options"]["queue"] == "q1"
    assert view["headers"]["id"] == "show-me" and view["options"]["headers"] == {"tenant": "acme"}
    assert view["properties"]["correlation_id"] == "show-me"
    assert (
        view["content_type"] == "application/json" and view["dead"] is None and view["envelope_error"] is None
    )
    assert view["created"] is not None and view["shard"] == store_of(app).keys.shard_of("show-me")
    out = run("show", job_id).stdout
    assert re.search(r"^state\s+waiting$", out, flags=re.M)
    assert re.search(r"^due\s+\S+ \S+Z \(in (59m\d+s|1h)\)$", out, flags=re.M)
    assert re.search(r"^args\s+\[3, 4\]$", out, flags=re.M)

    pickled = add_at(app, due, 5, 6, task_id="pickled", serializer="pickle")
    other = as_json(run("show", pickled, "--json"))  # not JSON: Celery's argsrepr/kwargsrepr
    assert (other["args"], other["kwargs"], other["content_type"]) == (
        "(5, 6)",
        "{}",
        "application/x-python-serialize",
    )

    missing = run("show", "nope")
    assert missing.exit_code == 1 and missing.stderr.strip() == "Error: no job with id 'nope'"
    assert missing.stdout == ""


def test_cancel(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    one, two = add_at(app, now + 60_000, task_id="one"), add_at(app, now + 60_000, task_id="two")
    result = run("cancel", one, "ghost", two)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == ["one: cancelled", "two: cancelled"]
    assert result.stderr.strip() == "Error: no job with id 'ghost'"
    assert store_of(app).count() == 0
    held = add_at(app, now - 1000, task_id="held")
    lease(app, held)
    data = json.loads(run("cancel", "--json", held).stdout)
    assert data["results"][0]["outcome"] == "delivering"
    assert "may already be in the broker" in data["results"][0]["message"]
    ok = json.loads(run("cancel", "--json", add_at(app, now + 60_000, task_id="three")).stdout)
    assert ok == {"results": [{"id": "three", "outcome": "cancelled", "message": "cancelled"}]}
    assert run("cancel").exit_code == 2


def test_cancel_refuses_schedule_points_and_names_dead_letters(app: Celery, r: redis.Redis, run: Run) -> None:
    sched = Schedules(app).add("tick", "t.noop", timedelta(minutes=5))
    assert sched.next_run is not None
    point = next(j.id for j in store_of(app).scan() if j.id.startswith("{tick}@"))
    refused = run("cancel", point)
    assert refused.exit_code == 1
    assert "is the next run of schedule 'tick'" in refused.stderr and "schedules pause" in refused.stderr
    assert store_of(app).get(point) is not None
    dead = add_at(app, server_ms(r) - 1000, task_id="gone")
    bury(app, dead)
    result = run("cancel", dead)
    assert result.exit_code == 1 and "it is dead-lettered (see `delayq dead show gone`)" in result.stderr


def test_reschedule_and_run_now(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    job = add_at(app, now + HOUR_MS, task_id="move")
    store = store_of(app)
    assert run("reschedule", job, "2031-01-01T09:00:00+01:00").exit_code == 0
    expected = datetime(2031, 1, 1, 8, tzinfo=UTC).timestamp() * 1000
    assert store.get(job).due_ms == expected  # type: ignore[union-attr]
    assert run("reschedule", job, "1924934500.25").exit_code == 0
    assert store.get(job).due_ms == 1_924_934_500_250  # type: ignore[union-attr]
    # Relative times count from the server's clock, as the store estimates it (a few ms off TIME).
    before = server_ms(r) - 5
    data = as_json(run("reschedule", job, "+2h", "--json"))
    after = server_ms(r) + 5
    assert data["results"][0]["outcome"] == "moved"
    assert before + 2 * HOUR_MS <= store.get(job).due_ms <= after + 2 * HOUR_MS  # type: ignore[union-attr]
    before = server_ms(r) - 5
    out = run("run-now", job)
    after = server_ms(r) + 5
    assert out.exit_code == 0 and re.fullmatch(r"move: due \S+ \S+Z \(now\)\n", out.stdout)
    assert before <= store.get(job).due_ms <= after  # type: ignore[union-attr]

    bad = run("reschedule", job, "next tuesday")
    assert bad.exit_code == 2 and bad.stderr.startswith("Error: WHEN: bad time 'next tuesday'")
    assert run("reschedule", job, "+5 parsecs").exit_code == 2
    assert run("reschedule", job, "99999999999999").exit_code == 2  # past year 9999
    unknown = run("reschedule", "nope", "+1h")
    assert unknown.exit_code == 1 and "no job with id 'nope'" in unknown.stderr
    held = add_at(app, now - 1000, task_id="held")
    lease(app, held)
    busy = run("run-now", held)
    assert busy.exit_code == 1 and "a beat is delivering it now" in busy.stderr


def test_purge_asks_and_keeps_schedules_dead_letters_and_other_prefixes(
    app: Celery, r: redis.Redis, redis_url: str, run: Run
) -> None:
    now = server_ms(r)
    for i in range(30):
        add_at(app, now + 60_000 + i)
    for _ in range(5):
        app.tasks["t.noop"].apply_at((now + 60_000) / 1000)
    Schedules(app).add("keep-me", "t.add", timedelta(minutes=1), args=(1, 2))
    bury(app, add_at(app, now - 1000, task_id="dead-one"))
    other = make_app(redis_url, delayq_prefix="other")
    get_store(other).enqueue([("foreign", now + 60_000, "{}")])

    declined = run("purge", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.stderr
    assert "Delete every pending one-off job (of 36 stored) under prefix 'delayq'" in declined.stderr
    assert store_of(app).count() == 36

    only_noop = as_json(run("purge", "--task", "t.noop", "--yes", "--json"))
    assert only_noop == {"removed": 5, "cancelled": 5, "delivering": 0, "kept_points": 0}
    result = run("purge", input="y\n")
    assert result.exit_code == 0
    assert result.stdout.strip() == "removed 30 job(s); kept 1 schedule point(s)"
    left = [j.id for j in store_of(app).scan()]
    assert len(left) == 1 and left[0].startswith("{keep-me}@")
    assert store_of(app).count_dead() == 1
    assert get_store(other).get("foreign") is not None
    other.close()


# -- schedules -----------------------------------------------------------------------------------------


def test_schedules_add_ls_show_update_pause_resume_run_now_rm(app: Celery, run: Run) -> None:
    added = as_json(
        run(
            "schedules",
            "add",
            "digest",
            "t.add",
            "--cron",
            "0 18 * * 1-5",
            "--tz",
            "Europe/Paris",
            "--args",
            "[1, 2]",
            "--queue",
            "reports",
            "--json",
        )
    )
    assert (added["name"], added["task"], added["tz"], added["args"]) == (
        "digest",
        "t.add",
        "Europe/Paris",
        [1, 2],
    )
    assert added["rule"] == {"type": "cron", "expr": "0 18 * * 1-5", "tz": "Europe/Paris"}
    assert added["options"] == {"queue": "reports"} and added["enabled"] is True
    nxt = datetime.fromisoformat(added["next_run"])
    assert nxt.astimezone(ZoneInfo("Europe/Paris")).hour == 18 and added["next_run"].endswith("Z")
    tick = run("schedules", "add", "tick", "t.noop", "--every", "30s")
    assert tick.exit_code == 0 and re.search(r"^rule\s+every 30 s$", tick.stdout, flags=re.M)
    once_at = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
    assert run("schedules", "add", "once", "t.noop", "--at", once_at.isoformat()).exit_code == 0
    assert Schedules(app).get("once").next_run == once_at  # type: ignore[union-attr]

    listed = as_json(run("schedules", "ls", "--json"))
    assert [s["name"] for s in listed["schedules"]] == ["digest", "once", "tick"] and listed["count"] == 3
    noop = as_json(run("schedules", "ls", "--json", "--task", "t.noop"))["schedules"]
    assert [s["name"] for s in noop] == ["once", "tick"]
    out = run("schedules", "ls").stdout
    assert re.search(r"^digest\s+t\.add\s+cron '0 18 \* \* 1-5' Europe/Paris\s+active\s+", out, flags=re.M)

    shown = as_json(run("schedules", "show", "tick", "--json"))
    assert shown["rule"]["every_ms"] == 30_000 and shown["run_count"] == 0
    changed = as_json(
        run("schedules", "update", "tick", "--every", "5m", "--kwargs", "{}", "--queue", "q9", "--json")
    )
    assert changed["rule"]["every_ms"] == 300_000 and changed["options"] == {"queue": "q9"}
    paused = as_json(run("schedules", "pause", "tick", "--json"))
    assert paused["enabled"] is False and paused["next_run"] is None
    assert [s["name"] for s in as_json(run("schedules", "ls", "--json", "--paused"))["schedules"]] == ["tick"]
    assert run("schedules", "resume", "tick", "--json").exit_code == 0
    assert Schedules(app).get("tick").enabled  # type: ignore[union-attr]

    now_run = as_json(run("schedules", "run-now", "digest", "--json"))
    assert now_run["id"].startswith("{digest}@run-now-") and now_run["created"] is True
    job = store_of(app).get(now_run["id"])
    assert job is not None and abs(job.due_ms - time.time() * 1000) < 5000

    removed = run("schedules", "rm", "once", "ghost")
    assert removed.exit_code == 1
    assert removed.stdout.strip() == "once: deleted" and "no schedule named 'ghost'" in removed.stderr
    assert Schedules(app).get("once") is None
    for command in (["show", "ghost"], ["pause", "ghost"], ["resume", "ghost"], ["run-now", "ghost"],
                    ["update", "ghost", "--every", "1m"]):  # fmt: skip
        missing = run("schedules", *command)
        assert missing.exit_code == 1 and missing.stderr.strip() == "Error: no schedule named 'ghost'", (
            command
        )


def test_schedules_bad_input(app: Celery, run: Run) -> None:
    def fails(code: int, text: str, *args: str) -> None:
        result = run("schedules", *args)
        assert result.exit_code == code, result.output
        assert text in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1

    fails(2, "malformed cron expression '61 * * * *'", "add", "x", "t.noop", "--cron", "61 * * * *")
    fails(2, "cron expression must have 5 fields", "add", "x", "t.noop", "--cron", "* *")
    fails(
        2,
        "unknown timezone 'Mars/Olympus'",
        "add",
        "x",
        "t.noop",
        "--cron",
        "0 9 * * *",
        "--tz",
        "Mars/Olympus",
    )
    fails(2, "--args must be a JSON array", "add", "x", "t.add", "--every", "1m", "--args", '{"x": 1}')
    fails(2, "--kwargs must be JSON", "add", "x", "t.add", "--every", "1m", "--kwargs", "{x}")
    fails(2, "--every: bad duration 'often'", "add", "x", "t.noop", "--every", "often")
    fails(
        2, "give one of --cron, --every or --at", "add", "x", "t.noop", "--every", "1m", "--cron", "* * * * *"
    )
    fails(2, "give the rule", "add", "x", "t.noop")
    fails(2, "the one-shot time is in the past", "add", "x", "t.noop", "--at", "-1h")
    fails(2, "the arguments do not fit task 't.add'", "add", "x", "t.add", "--every", "1m")
    fails(2, "task 'proj.missing' is not registered in this app", "add", "x", "proj.missing", "--every", "1m")
    assert Schedules(app).count() == 0
    assert run("schedules", "add", "x", "proj.missing", "--every", "1m", "--no-check-task").exit_code == 0
    fails(1, "a schedule named 'x' exists", "add", "x", "t.noop", "--every", "1m")
    replaced = run("schedules", "add", "x", "t.noop", "--every", "2m", "--replace", "--json")
    assert json.loads(replaced.stdout)["task"] == "t.noop"
    fails(2, "nothing to change", "update", "x")


# -- dead letters --------------------------------------------------------------------------------------


def test_dead_ls_show_requeue_rm(app: Celery, r: redis.Redis, run: Run) -> None:
    now = server_ms(r)
    for i, job_id in enumerate(("d1", "d2", "d3")):
        bury(app, add_at(app, now - 5000, i, i, task_id=job_id), reason=f"boom {i}", dead_at=now - 10_000 + i)
    assert as_json(run("dead", "ls", "--json"))["total"] == 3
    listed = as_json(run("dead", "ls", "--json", "--limit", "2"))
    assert [d["id"] for d in listed["dead"]] == ["d3", "d2"] and (listed["count"], listed["total"]) == (2, 3)
    assert listed["dead"][0]["reason"] == "boom 2" and listed["dead"][0]["args"] == [2, 2]
    assert [d["id"] for d in as_json(run("dead", "ls", "--json", "--task", "t.noop"))["dead"]] == []
    out = run("dead", "ls", "--limit", "2").stdout
    assert re.search(r"^d3\s+t\.add\s+\d+s ago\s+\S+ \S+Z\s+1\s+boom 2$", out, flags=re.M)
    assert "2 of 3 shown; more with --offset 2" in out

    shown = as_json(run("dead", "show", "d1", "--json"))
    assert (
        shown["state"] == "dead"
        and shown["dead"]["reason"] == "boom 0"
        and shown["dead"]["beat"] == "beat-bury"
    )
    assert shown["args"] == [0, 0] and shown["headers"]["id"] == "d1"
    assert as_json(run("show", "d1", "--json"))["dead"]["reason"] == "boom 0"
    assert run("dead", "show", "nope").exit_code == 1

    requeued = run("dead", "requeue", "d1", "nope")
    assert requeued.exit_code == 1 and requeued.stdout.startswith("d1: requeued, due ")
    assert "no dead letter with id 'nope'" in requeued.stderr
    store = store_of(app)
    job = store.get("d1")
    assert job is not None and job.state == "waiting" and job.tries == 0
    assert abs(job.due_ms - time.time() * 1000) < 5000
    assert store.dead_record("d1") is None
    # stored without its id, as enqueue stores it
    raw = r.hget(store.keys.for_job("d1").jobs, "d1")
    assert raw == stored_form("d1", job.envelope) and raw.startswith('{"v":3,"a":')  # type: ignore[union-attr]
    later = as_json(run("dead", "requeue", "d2", "--at", "+1h", "--json"))["results"][0]
    assert later["outcome"] == "requeued"
    assert abs(store.get("d2").due_ms - (time.time() * 1000 + HOUR_MS)) < 5000  # type: ignore[union-attr]

    add_at(app, now + HOUR_MS, task_id="d3-again")
    r.hset(store.keys.for_job("d3-again").dead, "d3-again", r.hget(store.keys.for_job("d3").dead, "d3"))  # type: ignore[arg-type]
    clash = run("dead", "requeue", "d3-again")
    assert clash.exit_code == 1 and "a job with this id is stored" in clash.stderr
    assert store.dead_record("d3-again") is not None

    removed = run("dead", "rm", "d3", "nope")
    assert removed.exit_code == 1 and removed.stdout.strip() == "d3: deleted"
    assert store.dead_record("d3") is None
    assert run("dead", "rm").exit_code == 2
    assert run("dead", "rm", "--all", input="n\n").exit_code == 1
    assert store.count_dead() == 1
    assert as_json(run("dead", "rm", "--all", "--yes", "--json")) == {"removed": 1}
    assert store.count_dead() == 0
    assert run("dead", "ls").stdout.strip() == "no dead letters"


# -- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:1/0", "Error: cannot reach Redis at redis://127.0.0.1:1/0 (delayq_url): "),
        (
            "redis://:hunter2@127.0.0.1:1/0",
            "Error: cannot reach Redis at redis://:***@127.0.0.1:1/0 (delayq_url): ",
        ),
        ("redis://127.0.0.1:port/0", "Error: bad delayq_url 'redis://127.0.0.1:port/0': "),
        ("http://127.0.0.1/0", "Error: configuration: delayq_url must be a redis://"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["ls", "--json"], ["schedules", "ls"], ["dead", "ls"]])
def test_unusable_store_exits_3_with_one_line(run: Run, url: str, message: str, command: list[str]) -> None:
    bad = Celery("bad", broker="memory://", set_as_current=False)
    bad.conf.delayq_url = url
    result = run(*command, target=bad)
    assert result.exit_code == 3
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert "hunter2" not in result.stderr and result.stdout == ""


def test_parse_when_forms() -> None:
    app = Celery(set_as_current=False)
    assert parse_when("now", app, now_ms=5000) == 5000
    assert parse_when("+1d", app, now_ms=0) == 86_400_000
    assert parse_when("-30", app, now_ms=60_000) == 30_000
    assert parse_when("2030-01-01 00:00", app) == 1_893_456_000_000  # naive: the app's timezone (UTC)
    paris = Celery(set_as_current=False)
    paris.conf.timezone = "Europe/Paris"
    assert parse_when("2030-01-01 00:00", paris) == 1_893_452_400_000
    for bad in ("", "soon", "+", "+1y", "1e400", "-inf"):
        with pytest.raises(ValueError):
            parse_when(bad, app)


def test_chart_lines_scale_to_the_peak() -> None:
    lines = chart_lines([0, 1, 2, 4], ["a", "b", "c", "d"], height=1, indent=4)
    assert lines[0] == " 4 ┤  ▂▂▄▄██"
    assert lines[1] == " 0 └────────"


# -- a real process ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_celery_subprocess(redis_url: str, r: redis.Redis) -> None:
    app = make_app(redis_url)

    @app.task(base=DelayedTask, name="cli.remind", shared=False)
    def remind(user_id: int, text: str = "") -> None:
        return None

    now = server_ms(r)
    ids = [str(remind.apply_at((now + 60_000 * (i + 1)) / 1000, args=(i, "hi")).id) for i in range(3)]
    Schedules(app).add("daily", remind, timedelta(days=1), args=(0,))  # first run: in a day
    env = subprocess_env(redis_url, redis_url, DELAYQ_CLI_URL=redis_url)
    base = [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "delayq"]

    status = subprocess.run([*base, "status"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert f"delayq prefix delayq, 16 shards at {redis_url}" in out
    assert re.search(r"^total\s+4\s+0\s+0\s+0\s+0\s+0\s+-\s+", out, flags=re.M)
    assert "recurring schedules: 1" in out and "Beats: no beat seen" in out
    assert "Jobs due per minute, next 1h: 3 (peak 1 per minute)" in out

    listing = subprocess.run([*base, "ls", "--json", "--task", "cli.remind", "--limit", "3"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    jobs = json.loads(listing.stdout)["jobs"]
    assert [j["id"] for j in jobs] == ids and [j["args"] for j in jobs] == [[0, "hi"], [1, "hi"], [2, "hi"]]

    missing = subprocess.run(
        [*base, "show", "nope"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (missing.returncode, missing.stderr.strip(), missing.stdout) == (
        1,
        "Error: no job with id 'nope'",
        "",
    )
    app.close()


def test_purge_pages_past_the_jobs_it_keeps(app: Celery, r: redis.Redis) -> None:
    """Small pages, kept jobs (another task, a schedule point) between removed ones."""
    now = server_ms(r)
    for i in range(20):
        task = "t.noop" if i % 3 else "t.add"
        app.tasks[task].apply_at((now + 60_000 + i) / 1000, *(((i, i),) if task == "t.add" else ()))
    Schedules(app).add("noop-tick", "t.noop", timedelta(minutes=1))
    counts = DelayQ(app).purge(task="t.noop", page=3)
    assert counts == {"cancelled": 13, "delivering": 0, "kept_points": 1}
    left = [j.task for j in DelayQ(app).pending()]
    assert sorted(left) == ["t.add"] * 7 + ["t.noop"]  # the schedule's point
    assert DelayQ(app).purge(page=2) == {"cancelled": 7, "delivering": 0, "kept_points": 1}


def test_every_command_works_with_the_documented_acl_user(
    app: Celery, r: redis.Redis, redis_url: str, run: Run
) -> None:
    """The CLI needs no command beyond docs/security.md's rule (run as that user on a db)."""
    user, password = "delayq-cli-test", "cli-secret"
    r.execute_command("ACL", "SETUSER", *documented_rule(user, password, server_kind(r)))
    r.execute_command("ACL", "LOG", "RESET")
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{password}@")
        limited = make_app(redis_url, delayq_url=url)

        add = add_task(limited)

        now = server_ms(r)
        for i in range(5):
            add.apply_at((now + 60_000 * (i + 1)) / 1000, (i, i), task_id=f"j{i}")
        add.apply_at((now - 1000) / 1000, (9, 9), task_id="dead")
        bury(limited, "dead")
        commands = [
            ["status"], ["status", "--json"], ["ls"], ["ls", "--json", "--task", "t.add", "--limit", "2"],
            ["show", "j0"], ["cancel", "j0"], ["reschedule", "j1", "+2h"], ["run-now", "j2"],
            ["schedules", "add", "s", "t.add", "--every", "1m", "--args", "[1, 2]"], ["schedules", "ls"],
            ["schedules", "show", "s"], ["schedules", "update", "s", "--cron", "0 9 * * *"],
            ["schedules", "pause", "s"], ["schedules", "resume", "s"], ["schedules", "run-now", "s"],
            ["dead", "ls"], ["dead", "show", "dead"], ["dead", "requeue", "dead"], ["purge", "--yes"],
            ["schedules", "rm", "s"],
        ]  # fmt: skip
        for command in commands:
            result = run(*command, target=limited)
            assert result.exit_code == 0, (command, result.output)
        add.apply_at((now - 1000) / 1000, (9, 9), task_id="dead")  # requeued, then purged: again
        bury(limited, "dead")
        assert run("dead", "rm", "--all", "--yes", target=limited).exit_code == 0
        assert store_of(limited).count() == 0 and store_of(limited).count_dead() == 0
        refused = {str(e["object"]) for e in r.acl_log() if e.get("username") == user}
        assert refused == set()
        limited.close()
    finally:
        r.execute_command("ACL", "DELUSER", user)


@pytest.mark.cluster
def test_on_a_redis_cluster(redis_url: str, cluster_url: str, run: Run) -> None:
    """status, ls, show, cancel, purge and the dead-letter commands with ``delayq_cluster``."""
    app = make_app(redis_url, delayq_url=cluster_url, delayq_cluster=True)

    add = add_task(app)

    now = int(time.time() * 1000)
    for i in range(40):
        add.apply_at((now + 60_000 + i * 1000) / 1000, (i, i), task_id=f"c{i}")
    add.apply_at((now - 1000) / 1000, (0, 0), task_id="gone")
    bury(app, "gone")
    Schedules(app).add("tick", add, timedelta(minutes=1), args=(1, 1))

    data = as_json(run("status", "--json", target=app))
    assert (data["totals"]["waiting"], data["totals"]["dead"], data["totals"]["schedules"]) == (41, 1, 1)
    assert sum(data["due"]["counts"]) == 41
    listed = as_json(run("ls", "--json", "--limit", "50", target=app))["jobs"]
    assert [j["id"] for j in listed if not j["schedule"]] == [f"c{i}" for i in range(40)]
    assert as_json(run("show", "c7", "--json", target=app))["args"] == [7, 7]
    assert run("cancel", "c0", target=app).exit_code == 0
    assert (
        as_json(run("dead", "requeue", "gone", "--at", "+1h", "--json", target=app))["results"][0]["outcome"]
        == "requeued"
    )
    assert as_json(run("purge", "--yes", "--json", target=app))["removed"] == 40
    assert as_json(run("ls", "--json", target=app))["count"] == 1  # the schedule's next run
    app.close()
