"""Batches end (issue 25): a finished batch and its gate key's record expire after
``delayq_batch_expires``, set in the same script step that finishes it; an unfinished batch
never expires; ``Store.delete_batch`` (``celery delayq batch ID --delete [--force]``, the
dashboard's delete button) removes one now. Real Redis, the real scripts: members go through
claim, gate, hold and release as a beat and a worker move them."""

from __future__ import annotations

import html
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.beat.chores import BATCH_SWEEP_EVERY
from celery_delayq.devtools.embedded import EmbeddedRedis
from celery_delayq.exceptions import CorruptData, StoreFull
from celery_delayq.flow.gate import Gate, batch_key, completion_id, member_id
from celery_delayq.store.facade import Store, get_store
from celery_delayq.store.flow import GateDecision
from tests.support.cli import as_json, invoke
from tests.support.flow import FlowProducer, read_done, start_flow_stack, warm_up_flow
from tests.support.polling import wait_for
from tests.support.processes import Procs
from tests.support.stack import assert_alive, env_for
from tests.support.store import make_full, make_store, open_batch, server_ms, snapshot
from tests.support.web import Client, dashboard

__all__ = ["dashboard"]  # a fixture, used by name

TOKEN = "beat-expiry"


@pytest.fixture
def keep60(redis_url: str) -> Iterator[Store]:
    """A store keeping finished batches 60 s."""
    s = make_store(redis_url, reclaim_ttl=30.0, batch_expires=60)
    yield s
    s.close()


def open_with_members(store: Store, r: redis.Redis, bid: str, n: int) -> list[str]:
    """Batch ``bid`` of ``n`` members (and an on_complete) stored due 1 s ago."""
    assert store.open_batch(bid, n, (completion_id(bid), "on-complete"), {})
    ids = [member_id(bid, i) for i in range(n)]
    now = server_ms(r) - 1000
    store.enqueue([(job_id, now, "env-" + job_id) for job_id in ids])
    return ids


def release_all(store: Store, bid: str, ids: list[str]) -> dict[str, str]:
    """Claim, gate and hold ``ids`` as a beat does (each one released into a slot); their
    worker has them running. Returns ``{id: "running"}``."""
    key = batch_key(bid)
    shard = store.keys.shard_of(key)
    [claimed] = store.claim([shard], TOKEN)
    mine = [job.id for job in claimed.jobs if job.id in ids]
    assert sorted(mine) == sorted(ids)
    gated = store.gate(TOKEN, {shard: [(job_id, Gate(key, None, batch=bid)) for job_id in ids]}, 60_000)
    assert {g.decision for g in gated.values()} == {GateDecision.RELEASED}
    assert all(store.hold(TOKEN, {shard: [(job_id, key) for job_id in ids]}, 60_000).values())
    return dict.fromkeys(ids, "running")


def batch_hash(store: Store, bid: str) -> str:
    return store.keys.for_key(batch_key(bid)).batch(bid)


def leftovers(store: Store, r: redis.Redis, bid: str) -> list[str]:
    """Every record of batch ``bid`` in the store: keys named after it, and its id or key in
    the shard's sets and hashes."""
    names = store.keys.for_key(batch_key(bid))
    found = [k for k in r.keys("*") if bid in k and not k.endswith((":due", ":jobs", ":leases"))]
    if r.sismember(names.batches, bid):
        found.append("batches")
    if r.zscore(names.batch_expiry, bid) is not None:
        found.append("batches:expiry")
    for hashed in (names.gate_keys, names.gate_rates):
        if r.hexists(hashed, batch_key(bid)):
            found.append(hashed)
    return found


def test_the_release_that_finishes_a_batch_sets_its_expiry_in_the_same_step(
    keep60: Store, r: redis.Redis
) -> None:
    """Two members: after the first release the batch has no TTL; the last release marks it
    done and, in that one script call, gives its hash a TTL of 60 s, an ``expires`` time and an
    entry in ``batches:expiry`` with the same time."""
    store = keep60
    ids = open_with_members(store, r, "b1", 2)
    release_all(store, "b1", ids)
    assert store.release(ids[0], batch_key("b1"), "succeeded", "b1").batch_done is False
    assert r.pttl(batch_hash(store, "b1")) == -1
    state = store.batch_state("b1")
    assert state is not None and state.expires_ms is None
    before = server_ms(r)
    assert store.release(ids[1], batch_key("b1"), "failed", "b1").batch_done is True
    after = server_ms(r)
    ttl = r.pttl(batch_hash(store, "b1"))
    assert 50_000 < ttl <= 60_000
    state = store.batch_state("b1")
    assert state is not None and state.done and state.expires_ms is not None
    assert before + 60_000 <= state.expires_ms <= after + 60_000
    names = store.keys.for_key(batch_key("b1"))
    assert r.zscore(names.batch_expiry, "b1") == state.expires_ms
    assert store.batch_states() == [state]


