"""``celery delayq keys|key|limit|pause|resume|batches|batch``: through click's CliRunner on the
real test Redis, with the gate's state made by the store's own scripts (claim, gate, release,
open_batch), as a beat and a worker make it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_delayq.cli import delayq
from celery_delayq.cli.errors import cli_error
from celery_delayq.exceptions import BatchExists, InvalidBatch
from celery_delayq.flow.gate import member_id
from celery_delayq.store.facade import GateDecision, Store, get_store
from tests.support.acl import documented_rule, server_kind
from tests.support.apps import make_app
from tests.support.cli import as_json, invoke
from tests.support.store import gate_due, open_batch, server_ms


@pytest.fixture
def cli(app: Celery) -> Callable[..., Result]:
    """``cli("keys", "--json")``: the ``delayq`` group run as ``celery -A app`` runs it."""

    def run(*args: str) -> Result:
        return invoke(app, *args)

    return run


def test_keys_key_limit_pause_resume(app: Celery, r: redis.Redis, cli: Any) -> None:
    assert cli("keys").stdout.strip() == "no gate keys"
    assert as_json(cli("keys", "--json")) == {"keys": [], "count": 0}
    decisions = gate_due(app, r, "tenant:42", 5, limit=2)
    assert sorted(decisions.values()) == sorted([GateDecision.RELEASED] * 2 + [GateDecision.PARKED] * 3)
    gate_due(app, r, "tenant:7", 1, limit=None)

    listed = as_json(cli("keys", "--json"))
    assert listed["count"] == 2
    assert listed["keys"][0] == {
        "key": "tenant:42", "limit": 2, "override": None,
        "running": 2, "waiting": 3, "paused": False,
    }  # fmt: skip
    assert listed["keys"][1]["key"] == "tenant:7" and listed["keys"][1]["limit"] is None
    out = cli("keys").stdout
    assert re.search(r"^KEY\s+LIMIT\s+RUNNING\s+WAITING\s+PAUSED$", out, flags=re.M), out
    assert re.search(r"^tenant:42\s+2\s+2\s+3\s+-$", out, flags=re.M), out
    assert re.search(r"^tenant:7\s+none\s+1\s+0\s+-$", out, flags=re.M), out

    # A run-time limit wins over the jobs' own: raised to 4, two waiting jobs are released.
    raised = cli("limit", "tenant:42", "4")
    assert raised.exit_code == 0, raised.output
    assert raised.stdout.strip() == (
        "tenant:42: run-time limit 4; limit in force: 4; 2 waiting job(s) released"
    )
    shown = as_json(cli("key", "tenant:42", "--json"))
    assert (shown["limit"], shown["override"]) == (4, "4")
    assert (shown["waiting"], shown["running"]) == (1, 2)  # released: due again, not yet running
    assert re.search(r"^tenant:42\s+4 \(set\)\s+2\s+1\s+-$", cli("keys").stdout, flags=re.M)
    text = cli("key", "tenant:42").stdout
    assert re.search(r"^limit in force\s+4$", text, flags=re.M), text
    assert re.search(r"^set at run time\s+4$", text, flags=re.M), text

    # Paused: a resume releases nothing more than the limit allows; none = no cap.
    paused = as_json(cli("pause", "tenant:42", "--json"))
    assert paused["paused"] is True and paused["released"] == 0
    assert re.search(r"^tenant:42\s+4 \(set\)\s+2\s+1\s+paused$", cli("keys").stdout, flags=re.M)
    none = as_json(cli("limit", "tenant:42", "none", "--json"))
    assert (none["limit"], none["override"], none["released"]) == (None, "none", 0)  # paused: nothing
    resumed = cli("resume", "tenant:42")
    assert resumed.stdout.strip() == "tenant:42: resumed; 1 waiting job(s) released"
    cleared = as_json(cli("limit", "tenant:42", "--clear", "--json"))
    assert (cleared["limit"], cleared["override"], cleared["paused"]) == (2, None, False)


def test_limit_and_key_bad_input(cli: Any) -> None:
    for args in (["limit", "k", "0"], ["limit", "k", "--", "-1"], ["limit", "k", "x"], ["limit", "k", "1.5"],
                 ["limit", "k"], ["limit", "k", "3", "--clear"], ["key", "a{b}"], ["pause", ""],
                 ["limit", "a|b", "3"]):  # fmt: skip
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1, args
        assert result.stdout == ""
    assert "a limit is a whole number >= 1, or 'none'; got 'x'" in cli("limit", "k", "x").stderr
    assert "N=0: a concurrency limit is a whole number >= 1" in cli("limit", "k", "0").stderr
    assert cli("limit", "k", "-1").exit_code == 2  # click's own: an unknown option


def test_batches_batch_and_cancel(app: Celery, r: redis.Redis, cli: Any) -> None:
    assert cli("batches").stdout.strip() == "no batches"
    store: Store = get_store(app)
    now = server_ms(r)
    open_batch(app, "b1", 4, (now + 3_600_000) / 1000)
    assert store.open_batch("b0", 1, None, {})

    listed = as_json(cli("batches", "--json"))
    assert listed["count"] == 2 and {b["id"] for b in listed["batches"]} == {"b0", "b1"}
    one = as_json(cli("batch", "b1", "--json"))
    counts = ("total", "waiting", "running", "succeeded", "failed", "cancelled", "done")
    assert {k: one[k] for k in counts} == {
        "total": 4, "waiting": 4, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "done": False,
    }  # fmt: skip
    assert one["created"].endswith("Z") and abs(one["created_ms"] - now) < 60_000
    out = cli("batches").stdout
    assert re.search(r"^BATCH\s+CREATED\s+TOTAL\s+WAITING\s+RUNNING\s+SUCCEEDED\s+FAILED\s+CANCELLED\s+DONE$",
                     out, flags=re.M), out  # fmt: skip
    assert re.search(r"^b1\s+\S+ \S+Z\s+4\s+4\s+0\s+0\s+0\s+0\s+-$", out, flags=re.M), out

    missing = cli("batch", "nope")
    assert (missing.exit_code, missing.stderr.strip()) == (1, "Error: no batch with id 'nope'")
    assert missing.stdout == ""
    assert cli("batch", "nope", "--cancel").exit_code == 1

    cancelled = cli("batch", "b1", "--cancel")
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.startswith("b1: 4 waiting member(s) cancelled\n")
    assert re.search(r"^done\s+yes$", cancelled.stdout, flags=re.M), cancelled.stdout
    after = as_json(cli("batch", "b1", "--json"))
    assert (after["cancelled"], after["waiting"], after["done"]) == (4, 0, True)
    assert store.get(member_id("b1", 0)) is None
    again = as_json(cli("batch", "b1", "--cancel", "--json"))
    assert again["cancelled_now"] == 0 and again["cancelled"] == 4


def test_batch_errors_through_the_table() -> None:
    url = "redis://127.0.0.1:1/0"
    exists = cli_error(BatchExists("a batch with id 'b1' is stored"), url)
    assert (exists.exit_code, exists.message) == (1, "a batch with id 'b1' is stored")
    empty = cli_error(InvalidBatch("a batch needs at least one member"), url)
    assert (empty.exit_code, empty.message) == (2, "a batch needs at least one member")


def test_every_flow_command_works_with_the_documented_acl_user(app: Celery, r: redis.Redis, cli: Any) -> None:
    """The flow commands need no command or channel beyond docs/security.md's rule."""
    user, password = "delayq-flow-cli", "flow-secret"
    r.execute_command("ACL", "SETUSER", *documented_rule(user, password, server_kind(r)))
    r.execute_command("ACL", "LOG", "RESET")
    try:
        gate_due(app, r, "tenant:42", 3, limit=1)
        store: Store = get_store(app)
        assert store.open_batch("b1", 2, None, {})
        for i in range(2):
            app.tasks["t.add"].apply_at(time.time() + 3600, (i, i), task_id=member_id("b1", i))
        url = str(app.conf.broker_url)
        limited = make_app(url, delayq_url=url.replace("redis://", f"redis://{user}:{password}@"))
        obj = CLIContext(app=limited, no_color=True, workdir=None)
        commands = [
            ["keys"], ["keys", "--json"], ["key", "tenant:42"], ["limit", "tenant:42", "2"],
            ["limit", "tenant:42", "none"], ["limit", "tenant:42", "--clear"], ["pause", "tenant:42"],
            ["resume", "tenant:42"], ["batches"], ["batch", "b1", "--json"], ["batch", "b1", "--cancel"],
        ]  # fmt: skip
        for command in commands:
            result = CliRunner().invoke(delayq, command, obj=obj)
            assert result.exit_code == 0, (command, result.output)
        refused = {str(e["object"]) for e in r.acl_log() if e.get("username") == user}
        assert refused == set()
        limited.close()
    finally:
        r.execute_command("ACL", "DELUSER", user)


