"""Held-back jobs (parked by flow control: waiting for a slot, a paused key, a batch's
completion job) are listed where their due time puts them, marked with what holds them back,
by ``delayq ls``, the dashboard's Jobs page, their JSON and ``DelayQ.pending`` (issue 52: they
were listed after the later jobs of their shard, as if due in 285,000 years, and a window
ending before then left them out)."""

from __future__ import annotations

import re
from collections.abc import Callable

import redis
from celery import Celery

from celery_delayq.admin.jobs import DelayQ
from celery_delayq.flow.gate import completion_id
from celery_delayq.store.facade import get_store
from tests.support.cli import as_json, invoke
from tests.support.store import gate_due, server_ms
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name


def _held_and_later(app: Celery, r: redis.Redis) -> dict[str, str]:
    """Two jobs parked for a slot of tenant:1 (due a second ago), a batch's completion job
    (due when the batch was made: now; its members in 2 hours), and waiting jobs due later:
    one on tenant:1's shard (tomorrow), others on other shards (in 10 minutes, in 2 days)."""
    add = app.tasks["t.add"]
    now = server_ms(r) / 1000
    add.apply_at(now + 86_400, (0, 0), task_id="{tenant:1}tomorrow", concurrency_key="tenant:1",
                 concurrency_limit=1)  # fmt: skip
    add.apply_at(now + 600, (0, 0), task_id="soon")
    add.apply_at(now + 2 * 86_400, (0, 0), task_id="in-two-days")
    DelayQ(app).batch([add.s(1, 2)], eta=now + 7200, batch_id="nightly", on_complete=add.s())
    decisions = gate_due(app, r, "tenant:1", 3, limit=1)
    return {job_id: str(decision) for job_id, decision in decisions.items()}


def test_ls_lists_held_back_jobs_at_their_due_time_marked_held(app: Celery, r: redis.Redis) -> None:
    decisions = _held_and_later(app, r)
    assert sorted(decisions.values()) == ["parked", "parked", "released"]
    listed = as_json(invoke(app, "ls", "--json", "--limit", "100"))["jobs"]
    ids = [j["id"] for j in listed]
    parked = [job_id for job_id, d in decisions.items() if d == "parked"]
    done = completion_id("nightly")
    assert (
        max(ids.index(parked[-1]), ids.index(done)) < ids.index("soon") < ids.index("{tenant:1}tomorrow")
    ), ids
    assert [j["due_ms"] for j in listed if j["state"] == "gated"] == sorted(
        j["due_ms"] for j in listed if j["state"] == "gated"
    )
    by_id = {j["id"]: j for j in listed}
    assert [by_id[i]["gated_by"] for i in parked] == ["slot", "slot"]
    assert by_id[done]["gated_by"] == "batch"
    assert by_id["soon"]["gated_by"] is None
    text = invoke(app, "ls", "--limit", "100").stdout
    rows = [line.split()[0] for line in text.splitlines()[1:] if line.strip()]
    assert rows == ids, text
    assert re.search(rf"^{re.escape(parked[0])}\s+gated: waiting for a slot\s", text, flags=re.M), text
    assert re.search(rf"^{re.escape(done)}\s+gated: batch not complete\s", text, flags=re.M), text
    # page by page, with the cursor: the same order
    paged: list[str] = []
    cursor: list[str] = []
    while True:
        page = as_json(invoke(app, "ls", "--json", "--limit", "2", *cursor))
        paged += [j["id"] for j in page["jobs"]]
        if not page["next_cursor"]:
            break
        cursor = ["--cursor", page["next_cursor"]]
    assert paged == ids


def test_pending_lists_held_back_jobs_in_due_order_and_in_their_window(app: Celery, r: redis.Redis) -> None:
    decisions = _held_and_later(app, r)
    parked = sorted(job_id for job_id, d in decisions.items() if d == "parked")
    now = server_ms(r) / 1000
    dq = DelayQ(app)
    ids = [job.id for job in dq.pending()]
    assert max(ids.index(parked[-1]), ids.index(completion_id("nightly"))) < ids.index("soon"), ids
    within = [job for job in dq.pending(end=now + 3 * 3600)]
    assert {j.id for j in within if j.state == "gated"} == {*parked, completion_id("nightly")}
    assert "{tenant:1}tomorrow" not in {j.id for j in within}
    assert [j.id for j in dq.pending(start=now + 3 * 3600)] == ["{tenant:1}tomorrow", "in-two-days"]


def test_the_dashboards_jobs_page_lists_held_back_jobs_in_due_order(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    decisions = _held_and_later(app, r)
    parked = sorted(job_id for job_id, d in decisions.items() if d == "parked")
    page = dashboard().get("/jobs?limit=100").text
    ids = re.findall(r'<tr data-job-id="([^"]*)"', page)
    assert ids.index(parked[-1]) < ids.index("soon") < ids.index("{tenant:1}tomorrow"), ids
    assert page.count('<span class="held muted">waiting for a slot</span>') == 2
    assert '<span class="held muted">batch not complete</span>' in page


def test_a_running_job_is_listed_at_its_slot_s_expiry_as_the_docs_say(app: Celery, r: redis.Redis) -> None:
    """A job its gate key released (*running*) is ordered by its slot's expiry (``lease_until``,
    60 s after the release here), as a leased job is by its lease expiry: after a job due in
    30 s, though its own due time is a second ago (docs/cli.md's ``ls``, docs/api.md's
    ``pending``; a new user reading "in due order" saw it listed out of order)."""
    decisions = _held_and_later(app, r)
    app.tasks["t.add"].apply_at(server_ms(r) / 1000 + 30, (0, 0), task_id="in-30s")
    [released] = [job_id for job_id, d in decisions.items() if d == "released"]
    # a worker took it over: its slot now lasts 60 s
    assert get_store(app).renew_slots([(released, "tenant:1")], 60_000) == {released: True}
    listed = as_json(invoke(app, "ls", "--json", "--limit", "100"))["jobs"]
    ids = [j["id"] for j in listed]
    by_id = {j["id"]: j for j in listed}
    running = by_id[released]
    assert running["state"] == "running" and running["lease_until"] is not None
    assert running["due_ms"] < server_ms(r) < by_id["in-30s"]["due_ms"]
    assert ids.index("in-30s") < ids.index(released) < ids.index("soon"), ids
    pending = [job.id for job in DelayQ(app).pending()]
    assert pending.index("in-30s") < pending.index(released) < pending.index("soon"), pending