def test_a_batch_finished_by_cancel_expires_too(keep60: Store, r: redis.Redis) -> None:
    ids = open_with_members(keep60, r, "b2", 3)
    assert keep60.cancel_batch("b2") == len(ids)
    state = keep60.batch_state("b2")
    assert state is not None and state.done and state.cancelled == 3 and state.expires_ms is not None
    assert 50_000 < r.pttl(batch_hash(keep60, "b2")) <= 60_000


def test_an_unfinished_batch_never_expires(redis_url: str, r: redis.Redis) -> None:
    """Kept 1 ms once finished: a batch whose members run is not finished, so it has no TTL,
    no expiry entry, and the sweep leaves it and its key's records alone."""
    store = make_store(redis_url, reclaim_ttl=30.0, batch_expires=0.001)
    ids = open_with_members(store, r, "b3", 2)
    release_all(store, "b3", ids)
    store.release(ids[0], batch_key("b3"), "succeeded", "b3")
    assert store.sweep_batches() == 0
    assert r.pttl(batch_hash(store, "b3")) == -1
    state = store.batch_state("b3")
    assert state is not None and not state.done and state.running == 1
    assert [k.key for k in store.key_states()] == [batch_key("b3")]
    store.close()


def test_kept_until_deleted_when_the_setting_is_none(redis_url: str, r: redis.Redis) -> None:
    store = make_store(redis_url, reclaim_ttl=30.0, batch_expires=None)
    open_with_members(store, r, "b4", 1)
    store.cancel_batch("b4")
    state = store.batch_state("b4")
    assert state is not None and state.done and state.expires_ms is None
    assert r.pttl(batch_hash(store, "b4")) == -1
    assert r.zcard(store.keys.for_key(batch_key("b4")).batch_expiry) == 0
    store.close()


@pytest.mark.slow
def test_an_expired_batch_leaves_the_listings_and_the_sweep_removes_its_key_record(
    redis_url: str, r: redis.Redis
) -> None:
    """Kept 0.3 s: the finished batch and its gate key are listed; once its time passed its
    hash is gone (Redis expired it), and one sweep removes its id and its key's records: nothing
    of it is left, and another finished batch not expired yet is left alone."""
    store = make_store(redis_url, reclaim_ttl=30.0, batch_expires=0.3)
    ids = open_with_members(store, r, "old", 2)
    release_all(store, "old", ids)
    for job_id in ids:
        store.release(job_id, batch_key("old"), "succeeded", "old")
    assert [b.batch_id for b in store.batch_states()] == ["old"]
    assert [k.key for k in store.key_states()] == [batch_key("old")]
    assert wait_for(lambda: store.batch_state("old") is None, 10, 0.05)
    assert store.batch_states() == []
    keeper = make_store(redis_url, reclaim_ttl=30.0, batch_expires=600)
    open_with_members(keeper, r, "young", 1)
    keeper.cancel_batch("young")
    assert store.sweep_batches() == 1
    assert leftovers(store, r, "old") == []
    assert [k.key for k in store.key_states()] == []
    assert [b.batch_id for b in store.batch_states()] == ["young"]
    assert store.sweep_batches() == 0
    keeper.close()
    store.close()


# -- delete ------------------------------------------------------------------------------------------


def test_delete_removes_a_finished_batch_and_refuses_an_unfinished_one(keep60: Store, r: redis.Redis) -> None:
    store = keep60
    ids = open_with_members(store, r, "done", 1)
    release_all(store, "done", ids)
    store.release(ids[0], batch_key("done"), "succeeded", "done")
    assert store.delete_batch("done") == "deleted"
    assert leftovers(store, r, "done") == []
    assert store.batch_state("done") is None

    pending = open_with_members(store, r, "pending", 2)
    state = snapshot(redis_url_of(store))
    assert store.delete_batch("pending") == "pending"
    assert snapshot(redis_url_of(store)) == state
    assert store.get(pending[0]) is not None
    assert store.delete_batch("nope") == "missing"