def test_ls_and_show_list_gated_jobs(app: Celery, r: redis.Redis, cli: Any) -> None:
    """A parked job (score PARK_MS, beyond any datetime) is listed and shown as "gated", with no
    lease expiry; a released one as "leased" (the beat holds it until its hold)."""
    decided = gate_due(app, r, "t:ls", 2, 1)
    assert sorted(decided.values()) == [GateDecision.PARKED, GateDecision.RELEASED]
    parked = next(job_id for job_id, decision in decided.items() if decision is GateDecision.PARKED)
    rows = {row["id"]: row for row in as_json(cli("ls", "--json"))["jobs"]}
    assert rows[parked]["state"] == "gated" and rows[parked]["lease_until"] is None
    shown = cli("show", parked)
    assert shown.exit_code == 0 and "gated" in shown.output
    assert as_json(cli("show", parked, "--json"))["state"] == "gated"
    status = cli("status")
    assert status.exit_code == 0, status.output
    # a shard whose only job is parked: its "next due" is no time
    r.flushdb()
    get_store(app).pause("t:alone")
    assert gate_due(app, r, "t:alone", 1, 1) == {"{t:alone}job-0": GateDecision.PARKED}
    for args in (("status",), ("status", "--json"), ("ls",)):
        result = cli(*args)
        assert result.exit_code == 0, result.output
