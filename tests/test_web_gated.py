"""Jobs held back by flow control are counted as what they are, not as "being delivered":
the jobs of a paused key, of a full (capped) key, a batch's completion job and a job deferred
by its key's rate, each put in that state by the real claim and gate scripts (as a beat does),
counted the same by ``delayq status --json``, ``/api/status``, the overview page and the CLI's
table, and each job's page says what it waits for."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_delayq import DelayQ
from celery_delayq.admin.status import status_view
from celery_delayq.beat.routing import message_headers
from celery_delayq.flow.gate import GATE_HEADER, Gate, completion_id
from celery_delayq.store.envelope import decode_envelope
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.flow import GateDecision
from tests.support.cli import as_json, invoke
from tests.support.store import server_ms
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

TOKEN = "beat-gated-test"


def text_of(page: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', page, flags=re.S)
    assert found, f"no #{element_id} on the page"
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1))).strip()


def hold_released(
    store: Store, decisions: dict[str, GateDecision], key: str, token: str = TOKEN
) -> list[str]:
    """Mark the released jobs running, as the beat does after publishing them."""
    released = [job_id for job_id, d in decisions.items() if d == GateDecision.RELEASED]
    by_shard: dict[int, list[tuple[str, str]]] = {}
    for job_id in released:
        by_shard.setdefault(store.keys.shard_of(job_id), []).append((job_id, key))
    assert all(store.hold(token, by_shard, 60_000).values())
    return released


def gate_stored(app: Celery, r: redis.Redis, n: int, **options: Any) -> dict[str, GateDecision]:
    """``n`` jobs stored due with gate ``options`` (as ``apply_at`` takes them), claimed and
    passed through the gate with the gate their message carries, as a beat does."""
    store = get_store(app)
    now = server_ms(r)
    ids = [str(app.tasks["t.add"].apply_at((now - 1000 + i) / 1000, (i, i), **options).id) for i in range(n)]
    shard = store.keys.shard_of(ids[0])
    [claimed] = store.claim([shard], TOKEN)
    assert sorted(j.id for j in claimed.jobs) == sorted(ids)
    gates = []
    for job in sorted(claimed.jobs, key=lambda j: ids.index(j.id)):
        gate = Gate.from_header(message_headers(decode_envelope(job.envelope)).get(GATE_HEADER))
        assert gate is not None
        gates.append((job.id, gate))
    decided = store.gate(TOKEN, {shard: gates}, 60_000)
    return {job_id: decided[job_id].decision for job_id in ids}


def store_gated(app: Celery, r: redis.Redis) -> dict[str, Any]:
    """Each kind of gated job, one plain job a beat holds, and a batch with a completion job."""
    store = get_store(app)
    store.pause("tenant:p")
    paused = gate_stored(app, r, 3, concurrency_key="tenant:p", concurrency_limit=5)
    assert set(paused.values()) == {GateDecision.PARKED}

    full = gate_stored(app, r, 3, concurrency_key="tenant:f", concurrency_limit=1)
    assert list(full.values()) == [GateDecision.RELEASED, GateDecision.PARKED, GateDecision.PARKED]
    [running] = hold_released(store, full, "tenant:f")

    rated = gate_stored(app, r, 2, rate_limit_key="tenant:r", rate_limit="1/m")
    assert list(rated.values()) == [GateDecision.RELEASED, GateDecision.DEFERRED]
    hold_released(store, rated, "tenant:r")
    now = server_ms(r)

    batch = DelayQ(app).batch(
        [app.tasks["t.add"].s(i, i) for i in range(2)],
        eta=(now + 3_600_000) / 1000,
        on_complete=app.tasks["t.add"].s(),
        batch_id="nightly",
    )
    plain = "plain-1"
    app.tasks["t.add"].apply_at((now - 500) / 1000, (1, 1), task_id=plain)
    [held] = store.claim([store.keys.shard_of(plain)], "beat-other")
    assert [j.id for j in held.jobs] == [plain]
    return {
        "paused": sorted(paused),
        "full": sorted(j for j, d in full.items() if d == GateDecision.PARKED),
        "running": running,
        "deferred": list(rated)[1],
        "completion": completion_id(batch.id),
        "plain": plain,
    }


def test_status_counts_each_gated_job_by_what_it_waits_for(app: Celery, r: redis.Redis) -> None:
    store_gated(app, r)
    totals = status_view(get_store(app), "redis://x")["totals"]
    assert totals["leased"] == 1  # the plain job a beat holds: the only one being delivered
    assert totals["running"] == 2  # the full key's released job and the rate's released one
    assert totals["gated_by"] == {"slot": 2, "paused": 3, "batch": 1, "rate": 1}
    assert totals["gated"] == 7
    assert totals["waiting"] == 2  # the batch's two members, due in an hour

    printed = as_json(invoke(app, "status", "--json"))
    assert printed["totals"]["gated_by"] == totals["gated_by"]
    assert (printed["totals"]["leased"], printed["totals"]["running"]) == (1, 2)
    assert sum(s["gated"] for s in printed["shards"]) == 7
    table = invoke(app, "status").stdout
    assert "LEASED  RUNNING  GATED" in table
    assert (
        "gated (held back by flow control; no beat holds them): 2 waiting for a slot, 3 key paused, "
        "1 batch not complete, 1 deferred by rate"
    ) in table


def test_the_overview_puts_a_paused_keys_jobs_under_their_own_heading(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    store_gated(app, r)
    client = dashboard()
    page = client.get("/").text
    assert "Held back by flow control" in page
    assert text_of(page, "total-leased") == "1"
    assert text_of(page, "total-running") == "2"
    assert text_of(page, "gated-paused") == "3"
    assert text_of(page, "gated-slot") == "2"
    assert text_of(page, "gated-batch") == "1"
    assert text_of(page, "gated-rate") == "1"
    served = client.get("/api/status").json()["totals"]
    assert served["gated_by"] == {"slot": 2, "paused": 3, "batch": 1, "rate": 1}


def test_each_gated_jobs_page_says_what_it_waits_for(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    ids = store_gated(app, r)
    client = dashboard()
    expected = {
        ids["paused"][0]: ("key paused", "key 'tenant:p' is paused: released when it is resumed"),
        ids["full"][0]: (
            "waiting for a slot",
            "waiting for a slot: key 'tenant:f' runs 1 job(s), its limit of 1",
        ),
        ids["completion"]: ("batch not complete", "batch 'nightly' not complete: 0 of 2 members ended"),
        ids["deferred"]: ("deferred by rate", "deferred by the rate of key 'tenant:r'"),
    }
    for job_id, (label, reason) in expected.items():
        page = client.get(f"/jobs/{job_id}")
        assert page.status == 200
        assert text_of(page.text, "job-state") == "gated"
        assert text_of(page.text, "job-gated-by") == label
        assert text_of(page.text, "job-gated-reason").startswith(reason), text_of(
            page.text, "job-gated-reason"
        )
    printed = " ".join(invoke(app, "show", ids["completion"]).stdout.split())
    assert "waits for batch 'nightly' not complete: 0 of 2 members ended" in printed
    shown = as_json(invoke(app, "show", ids["paused"][0], "--json"))
    assert shown["gated_by"] == "paused" and shown["gated_reason"].startswith("key 'tenant:p' is paused")
    # the command the reason names is the CLI's own, and resumes the key
    command = shown["gated_reason"].split("`")[1].split()
    assert command == ["celery", "delayq", "resume", "tenant:p"]
    assert invoke(app, *command[2:]).exit_code == 0
    assert as_json(invoke(app, "show", ids["paused"][0], "--json"))["gated_by"] != "paused"
    plain = client.get(f"/jobs/{ids['plain']}").text
    assert text_of(plain, "job-state") == "leased" and 'id="job-gated-by"' not in plain
    running = as_json(invoke(app, "show", ids["running"], "--json"))
    assert (running["state"], running["gated_by"]) == ("running", None)