def test_force_delete_cancels_waiting_members_and_the_completion_job(keep60: Store, r: redis.Redis) -> None:
    """One member running, two waiting: --force cancels the waiting ones, removes the parked
    completion job and the batch; the running member's release later finds no batch and counts
    nothing; nothing of the batch is left then."""
    store = keep60
    ids = open_with_members(store, r, "f", 3)
    key = batch_key("f")
    shard = store.keys.shard_of(key)
    [claimed] = store.claim([shard], TOKEN, 1)
    [first] = [job.id for job in claimed.jobs]
    store.gate(TOKEN, {shard: [(first, Gate(key, None, batch="f"))]}, 60_000)
    store.hold(TOKEN, {shard: [(first, key)]}, 60_000)
    assert store.delete_batch("f", force=True) == "deleted"
    assert [store.get(j) is None for j in ids if j != first] == [True, True]
    assert store.get(completion_id("f")) is None
    assert store.batch_state("f") is None
    result = store.release(first, key, "succeeded", "f")
    assert result.released and not result.batch_done
    assert store.get(first) is None
    assert leftovers(store, r, "f") == []


def redis_url_of(store: Store) -> str:
    kwargs = store.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db') or 0}"


# -- faults ------------------------------------------------------------------------------------------


def test_a_corrupt_batch_hash(keep60: Store, r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Counts that do not read: the batch is not finished, so delete refuses it and --force
    deletes it. A batch key written as a string: CorruptData with the key, nothing changed."""
    store = keep60
    open_with_members(store, r, "c1", 1)
    r.hset(batch_hash(store, "c1"), mapping={"total": "many", "succeeded": "x"})
    assert store.delete_batch("c1") == "pending"
    assert store.delete_batch("c1", force=True) == "deleted"
    assert leftovers(store, r, "c1") == []

    r.set(batch_hash(store, "c2"), "not a hash")
    state = snapshot(redis_url_of(store))
    for force in (False, True):
        with pytest.raises(CorruptData, match=r"batch 'c2': .* is not a hash \(written by hand\)"):
            store.delete_batch("c2", force=force)
    assert snapshot(redis_url_of(store)) == state
    # the sweep meets it (an expiry entry long past): it says so once and goes on with the others
    expiry = store.keys.for_key(batch_key("c2")).batch_expiry
    r.zadd(expiry, {"c2": 1})
    open_with_members(store, r, "c3", 1)
    store.cancel_batch("c3")
    r.zadd(store.keys.for_key(batch_key("c3")).batch_expiry, {"c3": 1})
    with caplog.at_level(logging.WARNING, logger="celery_delayq.store.batches"):
        assert store.sweep_batches() == 1
    assert "1 expired batch(es) not removed" in caplog.text and "is not a hash" in caplog.text
    assert leftovers(store, r, "c3") == [] and r.get(batch_hash(store, "c2")) == "not a hash"
    r.delete(batch_hash(store, "c2"), expiry)


def test_a_full_redis_still_finishes_expires_deletes_and_sweeps(each_server: EmbeddedRedis) -> None:
    """Over maxmemory, on each server kind (Redis 6.2 takes the scripts without flags): opening
    a batch, and adding to an open one, is refused (StoreFull); sealing one runs; the release
    that finishes one runs and sets its expiry (a
    full Redis never leaves a finished batch without one), and deleting and sweeping, which
    only remove, run too."""
    r = redis.Redis.from_url(each_server.url, decode_responses=True)
    r.flushall()
    store = make_store(each_server.url + "/0", reclaim_ttl=30.0, batch_expires=0.2)
    ids = open_with_members(store, r, "full", 1)
    release_all(store, "full", ids)
    other = open_with_members(store, r, "other", 1)
    store.cancel_batch("other")  # finished: a delete target
    assert store.open_batch("open", 0, None, {}, open_ms=60_000)  # an open batch (open_batch)
    make_full(r)
    try:
        with pytest.raises(StoreFull, match="batch 'refused' not opened"):
            store.open_batch("refused", 1, None, {})
        with pytest.raises(StoreFull, match="batch 'open': no member added"):
            store.grow_batch("open", 1)
        assert store.seal_batch("open") == ("sealed", True)  # no member: complete at the seal
        assert store.release(ids[0], batch_key("full"), "succeeded", "full").batch_done
        assert 0 < r.pttl(batch_hash(store, "full")) <= 200
        assert store.delete_batch("other") == "deleted"
        assert leftovers(store, r, "other") == [] and other
        assert wait_for(lambda: store.batch_state("full") is None, 10, 0.05)
        assert store.sweep_batches() == 2  # "full" and "open" (sealed, finished before it)
        assert leftovers(store, r, "full") == [] and leftovers(store, r, "open") == []
    finally:
        r.config_set("maxmemory", 0)
        r.flushall()
        r.close()
        store.close()


# -- the command line and the dashboard ---------------------------------------------------------------


def test_the_cli_deletes_a_finished_batch_and_refuses_an_unfinished_one_in_one_line(
    app: Celery, r: redis.Redis
) -> None:
    store = get_store(app)
    open_batch(app, "b1", 2, (server_ms(r) + 3_600_000) / 1000)
    refused = invoke(app, "batch", "b1", "--delete")
    assert refused.exit_code == 1, refused.output
    assert refused.output.strip().splitlines() == [
        "Error: batch 'b1' is not finished (members waiting or running): cancel it first (--cancel), "
        "or delete it anyway with --delete --force"
    ]
    assert store.batch_state("b1") is not None
    assert invoke(app, "batch", "b1", "--force").exit_code == 2
    assert invoke(app, "batch", "b1", "--cancel", "--delete").exit_code == 2
    shown = as_json(invoke(app, "batch", "b1", "--cancel", "--json"))
    assert shown["done"] and shown["expires_ms"] is not None and shown["expires"].endswith("Z")
    deleted = invoke(app, "batch", "b1", "--delete")
    assert (deleted.exit_code, deleted.output) == (0, "b1: deleted\n")
    assert as_json(invoke(app, "batches", "--json"))["batches"] == []
    assert invoke(app, "keys", "--json").exit_code == 0
    assert batch_key("b1") not in [k["key"] for k in as_json(invoke(app, "keys", "--json"))["keys"]]
    missing = invoke(app, "batch", "b1", "--delete")
    assert (missing.exit_code, missing.output) == (1, "Error: no batch with id 'b1'\n")

    open_batch(app, "b2", 2, (server_ms(r) + 3_600_000) / 1000)
    forced = invoke(app, "batch", "b2", "--delete", "--force", "--json")
    assert forced.exit_code == 0 and as_json(forced) == {"id": "b2", "deleted": True}
    assert store.get(member_id("b2", 0)) is None and store.batch_state("b2") is None


def form_of(page: str, action: str) -> list[tuple[str, str]]:
    """The fields of the page's form whose button has value ``action``, as a browser sends
    them when that button is pressed (hidden inputs, then the button)."""
    for form in re.findall(r"<form .*?</form>", page, flags=re.S):
        if f'name="action" value="{action}"' in form:
            hidden = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)
            return [(name, html.unescape(value)) for name, value in hidden] + [("action", action)]
    raise AssertionError(f"no form with a {action!r} button on the page")


@pytest.mark.slow
def test_the_batch_page_deletes_and_lands_on_the_batches_list(
    app: Celery, r: redis.Redis, dashboard: Callable[..., Client]
) -> None:
    """A finished batch's page has a delete button: pressed (the page's own form, its CSRF
    token and next), the batch is gone and the answer is the batches list (200), never the
    deleted batch's page. An unfinished batch's page offers delete with its waiting members
    cancelled; a plain delete of it is refused with a message, on the list (200). Read-only:
    403, nothing deleted."""
    store = get_store(app)
    open_batch(app, "fin", 1, (server_ms(r) + 3_600_000) / 1000)
    store.cancel_batch("fin")
    open_batch(app, "run", 2, (server_ms(r) + 3_600_000) / 1000)
    assert dashboard().action("/batches/action", [("action", "delete"), ("id", "fin")]).status == 403
    client = dashboard(allow_actions=True)

    page = client.get("/batches/fin").text
    assert 'id="batch-expires"' in page and "never" not in page.split('id="batch-expires">')[1][:40]
    answer = client.post("/batches/action", form_of(page, "delete"))
    assert answer.status == 303 and answer.location.endswith("/batches"), answer.location
    landed = client.follow(answer)
    assert landed.status == 200 and "fin: deleted" in html.unescape(landed.text)
    assert store.batch_state("fin") is None and client.get("/batches/fin").status == 404

    page = client.get("/batches/run").text
    assert 'value="delete"' not in page
    refused = client.post("/batches/action", [*form_of(page, "force-delete")[:-1], ("action", "delete")])
    landed = client.follow(refused)
    assert landed.status == 200 and "run: not finished" in html.unescape(landed.text)
    assert store.batch_state("run") is not None
    answer = client.post("/batches/action", form_of(page, "force-delete"))
    landed = client.follow(answer)
    assert landed.status == 200 and "run: deleted" in html.unescape(landed.text)
    assert store.batch_state("run") is None and store.get(member_id("run", 1)) is None
    api = client.api("/api/batches/action", {"action": "delete", "id": "run"})
    assert api.status == 409 and api.json()["results"][0]["outcome"] == "missing"


# -- end to end ---------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_a_batch_run_by_a_real_beat_and_worker_ends_with_its_ttl_and_then_expires(
    redis_url: str, r: redis.Redis, procs: Procs
) -> None:
    """A real ``celery beat`` and ``celery worker`` (``delayq_batch_expires`` 4 s) run a batch
    of 5 members and its on_complete; the worker's last release finished it: its hash then has a
    TTL of at most 4 s and on_complete got the counts; 4 s later it is in no listing."""
    conf = {"delayq_batch_expires": 4}
    producer = FlowProducer(redis_url, redis_url, **conf)
    try:
        start_flow_stack(procs, env_for(redis_url, redis_url, conf), workers=1, beats=1)
        warm_up_flow(producer, r, procs)
        batch = producer.dq.batch(
            [producer.work.s(0.05, i) for i in range(5)],
            concurrency_limit=2,
            on_complete=producer.done.s("end"),
        )
        assert wait_for(lambda: read_done(r), 60, 0.05), procs.logs()
        counts = {"total": 5, "succeeded": 5, "failed": 0, "cancelled": 0}
        assert read_done(r)[0]["args"] == ["end", batch.id, counts]
        store = get_store(producer.app)
        state = store.batch_state(batch.id)
        assert state is not None and state.done and state.expires_ms is not None
        assert 0 < r.pttl(batch_hash(store, batch.id)) <= 4000
        assert wait_for(lambda: store.batch_state(batch.id) is None, 30, 0.1)
        assert producer.dq.batch_result(batch.id) is None
        assert store.batch_states() == [] and producer.dq.count() == 0
        assert_alive(procs)
    finally:
        producer.close()


@pytest.mark.slow
def test_a_batch_opened_again_under_an_expired_ones_id_is_not_swept(redis_url: str, r: redis.Redis) -> None:
    """The first "again" expires, unswept; a new batch "again" is opened and not finished: the
    sweep keeps it (and drops the stale expiry entry)."""
    store = make_store(redis_url, reclaim_ttl=30.0, batch_expires=0.05)
    open_with_members(store, r, "again", 1)
    store.cancel_batch("again")
    assert wait_for(lambda: store.batch_state("again") is None, 10, 0.02)
    ids = open_with_members(store, r, "again", 2)
    assert store.sweep_batches() == 0
    state = store.batch_state("again")
    assert state is not None and state.total == 2 and not state.done
    assert store.get(ids[0]) is not None
    assert r.zscore(store.keys.for_key(batch_key("again")).batch_expiry, "again") is None
    store.cancel_batch("again")
    store.close()


@pytest.mark.slow
def test_the_beats_chores_sweep_expired_batches_every_minute(
    app_factory: Callable[..., Celery], r: redis.Redis, dispatchers: Callable[..., Any]
) -> None:
    """A beat's chores sweep at once, then every BATCH_SWEEP_EVERY s (its injected clock)."""
    now = [1000.0]
    app = app_factory(delayq_batch_expires=0.05)
    store = get_store(app)
    for bid in ("s1", "s2"):
        open_with_members(store, r, bid, 1)
    store.cancel_batch("s1")
    assert wait_for(lambda: store.batch_state("s1") is None, 10, 0.02)
    dispatcher = dispatchers(app, clock=lambda: now[0])
    dispatcher.chores()
    assert leftovers(store, r, "s1") == []
    store.cancel_batch("s2")
    assert wait_for(lambda: store.batch_state("s2") is None, 10, 0.02)
    now[0] += BATCH_SWEEP_EVERY - 1
    dispatcher.chores()
    assert leftovers(store, r, "s2") != []
    now[0] += 1
    dispatcher.chores()
    assert leftovers(store, r, "s2") == []
