"""The safety poll reads the shards' wake markers and claims only the shards that need it.

Every ``delayq_max_sleep`` s a beat reads the markers (``Store.wake_markers``: TIME and one
MGET) and claims the shards whose marker is due, missing or unreadable. These tests drive a real
:class:`Dispatcher` on a real Redis with an injected monotonic clock, so the safety poll comes
when the test says; a beat that never reads its subscription stands for a lost wake message.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_delayq.beat.chores import BATCH_SWEEP_EVERY
from celery_delayq.beat.dispatch import Dispatcher
from celery_delayq.store.beats import read_marker
from celery_delayq.store.facade import Store
from tests.support.store import published_ids, server_ms

MAX_SLEEP = 20.0
WAKE_NEVER = "9999999999999999"


class Clock:
    """A monotonic clock the test moves, from a whole second: ``now + MAX_SLEEP - now`` is then
    exactly ``MAX_SLEEP``. From ``time.monotonic()`` itself the sum was rounded, about once in
    200 starts to just under it, so the safety poll due at exactly ``delayq_max_sleep`` did not
    run (seen once in CI, 2026-12-04)."""

    def __init__(self) -> None:
        self.now = float(int(time.monotonic()))

    def __call__(self) -> float:
        return self.now


def idle_beat(app: Celery, dispatchers: Callable[..., Dispatcher], **kwargs: Any) -> tuple[Dispatcher, Clock]:
    """A beat after its first pass (every shard claimed, nothing due), with a clock to move."""
    clock = Clock()
    beat = dispatchers(app, clock=clock, **kwargs)
    beat.run_once()
    assert all(nxt is not None for nxt in beat.wake.next)
    return beat, clock


def shards_to_claim(beat: Dispatcher) -> list[int]:
    """The shards the beat's next pass claims, as its wake decides them (with the safety poll
    when one is due): ``run_once`` claims these and no other."""
    return sorted(beat.wake.shards_to_claim())


def test_a_job_whose_wake_message_was_lost_is_delivered_by_the_safety_poll(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    beat, clock = idle_beat(app, dispatchers)
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))  # the beat never reads the message
    shard = beat.store.keys.shard_of(res.id)
    assert shards_to_claim(beat) == []  # it does not know yet
    beat.run_once()
    assert published_ids(r) == []
    clock.now += MAX_SLEEP
    assert shards_to_claim(beat) == [shard]  # only the shard whose marker was due
    beat.run_once()
    assert published_ids(r) == [res.id]


def test_the_safety_poll_claims_no_shard_when_no_marker_is_due(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    add = app.tasks["t.add"]
    later = [add.apply_in(3600 + i, (i, i)) for i in range(40)]  # every shard holds a later job
    beat, clock = idle_beat(app, dispatchers)
    for _ in range(3):
        clock.now += MAX_SLEEP
        assert shards_to_claim(beat) == []
        assert 0 < beat.run_once() <= MAX_SLEEP
    assert published_ids(r) == []
    # The markers told the beat each shard's next due time.
    store = beat.store
    for res in later:
        assert res.due is not None
        assert beat.wake.next[store.keys.shard_of(res.id)] <= res.due.timestamp() * 1000


@pytest.mark.parametrize(
    "corrupt",
    ["deleted", "not a number", "1e3", "nan", "a hash", "too many digits"],
)
def test_a_missing_or_unreadable_marker_means_the_shard_is_claimed(
    corrupt: str, app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    beat, clock = idle_beat(app, dispatchers)
    res = app.tasks["t.add"].apply_in(3600, (1, 2))
    shard = beat.store.keys.shard_of(res.id)
    wake = beat.store.keys.shard(shard).wake
    assert res.due is not None
    assert r.get(wake) == str(round(res.due.timestamp() * 1000))
    # Make the job due now behind the marker's back (as a lost marker would hide it), then
    # spoil the marker.
    r.zadd(beat.store.keys.shard(shard).due, {res.id: server_ms(r) - 1000})
    if corrupt == "deleted":
        r.delete(wake)
    elif corrupt == "a hash":
        r.delete(wake)
        r.hset(wake, "x", "1")
    elif corrupt == "too many digits":
        r.set(wake, "9" * 400)
    else:
        r.set(wake, corrupt)
    clock.now += MAX_SLEEP
    assert shards_to_claim(beat) == [shard]
    beat.run_once()
    assert published_ids(r) == [res.id]
    # The claim wrote the marker again (its lease's expiry: the claim's next due time).
    assert read_marker(r.get(wake)) is not None


def test_a_marker_that_was_lost_does_not_pass_over_a_stored_job(
    app: Celery, r: redis.Redis, store: Store
) -> None:
    """The next wake after a lost marker sets it to the shard's head, not to the new job."""
    add = app.tasks["t.add"]
    first = add.apply_in(600, (1, 1))
    shard = store.keys.shard_of(first.id)
    wake = store.keys.shard(shard).wake
    assert first.due is not None
    first_ms = str(round(first.due.timestamp() * 1000))
    for n, spoil in enumerate((r.delete, lambda key: r.set(key, "garbage"))):
        spoil(wake)
        later = add.apply_in(1200, (2, 2), task_id=_id_on(store, shard, f"later{n}"))
        assert later.due is not None and later.due > first.due
        assert r.get(wake) == first_ms


def _id_on(store: Store, shard: int, stem: str) -> str:
    i = 0
    while store.keys.shard_of(f"{stem}-{i}") != shard:
        i += 1
    return f"{stem}-{i}"


def test_the_safety_poll_reads_the_servers_clock_so_a_stepped_local_clock_misses_nothing(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """The local clock steps back an hour after the beat measured the server's: the poll
    measures it again (TIME, in the same round trip) and claims the due shard."""
    step = [0.0]
    beat, clock = idle_beat(app, dispatchers, wall=lambda: time.time() + step[0])
    step[0] = -3600.0
    res = app.tasks["t.add"].apply_at(time.time() - 1, (1, 2))
    clock.now += MAX_SLEEP
    beat.run_once()
    assert published_ids(r) == [res.id]
    assert abs(beat.server_now_ms() - server_ms(r)) < 1000


def test_unreadable_markers_fall_back_to_claiming_every_shard(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """A Redis error reading the markers: every shard is claimed (the claim reports errors)."""
    beat, clock = idle_beat(app, dispatchers)

    def fail() -> Any:
        raise redis.ConnectionError("gone")

    beat.store.wake_markers = fail  # type: ignore[method-assign]
    clock.now += MAX_SLEEP
    assert shards_to_claim(beat) == list(range(beat.config.shards))


def test_store_wake_markers_reads_the_clock_and_every_marker(store: Store, r: redis.Redis) -> None:
    r.set(store.keys.shard(0).wake, "1700000000000")
    r.set(store.keys.shard(1).wake, WAKE_NEVER)
    r.set(store.keys.shard(2).wake, "soon")
    before = server_ms(r)
    now, markers = store.wake_markers()
    assert before <= now <= server_ms(r)
    assert markers[:3] == [1700000000000.0, 1e16, None]
    assert markers[3:] == [None] * (store.config.shards - 3)
    assert read_marker(b"123") is None  # bytes: not what a decoding client returns


def commandstats(client: redis.Redis) -> Counter[str]:
    return Counter({name: int(s["calls"]) for name, s in client.info("commandstats").items()})


def test_an_idle_beat_runs_a_few_commands_a_safety_poll_and_no_script(
    app: Celery, r: redis.Redis, dispatchers: Callable[..., Dispatcher]
) -> None:
    """Nothing stored: a safety poll is TIME and MGET; the chores due with it are a heartbeat
    (HSET, with an HGETALL every PRUNE_EVERY s), a stall sweep that finds no schedule (one
    EXISTS) and, every BATCH_SWEEP_EVERY s, a batch sweep that finds no finished batch (one
    EXISTS). Counted on the server, commands inside scripts included."""
    beat, clock = idle_beat(app, dispatchers)
    before = commandstats(r)
    for _ in range(3):
        clock.now += MAX_SLEEP
        beat.run_once()
    ran = commandstats(r) - before
    ran["cmdstat_info"] -= 1  # the first snapshot's
    ran = +ran
    batch_sweeps = 1 + int(2 * MAX_SLEEP // BATCH_SWEEP_EVERY)  # the first chores run one
    assert ran == Counter(
        cmdstat_time=3, cmdstat_mget=3, cmdstat_hset=3, cmdstat_exists=3 + batch_sweeps, cmdstat_hgetall=1
    ), ran
